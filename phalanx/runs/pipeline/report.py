"""`phalanx report DIR` for a pipeline run: loss, throughput per iteration, stage x time diagram."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

from ..records import format_value, read_jsonl  # noqa: E402


def first_bans(bans: list[dict]) -> dict[str, dict]:
    """Each banned peer's earliest ban record (SENTINEL's reason "sentinel", BTARD's "btard:<reason>")."""
    first: dict[str, dict] = {}
    for ban in sorted(bans, key=lambda b: (b["step"], b.get("t", 0.0))):
        first.setdefault(ban["peer"], ban)
    return first


def report_pipeline(run_dir: Path, summary: dict) -> str:
    """Draw loss.png, throughput.png and stages.png into `run_dir`; return a summary table."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    title = f"{summary['preset']} — {summary['peers']} peers, {summary.get('routing', '?')}, seed {summary['seed']}"

    fig, ax = plt.subplots(figsize=(7, 4))
    points = [(m["step"], m["loss"]) for m in metrics if m.get("loss") is not None]
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="train loss (finished microbatches)")
    ax.set(xlabel="iteration", ylabel="loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [m["step"] for m in metrics]
    ax.bar(steps, [m["completed"] for m in metrics], color="tab:green", label="finished")
    ax.bar(steps, [m["deferred"] for m in metrics], bottom=[m["completed"] for m in metrics], color="tab:red", label="deferred")
    ax2 = ax.twinx()
    ax2.plot(steps, [m["duration"] for m in metrics], "k.-", label="iteration seconds")
    ax.set(xlabel="iteration", ylabel="microbatches", title="throughput per iteration")
    ax2.set_ylabel("seconds")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(run_dir / "throughput.png", dpi=110)
    plt.close(fig)

    computes = [e for e in events if e["kind"] in ("fwd", "bwd")]
    peers = sorted({(e["stage"], e["peer"]) for e in computes})
    row = {key: i for i, key in enumerate(peers)}
    fig, ax = plt.subplots(figsize=(10, max(3, 0.3 * len(peers) + 1)))
    colors = plt.get_cmap("tab20")
    for e in computes:
        colour = colors((e["seq"] * 7 + int(e["src"][:4], 16)) % 20)
        hatch = "//" if e.get("recompute") else None
        ax.broken_barh([(e["t0"], max(e["t1"] - e["t0"], 1e-6))], (row[(e["stage"], e["peer"])] - 0.4, 0.8),
                       facecolor=colour, alpha=0.9 if e["kind"] == "fwd" else 0.5, hatch=hatch)
    for e in events:
        if e["kind"] == "aggregate" and (e["stage"], e["peer"]) in row:
            ax.broken_barh([(e["t0"], e["t1"] - e["t0"])], (row[(e["stage"], e["peer"])] - 0.4, 0.8), facecolor="tab:gray", alpha=0.3)
    bans = read_jsonl(run_dir / "bans.jsonl") if (run_dir / "bans.jsonl").exists() else []
    first = first_bans(bans)
    by_peer = {key[1]: key for key in peers}
    for peer, ban in first.items():
        if peer in by_peer and "t" in ban:
            ax.plot([ban["t"]], [row[by_peer[peer]]], "rx", markersize=12, mew=3)
    ax.set_yticks(range(len(peers)), [f"s{s} {p[:6]}" for s, p in peers])
    ax.set(xlabel="seconds (virtual in simulate, wall in launch)",
           title="where microbatches went: forward (solid), backward (light), recompute (hatched), aggregation (grey), ban (x)")
    fig.tight_layout()
    fig.savefig(run_dir / "stages.png", dpi=110)
    plt.close(fig)

    rows = [
        ("preset", summary["preset"]), ("mode", summary.get("mode", "?")), ("routing", summary.get("routing", "?")),
        ("peers", summary["peers"]), ("iterations", summary["steps"]), ("seed", summary["seed"]),
        ("final train loss", format_value(summary.get("final_loss"))),
        ("microbatches finished", summary.get("microbatches_ok")),
        ("microbatches deferred", summary.get("microbatches_deferred")),
        ("throughput / iteration", format_value(summary.get("throughput_per_iteration"))),
        ("restarts / repairs", f"{summary.get('restarts')} / {summary.get('repairs')}"),
        ("wasted compute seconds", format_value(summary.get("wasted_compute_seconds"))),
        ("wall seconds", format_value(summary.get("wall_seconds"))),
        ("simulated seconds", format_value(summary.get("simulated_seconds"))),
        ("bans (peer, iteration, reason)", "; ".join(f"{p[:8]} {b['step']} {b['reason']}" for p, b in first.items()) or "none"),
    ]
    unverified: dict[int, int] = {}  # off the path: microbatches left out without a verdict of that link's verifier
    for e in events:
        for link in e.get("links", []) if e["kind"] == "unverified" else []:
            unverified[link] = unverified.get(link, 0) + 1
    if unverified:
        rows.append(("unverified microbatches by link", ", ".join(f"{link}: {n}" for link, n in sorted(unverified.items()))))
    silent = [e for e in events if e["kind"] == "verifier_silent"]
    if silent:
        rows.append(("silent verifiers (link, id, iteration)", "; ".join(
            f"{e['link']} {e['verifier'][:8]} {e['it']}{' gone' if e['gone'] else ''}" for e in silent)))
    if summary.get("joiners"):  # launch: what each join of a relay started with --join came to
        outcomes = [o for outs in summary["joiners"].values() for o in outs]
        rows.append(("joins (outcome: count)", ", ".join(f"{o}: {outcomes.count(o)}" for o in sorted(set(outcomes)))))
    if "crashed" in summary:  # launch: processes that exited with an error by themselves
        rows.append(("crashed processes", "; ".join(f"{c['name']} (code {c['code']})" for c in summary["crashed"]) or "none"))
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    if summary.get("sample"):  # a character model's continuation of the start of the validation text
        table += "\n\ntext sample (the first 16 characters are the prompt):\n" + summary["sample"]
    (run_dir / "summary.txt").write_text(table + "\n")
    return table
