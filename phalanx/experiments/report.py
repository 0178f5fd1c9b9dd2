"""`phalanx report DIR`: PNG plots and a summary table of a finished run."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

from ..core.errors import LocalError  # noqa: E402


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise LocalError(f"{path} line {exc.lineno} is not JSON: is this a phalanx run directory?") from None
    if not all(isinstance(row, dict) for row in rows):
        raise LocalError(f"{path} holds something other than JSON objects: is this a phalanx run directory?")
    return rows


def report(run_dir: Path) -> str:
    """Draw loss.png, accuracy.png and timeline.png into `run_dir`; return a summary table."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise LocalError(f"{summary_path} not found: pass the --out directory of a finished run")
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError:
        summary = None
    if not isinstance(summary, dict) or not {"preset", "peers", "seed"} <= set(summary):
        raise LocalError(f"{summary_path} is not a phalanx run summary: pass the --out directory of a finished run")
    if summary.get("kind") == "pipeline":
        from .pipeline_report import report_pipeline

        return report_pipeline(run_dir, summary)
    metrics = _jsonl(run_dir / "metrics.jsonl")
    timeline = _jsonl(run_dir / "timeline.jsonl")
    title = f"{summary['preset']} — {summary['peers']} peers, seed {summary['seed']} ({summary.get('mode', '?')})"

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="train loss (mean over peers)")
    evaluated = [m for m in metrics if "test_loss" in m]
    if evaluated:
        ax.plot([m["step"] for m in evaluated], [m["test_loss"] for m in evaluated], "o-", label="test loss")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    accuracy = [m for m in metrics if "test_accuracy" in m]
    ax.plot([m["step"] for m in accuracy], [m["test_accuracy"] for m in accuracy], "o-")
    ax.set(xlabel="step", ylabel="test accuracy", title=title, ylim=(0, 1))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, max(3, 0.25 * summary["peers"] + 1)))
    for row in timeline:
        color = "tab:red" if row.get("byzantine") else "tab:blue"
        ax.broken_barh([(row["t_start"], row["t_computed"] - row["t_start"])], (row["peer"] - 0.4, 0.8), color=color, alpha=0.8)
        ax.broken_barh([(row["t_computed"], row["t_end"] - row["t_computed"])], (row["peer"] - 0.4, 0.8), color="tab:gray", alpha=0.4)
    ax.set(xlabel="seconds (virtual in simulate, wall in launch)", ylabel="peer", title="per-peer timeline: compute (colour), all-reduce (grey)")
    fig.tight_layout()
    fig.savefig(run_dir / "timeline.png", dpi=110)
    plt.close(fig)

    bans = _jsonl(run_dir / "bans.jsonl")
    if bans:
        _ban_timeline(run_dir, summary, bans, title)

    rows = [
        ("preset", summary["preset"]),
        ("mode", summary.get("mode", "?")),
        ("peers", summary["peers"]),
        ("steps", summary["steps"]),
        ("seed", summary["seed"]),
        ("final train loss", _fmt(summary.get("final_loss"))),
        ("final test accuracy", _fmt(summary.get("final_accuracy"))),
        ("wall seconds", _fmt(summary.get("wall_seconds"))),
        ("simulated seconds", _fmt(summary.get("simulated_seconds"))),
        ("byzantine", len(summary.get("byzantine", []))),
        ("crashed", len(summary.get("crashed", []))),
        ("banned", ", ".join(p[:8] for p in summary.get("banned", [])) or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    (run_dir / "summary.txt").write_text(table + "\n")
    return table


def _ban_timeline(run_dir: Path, summary: dict, bans: list[dict], title: str) -> None:
    """bans.png: when each peer was banned and why (Byzantine peers in red)."""
    ids = summary.get("peer_ids", [])
    byzantine = set(summary.get("byzantine", []))
    fig, ax = plt.subplots(figsize=(8, max(3, 0.3 * len(bans) + 1.5)))
    for k, ban in enumerate(bans):
        color = "tab:red" if ban["peer"] in byzantine else "tab:blue"
        label = f"peer {ids.index(ban['peer'])}" if ban["peer"] in ids else ban["peer"][:8]
        ax.plot([ban["step"]], [k], "o", color=color)
        ax.annotate(f"{label}: {ban['reason']}", (ban["step"], k), xytext=(6, -3), textcoords="offset points", fontsize=8)
    ax.set(xlabel="step", ylabel="ban (in canonical order)", title=f"bans — {title} (red: Byzantine, blue: honest)")
    ax.set_xlim(-1, max(summary.get("steps", 1), max(b["step"] for b in bans) + 1))
    fig.tight_layout()
    fig.savefig(run_dir / "bans.png", dpi=110)
    plt.close(fig)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
