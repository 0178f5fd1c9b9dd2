"""Experiments: what the CLI runs.

- swarm: roles, identities and run files shared by simulate and launch
- simulate: a swarm in one process on the simulator
- launch: real OS processes over hivemind (`launch`, `peer`)
- report: PNG plots and summary table of a run directory
- robustness: the aggregator x attack benchmark (BTARD Fig. 3 baselines)
- sentinel_bench: SENTINEL's Table 1 on an in-process 4-stage GPT pipeline (`bench sentinel`)
"""
