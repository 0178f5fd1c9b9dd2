"""Runtime: protocol rounds and peer roles, written once against the transport interface.

- butterfly: butterfly all-reduce with a pluggable reduction rule
- mprng: the MPRNG round (commit, reveal, verify, ban, re-run)
- dp_peer: a data-parallel training peer (and its TrainConfig)
- pipeline: pipeline-parallel training over churning peers (data nodes, relays, SWARM / GWTF routing,
  crash repair, joining, per-stage aggregation)
"""
