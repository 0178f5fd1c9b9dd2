"""Review RS s24: random bursty routes on the helper's burst toy (honest replicas, a fast-moving model).

Each trial: a 20-tensor warm-up of 3 relays (WARM below, r1 carrying 8), then 9 iterations of 4 microbatches, each
iteration either one relay's burst or a random split, the model's log-magnitude growing by U(0, 0.3) per iteration.
Kinds: r1 silent after the warm-up (banned by another defence, as at the session-23 merge); r1 slow (about one
tensor per 3 iterations); all three live; and a 4-relay stage with one relay silent. Every sender is honest: any
ban is an honest ban. Prints the number of trials (of N) with an honest relay banned, for `senders` and `tukey`.
PYTHONPATH=$PWD python burst_random.py [N]
"""
import math
import random
import sys

import torch

from phalanx.algorithms.sentinel.statistics import FORWARD, Sentinel, SentinelConfig

WARM3 = [["r0", "r1", "r1", "r2"], ["r1", "r1", "r0", "r2"], ["r0", "r2", "r1", "r1"], ["r1", "r1", "r0", "r2"],
         ["r0", "r2", "r0", "r2"]]
WARM4 = [["r0", "r1", "r3", "r2"], ["r1", "r3", "r0", "r2"], ["r0", "r2", "r1", "r3"], ["r1", "r3", "r0", "r2"],
         ["r0", "r2", "r1", "r3"]]


def run(fence, route, jumps, noise_seed):
    verifier = Sentinel(SentinelConfig(fence=fence, warmup=20, window=64))
    sample = torch.linspace(-1.0, 1.0, 16) + 0.05 + torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(noise_seed)
    level, flags = 0.0, 0
    for it, jump in enumerate(jumps):
        level += jump
        for m, sender in enumerate(route(it)):
            tensor = math.exp(level) * (sample + 1e-3 * torch.randn(4, 8, 16, generator=gen))
            flags += verifier.check_forward(1, sender, (it, m), tensor).flagged
    return flags, sorted(verifier.banned())


def trial(kind, fence, seed):
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
    return run(fence, lambda it: warm[it] if it < 5 else routes[it], jumps, seed)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    for kind in ("r1 silent", "r1 slow", "all three live", "4 relays, r3 silent"):
        for fence in ("senders", "tukey"):
            bad = [s for s in range(n) if trial(kind, fence, s)[1]]
            print(f"{kind:22s} {fence:8s}: honest relay banned in {len(bad)} of {n} trials {bad[:8]}")
