"""The `phalanx` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from .config import RunConfig, override
from .core.errors import ConfigError, LocalError
from .pipeline_config import PipelineRunConfig
from .presets import describe, get_preset

# `phalanx bench NAME` runs run_cli(args) of this module of phalanx.experiments.
BENCHES = {
    "robustness": "robustness",
    "btard": "btard_bench",
    "btard-redteam": "btard_redteam",
    "gwtf": "gwtf_bench",
    "aspis": "aspis_bench",
    "sentinel": "sentinel_bench",
}


def _config(args: argparse.Namespace) -> RunConfig:
    flags = [f"{k}={v}" for k in ("peers", "steps", "seed") if (v := getattr(args, k, None)) is not None]
    if getattr(args, "checkpoint_every", None) is not None:
        flags.append(f"checkpoint.every={args.checkpoint_every}")
    if getattr(args, "resume", None):
        from .experiments.checkpoints import resume_config

        config, args.checkpoint = resume_config(Path(args.resume), args.preset, flags + (args.set or []), args.command)
        return config
    return override(get_preset(args.preset), flags + (args.set or []))


def _out(args: argparse.Namespace, config: RunConfig, mode: str) -> Path:
    if getattr(args, "resume", None):
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ConfigError(f"--out {args.out} differs from --resume {args.resume}: a resumed run continues in its own directory")
        return Path(args.resume)
    return Path(args.out) if args.out else Path("runs") / f"{config.preset}-{mode}-seed{config.seed}"


def _checkpoint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-every", type=int, metavar="K", help="write a checkpoint every K steps to OUT/checkpoints (checkpoint.every)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest complete checkpoint")


def _run_options(p: argparse.ArgumentParser, peers_required: bool = False) -> None:
    p.add_argument("preset", help="a preset name (see 'phalanx presets')")
    p.add_argument("--peers", type=int, required=peers_required, help="number of peers")
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--out", help="output directory (default runs/PRESET-MODE-seedS)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.lr=0.05")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx", description="Byzantine-tolerant training on untrusted peers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log protocol events")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="run a simulated swarm in this process")
    _run_options(p)
    _checkpoint_options(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    p = sub.add_parser("launch", help="run N real peers as OS processes on loopback over hivemind")
    _run_options(p, peers_required=True)
    _checkpoint_options(p)
    p.add_argument("--netns", nargs="?", const="", metavar="SPEC", help="each peer in its own network namespace (root);"
                   " SPEC shapes links, e.g. '1:rate=10mbit;2:delay=40ms,jitter=10ms;3:loss=1%%'")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    p = sub.add_parser("peer", help="run one real peer that joins a swarm")
    _run_options(p)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR", help="multiaddrs of peers already in the swarm")
    p.add_argument("--index", type=int, help="experiment index (reproducible identity and role); random identity if omitted")
    p.add_argument("--host", default="/ip4/0.0.0.0/tcp/0", help="multiaddr to listen on")
    p.add_argument("--address-file", help="write this peer's visible multiaddrs to this file")
    p.add_argument("--run-token", default="", help="the run token of the launch to join (its summary's run_token)")

    p = sub.add_parser("report", help="draw PNG plots and a summary table of a run directory")
    p.add_argument("dir")

    sub.add_parser("presets", help="list presets")

    p = sub.add_parser("bench", help="run an experiment benchmark")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("--preset", default="quick", help="benchmark preset: quick or full")
    p.add_argument("--out", help="output directory (default runs/bench-NAME-PRESET)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a benchmark config key")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args)
    except (ConfigError, LocalError) as exc:
        print(f"phalanx: error: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "presets":
        for name, text in describe():
            print(f"{name:18s} {text}")
        return 0
    if args.command == "report":
        from .experiments.report import report

        print(report(Path(args.dir)))
        return 0
    if args.command == "bench":
        return importlib.import_module(f".experiments.{BENCHES[args.name]}", __package__).run_cli(args)
    config = _config(args)
    if getattr(args, "netns", None) is not None and not isinstance(config, RunConfig):
        raise ConfigError(f"--netns runs data-parallel presets only, not {config.preset!r}")
    if isinstance(config, PipelineRunConfig):
        from .experiments.pipeline_run import run_pipeline_cli

        summary = run_pipeline_cli(config, args, _out(args, config, args.command))
    elif args.command == "simulate":
        from .experiments.simulate import simulate

        summary = simulate(config, _out(args, config, "simulate"), progress=not args.no_progress, resume=getattr(args, "checkpoint", None))
    elif args.command == "launch":
        from .experiments.launch import launch
        from .experiments.netns import parse_spec

        netns = None if args.netns is None else parse_spec(args.netns, config.peers)
        summary = launch(config, _out(args, config, "launch"), progress=not args.no_progress, resume=getattr(args, "checkpoint", None), netns=netns)
    else:
        from .experiments.launch import run_single_peer

        summary = run_single_peer(config, args)
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    keys = ("preset", "mode", "peers", "steps", "final_loss", "final_accuracy", "wall_seconds", "simulated_seconds", "banned")
    for key in keys:
        if key in summary:
            value = summary[key]
            print(f"{key:18s} {value:.4f}" if isinstance(value, float) else f"{key:18s} {value}")


if __name__ == "__main__":
    sys.exit(main())
