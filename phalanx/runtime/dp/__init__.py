"""The data-parallel peer and what keeps a swarm of them going.

- peer: a data-parallel training peer (and TrainConfig)
- catchup: state catch-up (join, rejoin, re-sync): the service every replica runs, the joiner's side
- state: a replica's state as canonical bytes, update digests; roster: who trains at a step
- admission: Sybil-resistant admission of BTARD joiners (untrusted until T approvals; agreed state)
- checkpoint: what a peer writes to a checkpoint and takes back on a resume (and CheckpointConfig)
"""
