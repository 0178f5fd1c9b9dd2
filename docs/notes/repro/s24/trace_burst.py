"""Review RS s24: trace one trial of burst_random.py (every verdict from the warm-up's last iteration on: the scale
fence in force, present senders, voters, flags, bans). PYTHONPATH=$PWD python trace_burst.py SEED ["KIND"]"""
import math
import random
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from burst_random import WARM3, WARM4  # noqa: E402

from phalanx.algorithms.sentinel.statistics import FORWARD, Sentinel, SentinelConfig  # noqa: E402

seed = int(sys.argv[1])
kind = sys.argv[2] if len(sys.argv) > 2 else "all three live"
rng = random.Random(seed)
jumps = [rng.uniform(0.0, 0.3) for _ in range(14)]
warm = WARM4 if kind == "4 relays, r3 silent" else WARM3
senders = {"r1 silent": ["r0", "r2"], "r1 slow": ["r0", "r2"], "all three live": ["r0", "r1", "r2"],
           "4 relays, r3 silent": ["r0", "r1", "r2"]}[kind]
routes = {}
for it in range(5, 14):
    row = [rng.choice(senders) for _ in range(4)] if rng.random() < 0.5 else [rng.choice(senders)] * 4
    if kind == "r1 slow" and rng.random() < 0.33:
        row[rng.randrange(4)] = "r1"
    routes[it] = row
v = Sentinel(SentinelConfig(fence="senders", warmup=20, window=64))
sample = torch.linspace(-1.0, 1.0, 16) + 0.05 + torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
gen = torch.Generator().manual_seed(seed)
level = 0.0
for it, jump in enumerate(jumps):
    level += jump
    for m, s in enumerate(warm[it] if it < 5 else routes[it]):
        t = math.exp(level) * (sample + 1e-3 * torch.randn(4, 8, 16, generator=gen))
        r = v.check_forward(1, s, (it, m), t)
        tr = v._tracks[(1, FORWARD)]
        if it < 4:
            continue
        f = v._fence(tr, "scale") if tr.accepted >= 20 else None
        d = dict(r.distances)
        present = sorted(v._present(tr)) if hasattr(v, "_present") else "-"
        print(f"it {it} mb {m} {s} level {level:.2f} {'FLAG' if r.flagged else 'ok  '} {r.outside} "
              f"scale {d.get('scale', 0):.3f} swd {math.log(max(d.get('swd', 1e-12), 1e-12)):.2f}",
              f"scale fence {f.low:.3f}..{f.high:.3f}" if f else "", "present", present,
              "voters", sorted(v._voters_of(tr)), "BANS" if r.bans else "", r.bans or "")
