"""phalanx from a Python script: the calls the `phalanx` command line itself makes.

    import phalanx.api as px

    config = px.config("btard-digits", steps=40, task="pixel_task:make_task", task_params={"path": "pixels.csv"},
                       set={"train.lr": 0.01, "byzantine.attack": "sign_flip"})
    summary = px.simulate(config, out="runs/mine")      # the whole swarm in this process
    summary = px.launch(config, out="runs/mine-real")   # config.peers OS processes over hivemind
    summary = px.join(config, initial_peers=[...])      # one real peer joining a running swarm

A config is a frozen dataclass (RunConfig, PipelineRunConfig or AspisRunConfig,
by preset); `config` validates it once, and every bad key or value raises a
ConfigError whose message says what to change.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from .config import RunConfig, apply_file, override
from .core.errors import ConfigError
from .pipeline_config import PipelineRunConfig
from .presets import get_preset

AnyConfig = RunConfig | PipelineRunConfig  # or experiments.aspis.AspisRunConfig (aspis-* presets)


def config(
    preset: str = "digits-dp",
    *,
    file: str | Path | None = None,
    task: str = "",
    task_params: Mapping[str, float | str | bool] | None = None,
    set: Mapping[str, object] | Sequence[str] = (),
    **keys: object,
) -> AnyConfig:
    """The preset's config, then `file` (.toml or .json) laid over it, then the keys.

    `keys` are top-level keys (peers=8, steps=40, seed=1); `set` holds dotted
    keys ({"train.lr": 0.01} or ["train.lr=0.01"]); `task` is a task.factory
    ("package.module:function") and `task_params` its keyword arguments.
    """
    base = get_preset(preset)
    if file is not None:
        base = apply_file(base, Path(file))
    assignments = [f"{key}={_text(value)}" for key, value in keys.items()]
    if task:
        assignments.append(f"task.factory={task}")
    assignments += [f"task.params.{key}={_text(value)}" for key, value in (task_params or {}).items()]
    if isinstance(set, Mapping):
        assignments += [f"{key}={_text(value)}" for key, value in set.items()]
    elif isinstance(set, str):
        raise ConfigError(f"set={set!r} must be a mapping or a list of 'key=value' strings, not one string")
    else:
        assignments += list(set)
    return override(base, assignments)


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def default_out(config: AnyConfig, mode: str) -> Path:
    return Path("runs") / f"{config.preset}-{mode}-seed{config.seed}"


def simulate(config: AnyConfig, out: str | Path | None = None, *, progress: bool = False, resume=None) -> dict:
    """Run the whole swarm in this process on the deterministic simulator; write the run's files to `out`.

    Returns the run's summary (also in out/summary.json). `resume` is a
    checkpoint (data-parallel runs; see experiments.checkpoints).
    """
    out = Path(out) if out is not None else default_out(config, "simulate")
    if isinstance(config, PipelineRunConfig):
        from .experiments.pipeline_run import simulate_pipeline

        return simulate_pipeline(config, out, progress=progress)
    from .experiments.simulate import simulate as simulate_run

    return simulate_run(config, out, progress=progress, resume=resume)


def launch(config: AnyConfig, out: str | Path | None = None, *, progress: bool = False, resume=None, netns: str | None = None) -> dict:
    """Run config.peers real peers as OS processes on loopback over hivemind; write the run's files to `out`.

    `netns` (data-parallel runs, root only): a link spec such as "1:rate=10mbit", "" for plain namespaces.
    """
    out = Path(out) if out is not None else default_out(config, "launch")
    if netns is not None and not isinstance(config, RunConfig):
        raise ConfigError(f"--netns runs data-parallel presets only, not {config.preset!r}")
    if isinstance(config, PipelineRunConfig):
        from .experiments.pipeline_launch import launch_pipeline

        return launch_pipeline(config, out, progress=progress)
    from .experiments.launch import launch as launch_run
    from .experiments.netns import parse_spec

    spec = None if netns is None else parse_spec(netns, config.peers)
    return launch_run(config, out, progress=progress, resume=resume, netns=spec)


def join(
    config: AnyConfig,
    initial_peers: Sequence[str] = (),
    *,
    index: int | None = None,
    out: str | Path | None = None,
    host: str = "/ip4/0.0.0.0/tcp/0",
    address_file: str | Path | None = None,
    run_token: str = "",
) -> dict:
    """Start one real peer that joins the swarm at `initial_peers` (multiaddrs) and trains until config.steps.

    `index` picks a reproducible identity and role; None draws a fresh identity.
    `run_token` is the token of the launch to join (its summary's run_token).
    """
    if isinstance(config, PipelineRunConfig):
        raise ConfigError("joining a pipeline run as one peer is not supported yet: use launch for a pipeline run")
    from .experiments.launch import run_single_peer

    args = argparse.Namespace(
        index=index, initial_peers=list(initial_peers), out=None if out is None else str(out), host=host,
        address_file=None if address_file is None else str(address_file), run_token=run_token,
    )
    return run_single_peer(config, args)
