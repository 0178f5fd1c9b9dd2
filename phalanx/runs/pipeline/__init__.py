"""Pipeline runs (GWTF / SWARM routing, SENTINEL verifiers, BTARD per stage).

- config, presets: PipelineRunConfig and its sections; the pipeline presets
- run: roles from a PipelineRunConfig, churn, run files; the simulated run
- launch: data nodes, relays and verifiers as OS processes over hivemind; launch_churn: churn of real relays
- report: loss, throughput per iteration and the stage x time diagram
"""
