"""A synthetic 256-peer x 1000-step timeline (churn, bans, joins) drawn by report.draw_timeline: python bench/timeline_256x1000.py OUT.png"""
import random
import sys
import time
from pathlib import Path

from phalanx.runs.dp.report import draw_timeline

rng = random.Random(0)
peers, steps = 256, 1000
ids = [f"p{i:03d}" for i in range(peers)]
timeline, bans, crashed = [], [], {}
for p in range(peers):
    start = 0 if p < 224 else rng.randrange(100, 800)  # 32 joiners
    end = steps
    if p % 17 == 5:
        end = rng.randrange(start + 50, steps); bans.append({"step": end, "peer": ids[p], "reason": rng.choice(["gradient", "no_reveal"])})
    elif p % 23 == 7:
        end = rng.randrange(start + 50, steps); crashed[ids[p]] = end - 1
    alive = True
    for s in range(start, end):
        if rng.random() < 0.02: alive = not alive  # churn: leaves and comes back
        if alive:
            t = s * 1.0
            timeline.append({"peer": p, "step": s, "t_start": t, "t_computed": t + 0.3, "t_end": t + 0.8 + 0.4 * (s > 600), "byzantine": p % 17 == 5})
summary = {"peers": peers, "steps": steps, "peer_ids": ids, "crashed": crashed, "byzantine": [ids[p] for p in range(peers) if p % 17 == 5]}
t = time.perf_counter()
draw_timeline(Path(sys.argv[1]), timeline, summary, bans, "synthetic — 256 peers, 1000 steps")
print(f"{len(timeline)} rows drawn in {time.perf_counter() - t:.2f} s")
