"""Review RS s24: `_present` in a small stage where one honest relay gets a small share of the traffic.

The residual toy stage of tests/test_sentinel.py::_small_stage_shrinks (16 features, window 64, warm-up 32): relays
r0 (the liar: from microbatch 40 the smallest scale c of its output that the verifier accepts, bisected on
`would_accept`), r1 and r2 honest (3-relay stage), or r1-r3 honest (4-relay stage, Table 1's 25% geometry). Each
microbatch goes to a relay drawn with the given shares: the liar and one honest relay are fast, the last honest
relay slow (a slow relay, or one the routing starves: under SWARM routing a peer's share follows its measured
throughput). Prints the liar's accepted c (median of its last 24 lies, min after its 8th, lies accepted below 0.5), the honest relays banned, how many
checks ran with fewer than 3 present senders. PYTHONPATH=$PWD python small_stage_share.py
"""
import random
import sys

import torch

from phalanx.algorithms.sentinel.statistics import FORWARD, Sentinel, SentinelConfig


def center(features: int = 16) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, features) + 0.05


def run(shares: dict[str, float], seed: int, rounds: int = 400):
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(16, 16, generator=gen) / 4
    rng = random.Random(seed)
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=32, window=64, bind_projections=8))
    names, weights = list(shares), list(shares.values())
    shrinks, thin = [], 0
    for i in range(rounds):
        x = center() + torch.randn(4, 32, 16, generator=gen)
        out = x + torch.tanh(x @ weight)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        sender = names[i % len(names)] if i < 40 else rng.choices(names, weights)[0]
        if sender == "r0" and i >= 40:
            lo, hi = 0.0, 1.0
            for _ in range(10):
                mid = (lo + hi) / 2
                lo, hi = (lo, mid) if verifier.would_accept(1, FORWARD, mid * out, i) else (mid, hi)
            out = hi * out
            shrinks.append(hi)
        verifier.check_forward(1, sender, i, out)
        track = verifier._tracks[(1, FORWARD)]
        if i >= 40 and hasattr(verifier, "_present"):
            thin += len(verifier._present(track)) < 3
    last = sorted(shrinks[-24:])
    return last[len(last) // 2], min(shrinks[8:]), sorted(verifier.banned() - {"r0"}), thin, sum(c < 0.5 for c in shrinks)


if __name__ == "__main__":
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
    for shares in ({"r0": 1 / 3, "r1": 1 / 3, "r2": 1 / 3}, {"r0": 0.44, "r1": 0.44, "r2": 0.12},
                   {"r0": 0.45, "r1": 0.45, "r2": 0.10}, {"r0": 0.3, "r1": 0.3, "r2": 0.3, "r3": 0.1},
                   {"r0": 0.35, "r1": 0.35, "r2": 0.2, "r3": 0.1}):
        for seed in seeds:
            med, low, banned, thin, small = run(shares, seed)
            label = "/".join(f"{v:.2f}" for v in shares.values())
            print(f"shares {label} seed {seed}: liar's c median {med:.3f} (last 24), min {low:.3f} (after its 8th lie), "
                  f"{small} lies accepted at c < 0.5; honest banned {banned}; "
                  f"checks with < 3 present: {thin}")
