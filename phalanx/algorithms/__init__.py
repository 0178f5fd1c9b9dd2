"""Algorithms: pure functions and small state machines, no I/O, no clock.

- aggregators: mean, CenteredClip (+ residual), medians, trimmed mean, Krum, Bulyan, ...
- attacks: Byzantine gradient policies (sign flip, ALIE, IPM, min-max, ...)
- mprng: commit-reveal rules of the multi-party random number generator
- bans: the ban ledger with canonical ordering (no leader)
- sentinel: SENTINEL's link statistics (EMAs, distances, Tukey fences, strikes, gradient substitution)
- link_attacks: attacks of pipeline relays on the activations and gradients they send
"""
