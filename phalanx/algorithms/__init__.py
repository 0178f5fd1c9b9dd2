"""Algorithms: pure functions and small state machines, no I/O, no clock.

- aggregators: mean, CenteredClip (+ residual), medians, trimmed mean, Krum, Bulyan, ...
- attacks: Byzantine gradient policies (sign flip, ALIE, IPM, min-max, ...)
- mprng: commit-reveal rules of the multi-party random number generator
- bans: the ban ledger with canonical ordering (no leader)
- flow: GWTF's decentralized flow state machine (Request Flow / Change / Redirect, annealing) and a sync driver
- flowgraph: static staged graphs, networkx min-cost-flow optimum, SWARM's greedy choice (flow tests)
- placement: GWTF leader choice, flooded stage utilization, joiner placement and its baselines
"""
