"""What every bench shares: its config from `--preset` and `--set`, its output directory, and a CSV written a
row at a time (so a bench cut short still leaves every finished row on disk)."""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TypeVar

from ..core.errors import ConfigError
from ..runs.config import override

C = TypeVar("C")


def bench_config(args: argparse.Namespace, bench: str, presets: Mapping[str, Callable[[], C]]) -> tuple[C, Path]:
    """The preset `args.preset` of `bench` with `args.set` laid over it, and the output directory
    (`args.out`, else runs/bench-BENCH-PRESET). A ConfigError names the presets when the name is unknown."""
    if args.preset not in presets:
        raise ConfigError(f"unknown {bench} preset {args.preset!r}; allowed: {', '.join(presets)}")
    config = override(presets[args.preset](), args.set or [])
    return config, Path(args.out) if args.out else Path("runs") / f"bench-{bench}-{args.preset}"


class CsvRows:
    """A CSV file whose header is the first row's keys; each row is flushed as it is written."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file
        self.writer: csv.DictWriter | None = None

    def write(self, row: dict) -> None:
        if self.writer is None:
            self.writer = csv.DictWriter(self.file, fieldnames=list(row))
            self.writer.writeheader()
        self.writer.writerow(row)
        self.file.flush()
