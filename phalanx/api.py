"""phalanx from a Python script: the calls the `phalanx` command line itself makes.

    import phalanx.api as px

    config = px.config("btard-digits", steps=40, task="pixel_task:make_task", task_params={"path": "pixels.csv"},
                       set={"train.lr": 0.01, "byzantine.attack": "sign_flip"})
    summary = px.simulate(config, out="runs/mine")      # the whole swarm in this process
    summary = px.launch(config, out="runs/mine-real")   # config.peers OS processes over hivemind
    summary = px.join(config, initial_peers=[...])      # one real peer joining a running swarm

A config is a frozen dataclass (RunConfig, PipelineRunConfig or AspisRunConfig,
by preset); `config` validates it once, and every bad key or value raises a
ConfigError whose message says what to change. Each call dispatches on the
config's run kind (`kinds.KINDS`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from .core.errors import ConfigError, LocalError
from .runs.config import apply_file, override
from .runs.dp.config import RunConfig
from .runs.kinds import kind_named, kind_of
from .runs.pipeline.config import PipelineRunConfig
from .runs.presets import get_preset

AnyConfig = RunConfig | PipelineRunConfig  # or runs.aspis.config.AspisRunConfig (aspis-* presets)


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
    checkpoint (data-parallel runs; see runs.dp.checkpoints).
    """
    kind = kind_of(config)
    out = Path(out) if out is not None else default_out(config, "simulate")
    if resume is None:
        return kind.entry("simulate")(config, out, progress=progress)
    if not kind.resumes:
        raise ConfigError(f"--resume continues data-parallel runs only, not a {kind.name} run ({config.preset!r})")
    return kind.entry("simulate")(config, out, progress=progress, resume=resume)


def launch(config: AnyConfig, out: str | Path | None = None, *, progress: bool = False, resume=None, netns: str | None = None) -> dict:
    """Run config.peers real peers as OS processes on loopback over hivemind; write the run's files to `out`.

    `netns` (root only): each process in its own network namespace; a link spec such as "1:rate=10mbit", "" for
    plain namespaces (hosts are numbered in the order the launch starts its processes: see the kind's launch).
    The bed is closed: a peer outside it (`join`, `phalanx peer`) cannot reach its processes.
    """
    kind = kind_of(config)
    out = Path(out) if out is not None else default_out(config, "launch")
    if netns is not None and kind.hosts is None:
        raise ConfigError(f"--netns is not supported for {config.preset!r} (a {kind.name} run)")
    if resume is not None and not kind.resumes:
        raise ConfigError(f"--resume continues data-parallel runs only, not a {kind.name} run ({config.preset!r})")
    options: dict = {}
    if resume is not None:
        options["resume"] = resume
    if netns is not None:
        from .runs.netns import parse_spec, unavailable_reason

        options["netns"] = parse_spec(netns, kind.entry("hosts")(config))
        reason = unavailable_reason()  # before the launch clears `out`
        if reason is not None:
            raise LocalError(f"--netns: cannot build the test bed here: {reason} (leave out --netns to run on loopback)")
    return kind.entry("launch")(config, out, progress=progress, **options)


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
    kind = kind_of(config)
    if kind.join is None:
        raise ConfigError(f"'phalanx peer' joins data-parallel and pipeline runs only; run {config.preset!r} (a {kind.name} run) with 'phalanx launch'")
    args = argparse.Namespace(
        index=index, initial_peers=list(initial_peers), out=None if out is None else str(out), host=host,
        address_file=None if address_file is None else str(address_file), run_token=run_token,
    )
    return kind.entry("join")(config, args)


def report(run_dir: str | Path) -> str:
    """Draw a finished run's plots into `run_dir` (loss.png, accuracy.png, timeline.png ...); return its summary table."""
    from .runs.records import read_summary

    run_dir = Path(run_dir)
    summary = read_summary(run_dir)
    config_path = run_dir / "config.json"
    try:
        saved = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError):
        saved = {"kind": summary.get("kind", "data-parallel")}  # the summary is enough to draw from
    return kind_named(saved).entry("report")(run_dir, summary)
