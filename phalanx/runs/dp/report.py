"""`phalanx report DIR`: PNG plots and a summary table of a finished run."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
import numpy as np  # noqa: E402

from ..records import format_value, read_jsonl  # noqa: E402


def report_run(run_dir: Path, summary: dict) -> str:
    """Draw loss.png, accuracy.png and timeline.png (binned, see draw_timeline) into `run_dir`; return a summary table."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    timeline = read_jsonl(run_dir / "timeline.jsonl")
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

    draw_timeline(run_dir / "timeline.png", timeline, summary, read_jsonl(run_dir / "bans.jsonl"), title)

    bans = read_jsonl(run_dir / "bans.jsonl")
    if bans:
        _ban_timeline(run_dir, summary, bans, title)

    rows = [
        ("preset", summary["preset"]),
        ("mode", summary.get("mode", "?")),
        ("peers", summary["peers"]),
        ("steps", summary["steps"]),
        ("seed", summary["seed"]),
        ("final train loss", format_value(summary.get("final_loss"))),
        ("final test accuracy", format_value(summary.get("final_accuracy"))),
        ("wall seconds", format_value(summary.get("wall_seconds"))),
        ("simulated seconds", format_value(summary.get("simulated_seconds"))),
        ("byzantine", len(summary.get("byzantine", []))),
        ("crashed", len(summary.get("crashed", []))),
        ("banned", ", ".join(p[:8] for p in summary.get("banned", [])) or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    (run_dir / "summary.txt").write_text(table + "\n")
    return table


MAX_PEER_ROWS = 64  # the timeline bins peers and steps so that it stays readable at any run size
MAX_STEP_COLUMNS = 250


def bin_edges(n: int, most: int) -> np.ndarray:
    """Edges of at most `most` contiguous bins covering range(n), as even as integers allow."""
    return np.unique(np.linspace(0, n, min(n, most) + 1).round().astype(int))


def timeline_bins(timeline: list[dict], peers: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(presence, peer edges, step edges, durations): presence[r, c] is the fraction of the (peer, step) cells of
    bin (r, c) that have a record; durations[k] the step durations (t_end - t_start) recorded in step bin k."""
    rows, cols = bin_edges(max(1, peers), MAX_PEER_ROWS), bin_edges(max(1, steps), MAX_STEP_COLUMNS)
    counts = np.zeros((len(rows) - 1, len(cols) - 1))
    durations: list[list[float]] = [[] for _ in range(len(cols) - 1)]
    for row in timeline:
        if not (0 <= row["peer"] < peers and 0 <= row["step"] < steps):
            continue
        r = np.searchsorted(rows, row["peer"], side="right") - 1
        c = np.searchsorted(cols, row["step"], side="right") - 1
        counts[r, c] += 1
        durations[c].append(row["t_end"] - row["t_start"])
    cells = np.outer(np.diff(rows), np.diff(cols))
    return counts / cells, rows, cols, np.array([np.median(d) if d else np.nan for d in durations])


def draw_timeline(path: Path, timeline: list[dict], summary: dict, bans: list[dict], title: str) -> None:
    """timeline.png: which peers trained which steps, binned (at most 64 peer rows x 250 step columns),
    with crashes, joins and bans marked, and the median step duration per step bin below."""
    peers = max([summary["peers"], *(r["peer"] + 1 for r in timeline)])
    steps = max([summary["steps"], *(r["step"] + 1 for r in timeline)])
    presence, rows, cols, durations = timeline_bins(timeline, peers, steps)
    ids = summary.get("peer_ids", [])
    row_of = lambda peer: np.searchsorted(rows, peer, side="right") - 1 + 0.5  # noqa: E731
    first: dict[int, int] = {}
    for r in timeline:
        first[r["peer"]] = min(first.get(r["peer"], r["step"]), r["step"])
    joins = [(step, peer) for peer, step in first.items() if step > 0]
    crashes = [(step + 1, ids.index(p)) for p, step in summary.get("crashed", {}).items() if p in ids and step is not None]
    banned = [(b["step"], ids.index(b["peer"]), b["reason"]) for b in bans if b["peer"] in ids]

    fig, (ax, ax_time) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    image = ax.pcolormesh(cols, np.arange(len(rows)), presence, cmap="Blues", vmin=0, vmax=1, shading="flat")
    fig.colorbar(image, ax=[ax, ax_time], pad=0.01, fraction=0.03, label="share of the bin's (peer, step) cells trained")
    ax.set_yticks(np.arange(len(rows) - 1) + 0.5 if len(rows) <= 17 else np.linspace(0.5, len(rows) - 1.5, 9))
    ax.set_yticklabels([f"{rows[int(t)]}-{rows[int(t) + 1] - 1}" if rows[int(t) + 1] - rows[int(t)] > 1 else str(rows[int(t)])
                        for t in ax.get_yticks()], fontsize=8)
    byzantine = {ids.index(p) for p in summary.get("byzantine", []) if p in ids}
    for peer in byzantine:
        ax.plot([cols[0] - 0.004 * steps], [row_of(peer)], "s", color="tab:red", ms=4, clip_on=False)
    marks = [(joins, "^", "tab:green", "join"), (crashes, "v", "black", "crash")]
    for points, marker, color, label in marks:
        if points:
            ax.plot([s for s, _ in points], [row_of(p) for _, p in points], marker, color=color, ms=6, ls="", label=label)
    reasons = sorted({reason for _, _, reason in banned})
    for k, reason in enumerate(reasons):
        hits = [(s, p) for s, p, why in banned if why == reason]
        ax.plot([s for s, _ in hits], [row_of(p) for _, p in hits], "x", color=plt.cm.Reds(0.5 + 0.5 * k / max(1, len(reasons))),
                ms=7, mew=2, ls="", label=f"ban: {reason}")
    if joins or crashes or banned:
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    ax.set(ylabel="peer (binned; red: Byzantine)", title=f"timeline — {title}")
    centers = (cols[:-1] + cols[1:]) / 2
    ax_time.plot(centers, durations, color="tab:gray")
    ax_time.set(xlabel="step (binned)", ylabel="median step s")
    ax_time.grid(alpha=0.3)
    ax_time.set_xlim(cols[0] - 0.01 * steps, cols[-1])
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


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
