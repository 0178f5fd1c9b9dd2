"""Data-parallel runs (butterfly all-reduce, BTARD).

- config, presets: RunConfig and its sections; the data-parallel presets
- swarm: roles, identities and run files shared by simulate and launch
- simulate: a swarm in one process on the simulator; launch: OS processes over hivemind (`launch`, `peer`)
- churn: crashes, restarts, joiners and churn in simulated runs; launch_churn: the same for real workers
- checkpoints: checkpoint directories (atomic files, manifests, keep N), --resume, quiet cuts of simulated runs
- report: PNG plots and the summary table of a run directory
"""
