"""The run kinds: one table maps each kind to its config class and its entry points.

`api` (and through it the command line: simulate, launch, peer, report) dispatches
through `KINDS`; nothing else switches on the kind. Every config writes its kind's
name into config.json (`to_dict`), and `config.kind_name` reads it back (older run
directories name none). Entry points are "module:function" names, imported on use,
so that this table imports none of the runs it names until one is used.

Adding a kind: its config class (with `to_dict` naming the kind and `from_dict`),
its simulate and launch functions `(config, out, progress)`, optionally a report
`(run_dir, summary)` and, for `launch --netns`, the number of hosts its launch
starts with (its launch then takes `netns` and hands it to `ProcessLauncher`),
one row here, and its presets in its own `presets.py`, merged in `runs/presets.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ..core.errors import ConfigError
from .config import kind_name


@dataclass(frozen=True)
class RunKind:
    name: str
    config: str  # the config class
    simulate: str  # (config, out, progress[, resume]) -> summary
    launch: str  # (config, out, progress[, resume][, netns]) -> summary
    report: str  # (run_dir, summary) -> the printed table; draws the PNGs
    join: str | None = None  # (config, args) -> summary: one real peer joining a running swarm
    resumes: bool = False  # simulate and launch take `resume` (a checkpoint)
    hosts: str | None = None  # (config) -> the hosts `launch --netns` builds, one per process it starts; None: no --netns

    def entry(self, name: str) -> Callable:
        module, _, function = getattr(self, name).partition(":")
        return getattr(importlib.import_module(module), function)

    def config_class(self) -> type:
        return self.entry("config")


KINDS: dict[str, RunKind] = {
    kind.name: kind
    for kind in (
        RunKind(
            "data-parallel",
            config="phalanx.runs.dp.config:RunConfig",
            simulate="phalanx.runs.dp.simulate:simulate",
            launch="phalanx.runs.dp.launch:launch",
            report="phalanx.runs.dp.report:report_run",
            join="phalanx.runs.dp.launch:run_single_peer",
            resumes=True,
            hosts="phalanx.runs.dp.launch:launch_hosts",
        ),
        RunKind(
            "pipeline",
            config="phalanx.runs.pipeline.config:PipelineRunConfig",
            simulate="phalanx.runs.pipeline.run:simulate_pipeline",
            launch="phalanx.runs.pipeline.launch:launch_pipeline",
            report="phalanx.runs.pipeline.report:report_pipeline",
            join="phalanx.runs.pipeline.launch:join_pipeline",
            hosts="phalanx.runs.pipeline.launch:launch_hosts",
        ),
        RunKind(
            "aspis",
            config="phalanx.runs.aspis.config:AspisRunConfig",
            simulate="phalanx.runs.aspis.run:simulate_aspis",
            launch="phalanx.runs.aspis.launch:launch_aspis",
            report="phalanx.runs.dp.report:report_run",
            hosts="phalanx.runs.aspis.launch:launch_hosts",
        ),
    )
}


def kind_of(config: object) -> RunKind:
    """The kind whose config class `config` is."""
    for kind in KINDS.values():
        if isinstance(config, kind.config_class()):
            return kind
    raise ConfigError(f"{type(config).__name__} is not the config of any run kind ({', '.join(KINDS)})")


def kind_named(data: dict) -> RunKind:
    """The kind a config.json names."""
    name = kind_name(data)
    if name not in KINDS:
        raise ConfigError(f"config names run kind {name!r}; known kinds: {', '.join(KINDS)}")
    return KINDS[name]
