"""Runtime: protocol rounds and peer roles, written once against the transport interface.

- butterfly: butterfly all-reduce with a pluggable reduction rule
- mprng: the MPRNG round (commit, reveal, verify, ban, re-run)
- btard: the BTARD secure round (commitments, ELIMINATE/ACCUSE, validators, verifications) and BTARDConfig
- dp_peer: a data-parallel training peer (and its TrainConfig)
- aspis: the Aspis / Aspis+ coordinator and worker roles (and AspisConfig)
- catchup: state catch-up (join, rejoin, re-sync), the roster of who trains at a step
- checkpoint: what a peer writes to a checkpoint and takes back on a resume (and CheckpointConfig)
- admission: Sybil-resistant admission of BTARD joiners (untrusted until T approvals; agreed state)
- pipeline: pipeline-parallel training over churning peers (data nodes, relays, SWARM / GWTF routing,
  crash repair, joining, per-stage aggregation)
"""
