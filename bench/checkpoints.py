"""Checkpoints of simulated runs: cost, size, and whether a resumed run is the uninterrupted one.

For each preset, three runs of STEPS steps: without checkpoints, with
checkpoint.every=EVERY (uninterrupted), and with the same setting stopped at
STEPS/2 then resumed to STEPS. Prints the wall seconds of each, the size of
one checkpoint, whether the resumed run's metrics.jsonl, timeline.jsonl and
bans.jsonl are byte-identical to the uninterrupted one's, and how the
checkpointed run differs from the one without (the quiet cut may delay peers:
equal losses, and the largest gap in the `time` column).

    PYTHONPATH=. .venv/bin/python bench/checkpoints.py [--presets digits-dp,digits-dp-lossy,digits-dp-hetero] [--steps 40] [--every 10] [--peers 16] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from phalanx.runs.config import override
from phalanx.runs.dp.checkpoints import CheckpointStore, resume_config
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.presets import get_preset

FILES = ("metrics.jsonl", "timeline.jsonl", "bans.jsonl")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="digits-dp,digits-dp-lossy,digits-dp-hetero")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config keys for every run")
    args = parser.parse_args()
    half = args.steps // 2
    print(f"{'preset':18} {'plain s':>8} {'ckpt s':>8} {'cut+resume s':>13} {'ckpt MB':>8} {'identical':>9} {'same loss':>9} {'max time gap s':>15}")
    for preset in args.presets.split(","):
        base = [f"peers={args.peers}", *args.set, f"checkpoint.every={args.every}"]
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            plain = simulate(override(get_preset(preset), [f"peers={args.peers}", *args.set, f"steps={args.steps}"]), tmp / "plain", progress=False)
            whole = simulate(override(get_preset(preset), [*base, f"steps={args.steps}"]), tmp / "whole", progress=False)
            cut = simulate(override(get_preset(preset), [*base, f"steps={half}"]), tmp / "cut", progress=False)
            config, checkpoint = resume_config(tmp / "cut", preset, [f"steps={args.steps}"], "simulate")
            resumed = simulate(config, tmp / "cut", progress=False, resume=checkpoint)
            identical = all(
                (tmp / "cut" / f).read_bytes() == (tmp / "whole" / f).read_bytes()
                for f in FILES
                if (tmp / "whole" / f).exists() or (tmp / "cut" / f).exists()
            )
            latest = CheckpointStore(tmp / "whole" / "checkpoints").latest()
            size = sum(p.stat().st_size for p in latest.dir.iterdir()) / 1e6
            a, b = _rows(tmp / "plain"), _rows(tmp / "whole")
            same_loss = [r["loss"] for r in a] == [r["loss"] for r in b]
            gap = max(abs(x["time"] - y["time"]) for x, y in zip(a, b))
        print(
            f"{preset:18} {plain['wall_seconds']:8.1f} {whole['wall_seconds']:8.1f}"
            f" {cut['wall_seconds'] + resumed['wall_seconds']:13.1f} {size:8.2f} {identical!s:>9} {same_loss!s:>9} {gap:15.4f}"
        )


if __name__ == "__main__":
    main()
