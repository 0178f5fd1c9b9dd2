"""Rounds any topology can run over a transport: a data-parallel swarm or the replicas of one pipeline stage.

- butterfly: butterfly all-reduce with a pluggable reduction rule (and AllReduceConfig)
- btard: the BTARD secure round, `SecureRound`: its critical path (join, commit, scatter, reduce, gather) and settling
- btard_state: BTARDConfig, SecureResult, the round's hooks (inputs, admission), the state its parts share
- btard_verify: a step's background verification (MPRNG draw, metadata, V1-V3, reports, seen-set exchange)
- btard_validate: the validators (Alg. 7) and the requests they send and serve
- btard_judge: the verdicts on a step's claims, resolved into bans (and admission's approvals)
- btard_messages: total parsers of the round's signed payloads (malformed: None, then evidence)
- mprng: the MPRNG round (commit, reveal, verify, ban, re-run) and MPRNGConfig
"""
