"""Experiments: what the CLI runs.

- swarm: roles, identities and run files shared by simulate and launch
- simulate: a swarm in one process on the simulator
- launch: real OS processes over hivemind (`launch`, `peer`)
- report: PNG plots and summary table of a run directory
- robustness: the aggregator x attack benchmark (BTARD Fig. 3 baselines)
- gwtf_bench: `bench gwtf` presets flow (Table V) and join (Table IV / Fig. 5); table2 is dispatched to gwtf_table2
"""
