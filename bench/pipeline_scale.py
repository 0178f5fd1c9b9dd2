"""Simulator scale of the pipeline runtime: 2 data nodes + 100 relays in 8 stages, 20 iterations.

    PYTHONPATH=. python bench/pipeline_scale.py [--routing gwtf|swarm] [--relays 100] [--steps 20]

Prints the wall seconds, simulated seconds, messages and microbatches finished. Timing is printed,
never asserted.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from phalanx.runs.pipeline.presets import gwtf_table2
from phalanx.runs.pipeline.run import simulate_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routing", default="gwtf", choices=["gwtf", "swarm"])
    parser.add_argument("--relays", type=int, default=100)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    base = gwtf_table2()
    config = replace(base, preset="pipeline-scale", peers=2 + args.relays, data_nodes=2, steps=args.steps,
                     pipeline=replace(base.pipeline, stages=args.stages, routing=args.routing))
    start = time.perf_counter()
    summary = simulate_pipeline(config, None, progress=False)
    wall = time.perf_counter() - start
    finished = sum(m["completed"] for m in summary["metrics"])
    print(f"{args.relays} relays in {args.stages} stages, 2 data nodes, {args.steps} iterations, {args.routing}: "
          f"wall {wall:.1f} s, simulated {summary['simulated_seconds']:.0f} s, {summary['messages']} messages, "
          f"{finished} microbatches finished")


if __name__ == "__main__":
    main()
