"""Experiments: what the CLI runs.

- swarm: roles, identities and run files shared by simulate and launch
- simulate: a swarm in one process on the simulator
- launch: real OS processes over hivemind (`launch`, `peer`)
- processes: process hygiene (markers, watchdog, parent-death signals, process groups)
- netns: multi-host test bed (network namespaces, a bridge, shaped links) for `launch --netns`
- tap_link: a user-space link with delay, jitter and loss between two TAP devices (where the kernel lacks netem)
- churn: crashes, restarts, joiners and churn in simulated runs
- checkpoints: checkpoint directories (atomic files, manifests, keep N), --resume, quiet cuts of simulated runs
- launch_churn: churn decisions for `launch` (which workers are killed and started again)
- report: PNG plots and summary table of a run directory
- robustness: the aggregator x attack benchmark (BTARD Fig. 3 baselines)
- aspis: Aspis run config, presets and the simulated run (1 coordinator + K workers)
- aspis_launch: Aspis runs as OS processes over hivemind (`launch` of an Aspis preset)
- aspis_bench: `bench aspis` (distortion fraction, accuracy, detection and coordinator time)
- pipeline_run: pipeline runs in the simulator (roles from a PipelineRunConfig, churn, run files)
- pipeline_launch: pipeline runs as OS processes over hivemind (a relay can be killed mid-iteration)
- pipeline_report: loss, throughput per iteration and stage x time diagram of a pipeline run
- gwtf_table2: `bench gwtf --preset table2` (GWTF Table II, SWARM vs GWTF under churn)
- gwtf_bench: `bench gwtf` presets flow (Table V) and join (Table IV / Fig. 5); table2 is dispatched to gwtf_table2
- sentinel_bench: `bench sentinel` (SENTINEL's Table 1); `--set engine=inprocess` is the in-process reference
- sentinel_sim: the simulator cells of `bench sentinel` (pipeline runtime with verifiers, scored from the attack log)
"""
