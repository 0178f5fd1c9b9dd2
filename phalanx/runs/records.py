"""Reading a finished run's files (summary.json, the .jsonl records) and the one number format of the reports;
shared by every kind's report and by `phalanx report`."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import LocalError


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file of a run ([] if it is absent); a LocalError if it is not one."""
    if not path.exists():
        return []
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise LocalError(f"{path} line {exc.lineno} is not JSON: is this a phalanx run directory?") from None
    if not all(isinstance(row, dict) for row in rows):
        raise LocalError(f"{path} holds something other than JSON objects: is this a phalanx run directory?")
    return rows


def read_summary(run_dir: Path) -> dict:
    """A finished run's summary.json, checked to be a phalanx run summary."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise LocalError(f"{summary_path} not found: pass the --out directory of a finished run")
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError:
        summary = None
    if not isinstance(summary, dict) or not {"preset", "peers", "seed"} <= set(summary):
        raise LocalError(f"{summary_path} is not a phalanx run summary: pass the --out directory of a finished run")
    return summary


def format_value(value: object) -> str:
    """A value in a report's table: 4 decimals for floats, "-" for nothing."""
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def count_lines(path: Path) -> int:
    """How many records a .jsonl file holds so far (0 before it exists): a launch's progress."""
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
