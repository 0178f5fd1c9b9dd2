"""Review RS s24: the backward side of `_large_as_its_input` (held against nobody): a downstream relay D that grows
its gradients as far as its own link's fences accept makes the honest next stage's gradients flags that nobody is
struck for, and they are replaced by the momentum.

One verifier, two links of a residual toy (16 features, gradients as in
`test_a_gradient_as_large_as_its_outlier_input_is_no_strike_...`): stage-3 relays d0-d3 send gradients over link 2,
stage-2 relays s0-s3 answer x + tanh(x W) over link 1. After the warm-up, D (one of the four stage-3 relays,
under its own name) sends on every microbatch it gets the largest multiple c in [1, 6] of its honest gradient that
the link-2 verifier accepts (white-box bisection on `would_accept`); the honest stage-2 relay then answers it.
Prints: D's accepted c, how many of the stage-2 gradients D fed were flagged, how many of those struck anybody,
the momentum substitutions, and who is convicted. PYTHONPATH=$PWD python backward_inflater.py
"""
import math
import sys

import torch

from phalanx.algorithms.sentinel.statistics import BACKWARD, Sentinel, SentinelConfig


def run(seed: int, fence: str, lie: bool = True, rounds: int = 120):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(16, 16, generator=gen) / 2
    verifier = Sentinel(SentinelConfig(warmup=24, window=32, bind_projections=8, fence=fence))
    cs, fed, flagged, struck, replaced = [], 0, 0, 0, 0
    for i in range(rounds):
        d = "D" if i % 4 == 0 else f"d{i % 4}"
        s = f"s{(i // 4) % 4}"
        g = math.exp(0.03 * torch.randn((), generator=gen).item()) * torch.randn(4, 64, 16, generator=gen)
        if d == "D" and lie and i >= 40:
            lo, hi = 1.0, 6.0
            for _ in range(12):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if verifier.would_accept(2, BACKWARD, mid * g, i) else (lo, mid)
            g = lo * g
            cs.append(lo)
        v2 = verifier.check_backward(2, d, i, g, upstream={1: s, 2: d})
        g = v2.passed_on(g)
        verifier.record_input(i, 2, BACKWARD, verifier.sketch(g))
        out = g + torch.tanh(g @ weight)
        v1 = verifier.check_backward(1, s, i, out, upstream={1: s, 2: d})
        if d == "D" and i >= 40:
            fed += 1
            flagged += v1.flagged
            struck += bool(v1.suspects)
            replaced += v1.substitute is not None
    return cs, fed, flagged, struck, replaced, sorted(verifier.convicted())


if __name__ == "__main__":
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
    for fence in ("senders", "tukey"):
        for seed in seeds:
            cs, fed, flagged, struck, replaced, convicted = run(seed, fence)
            print(f"{fence:7s} seed {seed}: D's accepted c median {sorted(cs)[len(cs) // 2]:.2f} (min {min(cs):.2f}); "
                  f"of {fed} stage-2 gradients D fed: {flagged} flagged, {struck} struck anybody, {replaced} replaced; "
                  f"convicted {convicted}")
        _, fed, flagged, struck, replaced, convicted = run(0, fence, lie=False)
        print(f"{fence:7s} control (D honest, seed 0): {flagged} of {fed} flagged, convicted {convicted}")
