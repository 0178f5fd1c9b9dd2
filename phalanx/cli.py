"""The `phalanx` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
from pathlib import Path

from . import api
from .core.errors import ConfigError, LocalError
from .runs.presets import describe

# `phalanx bench NAME` runs run_cli(args) of this module of phalanx.benchmarks.
BENCHES = {
    "robustness": "robustness",
    "btard": "btard",
    "btard-redteam": "btard_redteam",
    "gwtf": "gwtf",
    "aspis": "aspis",
    "sentinel": "sentinel",
    "pipeline-soak": "pipeline_soak",
    "secure-pipeline": "secure_pipeline",
}


def _config(args: argparse.Namespace) -> api.AnyConfig:
    flags = [f"{k}={v}" for k in ("peers", "steps", "seed") if (v := getattr(args, k, None)) is not None]
    if getattr(args, "checkpoint_every", None) is not None:
        flags.append(f"checkpoint.every={args.checkpoint_every}")
    if getattr(args, "resume", None):
        from .runs.dp.checkpoints import resume_config

        config, args.checkpoint = resume_config(Path(args.resume), args.preset, flags + (args.set or []), args.command)
        return config
    return api.config(args.preset, file=args.config, set=flags + (args.set or []))


def _out(args: argparse.Namespace, config: api.AnyConfig, mode: str) -> Path:
    if getattr(args, "resume", None):
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ConfigError(f"--out {args.out} differs from --resume {args.resume}: a resumed run continues in its own directory")
        return Path(args.resume)
    return Path(args.out) if args.out else api.default_out(config, mode)


def _checkpoint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-every", type=int, metavar="K", help="write a checkpoint every K steps to OUT/checkpoints (checkpoint.every)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest complete checkpoint")


def _run_options(p: argparse.ArgumentParser, peers_required: bool = False) -> None:
    p.add_argument("preset", help="a preset name (see 'phalanx presets')")
    p.add_argument("--peers", type=int, required=peers_required, help="number of peers")
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--seed", type=int, help="run seed")
    p.add_argument("--out", help="output directory (default runs/PRESET-MODE-seedS)")
    p.add_argument("--config", metavar="FILE", help="a .toml or .json file of config keys laid over the preset (e.g. a [task] section)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. train.lr=0.05")


def _watch_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", nargs="?", type=int, const=8765, metavar="PORT",
                   help="serve the live page of this run on 127.0.0.1:PORT (default 8765) while it runs and after, until Ctrl-C")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phalanx", description="Byzantine-tolerant training on untrusted peers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log protocol events")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="run a simulated swarm in this process")
    _run_options(p)
    _checkpoint_options(p)
    _watch_option(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    p = sub.add_parser("launch", help="run N real peers as OS processes on loopback over hivemind")
    _run_options(p, peers_required=True)
    _checkpoint_options(p)
    p.add_argument("--netns", nargs="?", const="", metavar="SPEC", help="each peer in its own network namespace (root);"
                   " SPEC shapes links, e.g. '1:rate=10mbit;2:delay=40ms,jitter=10ms;3:loss=1%%'")
    _watch_option(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    p = sub.add_parser("peer", help="run one real peer that joins a swarm")
    _run_options(p)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR", help="multiaddrs of peers already in the swarm")
    p.add_argument("--index", type=int, help="experiment index (reproducible identity and role); random identity if omitted")
    p.add_argument("--host", default="/ip4/0.0.0.0/tcp/0", help="multiaddr to listen on")
    p.add_argument("--address-file", help="write this peer's visible multiaddrs to this file")
    p.add_argument("--run-token", default="", help="the run token of the launch to join (its summary's run_token)")

    p = sub.add_parser("watch", help="serve a live page of a run directory (running or finished, here or shared)")
    p.add_argument("dir")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default: this machine only)")
    p.add_argument("--port", type=int, default=8765)

    p = sub.add_parser("report", help="draw PNG plots and a summary table of a run directory")
    p.add_argument("dir")

    sub.add_parser("presets", help="list presets")
    sub.add_parser("attacks", help="list the attacks of every axis and the config keys that select them")

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
    except BrokenPipeError:  # the reader went away (`phalanx presets | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail again
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "presets":
        for name, text in describe():
            print(f"{name:18s} {text}")
        return 0
    if args.command == "attacks":
        from .runs.attack_axes import describe as describe_attacks

        for axis, name, text, keys in describe_attacks():
            print(f"{axis:10s} {name:19s} {text}  [{keys}]")
        return 0
    if args.command == "watch":
        from .runs.watch import serve

        serve(Path(args.dir), args.host, args.port)
        return 0
    if args.command == "report":
        print(api.report(args.dir))
        return 0
    if args.command == "bench":
        return importlib.import_module(f".benchmarks.{BENCHES[args.name]}", __package__).run_cli(args)
    config = _config(args)
    resume = getattr(args, "checkpoint", None)
    if args.command == "peer":
        summary = api.join(config, args.initial_peers, index=args.index, out=args.out, host=args.host,
                           address_file=args.address_file, run_token=args.run_token)
        _print_summary(summary)
        return 0
    out = _out(args, config, args.command)
    watch = None
    if args.watch is not None:
        from .runs.watch import BackgroundWatch

        watch = BackgroundWatch(out, port=args.watch)
        print(f"watch this run at {watch.url}", file=sys.stderr, flush=True)
    try:
        if args.command == "simulate":
            summary = api.simulate(config, out, progress=not args.no_progress, resume=resume)
        else:
            summary = api.launch(config, out, progress=not args.no_progress, resume=resume, netns=args.netns)
        _print_summary(summary)
        if watch is not None:
            print(f"run finished; its page stays at {watch.url} until Ctrl-C", file=sys.stderr, flush=True)
            _wait_for_interrupt()
    finally:
        if watch is not None:
            watch.stop()
    return 0


def _wait_for_interrupt() -> None:
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass


def _print_summary(summary: dict) -> None:
    keys = ("preset", "mode", "peers", "steps", "peer_id", "stage", "final_loss", "final_accuracy", "wall_seconds",
            "simulated_seconds", "banned")
    for key in keys:
        if key in summary:
            value = summary[key]
            print(f"{key:18s} {value:.4f}" if isinstance(value, float) else f"{key:18s} {value}")


if __name__ == "__main__":
    sys.exit(main())
