"""Experiments: what the CLI runs.

- swarm: roles, identities and run files shared by simulate and launch
- simulate: a swarm in one process on the simulator
- launch: real OS processes over hivemind (`launch`, `peer`)
- processes: process hygiene (markers, watchdog, parent-death signals, process groups)
- churn: crashes, restarts, joiners and churn in simulated runs
- report: PNG plots and summary table of a run directory
- robustness: the aggregator x attack benchmark (BTARD Fig. 3 baselines)
- aspis: Aspis run config, presets and the simulated run (1 coordinator + K workers)
- aspis_launch: Aspis runs as OS processes over hivemind (`launch` of an Aspis preset)
- aspis_bench: `bench aspis` (distortion fraction, accuracy, detection and coordinator time)
"""
