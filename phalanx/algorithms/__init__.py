"""Algorithms: pure functions and small state machines, no I/O, no clock; one subpackage per system.

- robust/: aggregators (mean, CenteredClip, medians, Krum, ...), the one (rule, n, f) table, owners' reducers,
  and the gradient attack axis (sign flip, ALIE, IPM, ...)
- btard/: the secure round's checks and canonical ban order, the ban ledger, MPRNG rules, admission of
  joiners (App. F), the protocol attack axis, the red-team strategy
- gwtf/: the decentralized flow state machine, static flow graphs and their optimum, leader and joiner placement
- sentinel/: link statistics (EMAs, fences, strikes, substitution) and the link attack axis
- aspis/: task assignments and designs, clique / degree detection and majority vote, the redundancy attack axis
- catchup: state manifests and the digest-agreement rules a joining peer trusts (any data-parallel swarm)
"""
