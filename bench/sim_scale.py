"""Simulator scale: 256 peers x 100 data-parallel steps of the digits MLP on this machine.

Prints wall seconds, simulated seconds and the message rate (goal: <= 10 minutes wall).
Usage: python bench/sim_scale.py [--peers 256] [--steps 100]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from phalanx.runs.dp.simulate import simulate
from phalanx.runs.presets import get_preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    config = dataclasses.replace(get_preset("digits-dp"), peers=args.peers, steps=args.steps, preset="sim-scale")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        summary = simulate(config, Path(out), progress=True)
    wall = time.perf_counter() - started
    messages = summary["network"]["messages_sent"]
    print(f"peers                {args.peers}")
    print(f"steps                {args.steps}")
    print(f"wall seconds         {wall:.1f}  (goal <= 600)")
    print(f"simulated seconds    {summary['simulated_seconds']:.2f}")
    print(f"messages             {messages}  ({messages / wall:,.0f} per wall second)")
    print(f"final test accuracy  {summary['final_accuracy']}")


if __name__ == "__main__":
    main()
