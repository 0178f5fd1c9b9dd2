"""Steps per minute of a simulated 16-peer run under churn (leave and join rates per step).

Each row runs `digits-dp` with faults.leave_rate = faults.join_rate = RATE and
prints wall-clock steps per minute, simulated steps per minute, how many
(re)joins happened, and whether every replica that finished ends with the
same state digest.

    PYTHONPATH=. .venv/bin/python bench/churn_rate.py [--rates 0,0.05,0.1] [--steps 60] [--peers 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from phalanx.runs.config import override
from phalanx.runs.dp.simulate import simulate
from phalanx.runs.presets import get_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0,0.05,0.1")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--peers", type=int, default=16)
    args = parser.parse_args()
    print(f"{'rate':>6} {'wall s':>8} {'steps/min wall':>15} {'steps/min sim':>14} {'joins':>6} {'crashes':>8} {'digests':>8} {'accuracy':>9}")
    for rate in [float(r) for r in args.rates.split(",")]:
        config = override(
            get_preset("digits-dp"),
            [f"peers={args.peers}", f"steps={args.steps}", f"faults.leave_rate={rate}", f"faults.join_rate={rate}"],
        )
        with tempfile.TemporaryDirectory() as out:
            s = simulate(config, Path(out), progress=False)
        digests = len(set(s["final_digests"].values())) if s["final_digests"] else "-"
        print(
            f"{rate:6.2f} {s['wall_seconds']:8.1f} {60 * args.steps / s['wall_seconds']:15.1f}"
            f" {60 * args.steps / s['simulated_seconds']:14.1f} {s['joins']:6d} {len(s['crashed']):8d} {digests!s:>8}"
            f" {s['final_accuracy']:9.3f}"
        )


if __name__ == "__main__":
    main()
