"""Review RS s24: f911ca9 holds a forward flag explained by an outlier input against the upstream workers alone.
Every relay here is honest; the data has a cluster of outlier microbatches (as issue 18's `all` seed 2: microbatches
313, 318, 319, the largest tensors of every link, three within seven microbatches).

The toy of test_an_upstream_that_grows_its_outputs_within_its_fences_is_still_held_to_the_outlier_inputs_it_made
(two residual stages, link 1 and link 2 forward, 4 relays each, warm-up 48, window 64), with U honest. After 60
microbatches a run of 8 microbatches goes through stage-1 relays U, h1a, h1b, h1c in turn, and the data of three of
U's (`cluster`) has a token spread `size` times the usual. Prints the link-2 flags (outside, suspects) and who is
banned. PYTHONPATH=$PWD python outlier_data_frame.py
"""
import sys

import torch

from phalanx.algorithms.sentinel.statistics import FORWARD, Sentinel, SentinelConfig


def center(features: int = 16) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, features) + 0.05


def run(size: float, seed: int = 0, stage1=("U", "h1a", "h1b", "h1c")):
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(16, 16, generator=gen) / 4, torch.randn(16, 16, generator=gen) / 4
    verifier = Sentinel(SentinelConfig(warmup=48, window=64, bind_projections=8))
    odd = {60, 64, 68} if len(stage1) == 4 else {60, 63, 66}  # three of U's microbatches within 9
    flags = []
    for i in range(90):
        spread = size if i in odd else 1.0
        x = center() + spread * torch.randn(4, 32, 16, generator=gen)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        out, sender = x + torch.tanh(x @ w1), stage1[i % len(stage1)]
        v1 = verifier.check_forward(1, sender, i, out)
        verifier.record_input(i, 2, FORWARD, verifier.sketch(out))
        v2 = verifier.check_forward(2, f"h2{i // 4 % 4}", i, out + torch.tanh(out @ w2), upstream={1: sender})
        for v in (v1, v2):
            if v.flagged:
                flags.append((i, v.link, v.outside, v.suspects))
    return flags, sorted(verifier.banned())


if __name__ == "__main__":
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
    for stage1 in (("U", "h1a", "h1b", "h1c"), ("U", "h1a", "h1b")):
        for size in (1.2, 1.3, 1.4, 1.5):
            banned_runs = []
            example = None
            for seed in seeds:
                flags, banned = run(size, seed, stage1)
                if banned:
                    banned_runs.append((seed, banned))
                    example = example or flags
            print(f"{len(stage1)} stage-1 relays, outlier spread x{size}: honest relay banned in {len(banned_runs)} of "
                  f"{len(seeds)} seeds {banned_runs}", f"e.g. flags {example}" if example else "")
