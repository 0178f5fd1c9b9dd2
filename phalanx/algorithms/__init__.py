"""Algorithms: pure functions and small state machines, no I/O, no clock.

- aggregators: mean, CenteredClip (+ residual), medians, trimmed mean, Krum, Bulyan, ...
- attacks: Byzantine gradient policies (sign flip, ALIE, IPM, min-max, ...)
- mprng: commit-reveal rules of the multi-party random number generator
- bans: the ban ledger with canonical ordering (no leader)
- aspis_designs: Aspis subset assignment, Steiner triple systems, design checks, per-iteration permutations
- aspis: agreement graph, clique and windowed-degree detection, majority vote aggregation (Aspis Alg. 1-3)
- aspis_attacks: ATT-1/2/3 orchestrations (who lies on which file), Theorem 1, symbolic distortion counting
- reducers: the rule a partition owner applies, by name (CenteredClip with tau/eps/cap, ...)
- btard_checks: BTARD verification math (V1-V3, validation, CHECKAVERAGING) with derived tolerances, claims and their canonical resolution
- btard_attacks: BTARD protocol-level attack policies (aggregation, reputation, protocol violations)
- admission: Sybil-resistant admission of mid-run joiners (untrusted -> trusted after T approvals)
- catchup: state manifests and the digest-agreement rules a joining peer trusts
- flow: GWTF's decentralized flow state machine (Request Flow / Change / Redirect, annealing) and a sync driver
- flowgraph: static staged graphs, networkx min-cost-flow optimum, SWARM's greedy choice (flow tests)
- placement: GWTF leader choice, flooded stage utilization, joiner placement and its baselines
- sentinel: SENTINEL's link statistics (EMAs, distances, Tukey fences, strikes, gradient substitution)
- link_attacks: attacks of pipeline relays on the activations and gradients they send
"""
