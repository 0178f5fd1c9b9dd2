"""Rounds any topology can run over a transport: a data-parallel swarm or the replicas of one pipeline stage.

- butterfly: butterfly all-reduce with a pluggable reduction rule (and AllReduceConfig)
- btard: the BTARD secure round (commitments, ELIMINATE / ACCUSE, validators, verifications) and BTARDConfig
- btard_messages: total parsers of the round's signed payloads (malformed: None, then evidence)
- mprng: the MPRNG round (commit, reveal, verify, ban, re-run) and MPRNGConfig
"""
