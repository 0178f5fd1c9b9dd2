"""Runtime: protocol rounds and peer roles, written once against the transport interface.

- rounds/: rounds any topology can run: butterfly all-reduce, the BTARD secure round, MPRNG
- dp/: the data-parallel peer, state catch-up and the roster, admission of BTARD joiners, checkpoint contents
- pipeline/: pipeline-parallel training over churning peers (data nodes, relays, SWARM / GWTF routing,
  crash repair, joining, per-stage aggregation, SENTINEL verifiers, BTARD per stage)
- aspis/: the Aspis / Aspis+ coordinator and worker roles
"""
