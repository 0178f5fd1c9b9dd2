"""Algorithms: pure functions and small state machines, no I/O, no clock.

- aggregators: mean, CenteredClip (+ residual), medians, trimmed mean, Krum, Bulyan, ...
- attacks: Byzantine gradient policies (sign flip, ALIE, IPM, min-max, ...)
- mprng: commit-reveal rules of the multi-party random number generator
- bans: the ban ledger with canonical ordering (no leader)
- catchup: state manifests and the digest-agreement rules a joining peer trusts
"""
