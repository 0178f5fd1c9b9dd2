"""BTARD, pure: the checks of the secure round, bans, MPRNG rules, admission, and the protocol attack axis.

- checks: verification math (V1-V3, validation, CHECKAVERAGING) with derived tolerances, claims, their canonical order
- bans: the ban ledger every honest peer agrees on, with no leader (App. D.3)
- mprng: commit-reveal rules of the multi-party random number generator (App. A.2)
- admission: Sybil-resistant admission of mid-run joiners (untrusted -> trusted after T approvals, App. F)
- anchor: the chain of per-step state digests trusted peers sign, which a joiner verifies from the initial set (App. F)
- attacks: the protocol attack axis (aggregation, reputation, protocol violations; App. C)
- redteam: a randomized multi-point Byzantine strategy for the red-team harness
"""
