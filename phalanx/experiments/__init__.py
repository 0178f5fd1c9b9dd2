"""Experiments: what the CLI runs.

- swarm: roles, identities and run files shared by simulate and launch
- simulate: a swarm in one process on the simulator
- launch: real OS processes over hivemind (`launch`, `peer`)
- processes: process hygiene (markers, watchdog, parent-death signals, process groups)
- churn: crashes, restarts, joiners and churn in simulated runs
- report: PNG plots and summary table of a run directory
- robustness: the aggregator x attack benchmark (BTARD Fig. 3 baselines)
"""
