"""Runs: what `phalanx simulate | launch | peer | report` do, one subpackage per run kind.

- kinds: the table of run kinds (config class, simulate, launch, join, report); api and cli dispatch through it
- config: config machinery of every kind (overrides, files, the kind in config.json) and the simulated network
- presets: every preset by name (`phalanx presets`); attack_axes: the four attack axes and their config check
- dp/, pipeline/, aspis/: per kind its config, presets, simulated run, launch and report
- launcher, processes: one process launcher for every kind (markers, watchdog, parent-death signal, sweeps)
- netns, tap_link: the multi-host test bed (namespaces, bridge, shaped links) for `launch --netns`
- live, watch, watch_page: records written as a run goes, and the live page that follows them
- records: reading a finished run's files (summary, .jsonl records) for the reports
"""
