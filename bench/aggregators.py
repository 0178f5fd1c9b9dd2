"""Speed of phalanx's aggregation rules next to ByzFL's implementations of the same rules.

Times every rule on one stack of n peer vectors of dimension d (float32,
default 16 x 1,000,000: 13 honest rows around a common mean plus f = 3 far
Byzantine rows) and, where ByzFL has the rule, ByzFL's version on the same
stack in the same run. Each cell is the best of ``--repeats`` calls after
one warm-up call, ours and ByzFL's interleaved. The last column is
max |ours - ByzFL| over coordinates, a sanity check that both computed the
same thing; rules defined differently are marked in the notes. Prints
figures only, never asserts on them.

ByzFL is a benchmark-only dependency (``pip install --no-deps byzfl==0.0.11``).
Its package ``__init__`` imports torchvision, so its aggregator modules are
loaded under stub parent packages instead.

    .venv/bin/python bench/aggregators.py [--n 16] [--d 1000000] [--f 3] [--repeats 5] [--threads 0]
"""

import argparse
import importlib
import importlib.metadata
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.algorithms.robust import aggregators as ours  # noqa: E402

Rule = Callable[[Tensor], Tensor]


def load_byzfl() -> tuple[str, types.ModuleType, types.ModuleType] | str:
    """(version, aggregators module, preaggregators module), or why ByzFL is unavailable."""
    try:
        version = importlib.metadata.version("byzfl")
        root = Path(str(importlib.metadata.distribution("byzfl").locate_file("byzfl")))
    except importlib.metadata.PackageNotFoundError:
        return "ByzFL is not installed; install it with: .venv/bin/pip install --no-deps byzfl==0.0.11"
    for name, folder in (("byzfl", root), ("byzfl.aggregators", root / "aggregators")):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [str(folder)]
            sys.modules[name] = stub
    try:
        rules = importlib.import_module("byzfl.aggregators.aggregators")
        mixers = importlib.import_module("byzfl.aggregators.preaggregators")
    except ImportError as error:
        return f"ByzFL {version} is installed but its aggregators fail to import: {error}"
    return version, rules, mixers


def peer_stack(n: int, d: int, f: int, seed: int) -> Tensor:
    """n - f honest rows (common mean plus noise) followed by f far Byzantine rows."""
    generator = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=generator)
    honest = mean + 0.5 * torch.randn(n - f, d, generator=generator)
    byzantine = 100.0 * torch.randn(f, d, generator=generator)
    return torch.cat([honest, byzantine])


def best_times_ms(calls: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Best wall time (ms) of each call over ``repeats`` interleaved rounds after a warm-up round.

    The minimum, rather than a mean, filters out slowdowns caused by other
    processes; interleaving exposes the compared calls to the same load.
    """
    best = [float("inf")] * len(calls)
    for round_index in range(repeats + 1):
        for position, call in enumerate(calls):
            begin = time.perf_counter()
            call()
            elapsed = (time.perf_counter() - begin) * 1e3
            if round_index:
                best[position] = min(best[position], elapsed)
    return best


def byzfl_rules(rules: types.ModuleType, mixers: types.ModuleType, f: int, gm_iters: int, nu: float) -> dict[str, Rule]:
    """ByzFL callables keyed like ``phalanx_rules``; stateful ones are rebuilt per call."""
    return {
        "mean": rules.Average(),
        "median": rules.Median(),
        f"trimmed_mean(trim={f})": rules.TrMean(f=f),
        f"geometric_median({gm_iters} it, from 0)": rules.GeometricMedian(nu=nu, T=gm_iters),
        f"krum(f={f})": rules.Krum(f=f),
        f"multi_krum(f={f}, m=n-f)": rules.MultiKrum(f=f),
        **{
            f"centered_clip(tau=1, {iters} it, from 0)": (
                lambda xs, iters=iters: rules.CenteredClipping(L=iters, tau=1.0)(xs)
            )
            for iters in (1, 10, 100)
        },
        f"nnm(f={f})": mixers.NNM(f=f),
        "bucketing(s=2)": mixers.Bucketing(s=2),
    }


def phalanx_rules(n: int, d: int, f: int, gm_iters: int, nu: float) -> dict[str, Rule]:
    """Our rules with parameters matching ByzFL's where ByzFL has the rule."""
    zeros = torch.zeros(d)
    generator = torch.Generator().manual_seed(0)
    return {
        "mean": ours.mean,
        "median": ours.coordinate_median,
        f"trimmed_mean(trim={f})": lambda xs: ours.trimmed_mean(xs, f),
        f"geometric_median({gm_iters} it, from 0)": (
            lambda xs: ours.geometric_median(xs, eps=nu, max_iters=gm_iters, tol=0.0, start=zeros)
        ),
        f"krum(f={f})": lambda xs: ours.krum(xs, f),
        f"multi_krum(f={f}, m=n-f)": lambda xs: ours.multi_krum(xs, f),
        **{
            f"centered_clip(tau=1, {iters} it, from 0)": (
                lambda xs, iters=iters: ours.centered_clip(xs, 1.0, start=zeros, eps=0.0, max_iters=iters)
            )
            for iters in (1, 10, 100)
        },
        "centered_clip(tau=1, to eps=1e-6, from median)": lambda xs: ours.centered_clip(xs, 1.0),
        f"bulyan(f={f})": lambda xs: ours.bulyan(xs, f),
        f"median_of_means(groups={2 * f + 1})": lambda xs: ours.median_of_means(xs, 2 * f + 1),
        "sign_majority": ours.sign_majority,
        f"nnm(f={f})": lambda xs: ours.nearest_neighbor_mixing(xs, f),
        "bucketing(s=2)": lambda xs: ours.bucketing(xs, 2, generator),
    }


NOTES = {
    "krum": "ByzFL scores with n - f - 1 neighbours, ours with n - f - 2 (Blanchard et al.)",
    "nnm": "ByzFL ranks neighbours by float32 torch.cdist, which can swap nearly tied neighbours "
    "of far rows (a large max |diff|); ours ranks by Gram distances summed in float64",
    "bucketing": "random permutations differ, so values are not compared",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--d", type=int, default=1_000_000)
    parser.add_argument("--f", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gm-iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    nu = 1e-8

    xs = peer_stack(args.n, args.d, args.f, seed=0)
    byzfl = load_byzfl()
    if isinstance(byzfl, str):
        print(byzfl)
        reference: dict[str, Rule] = {}
        label = "ByzFL unavailable"
    else:
        version, rules, mixers = byzfl
        reference = byzfl_rules(rules, mixers, args.f, args.gm_iters, nu)
        label = f"ByzFL {version}"
    print(
        f"n={args.n} d={args.d} float32, f={args.f}; torch {torch.__version__}, "
        f"torch threads={torch.get_num_threads()}; {label}; best of {args.repeats} interleaved calls (ms)"
    )
    header = f"{'rule':46s} {'ours':>9s} {'byzfl':>9s} {'ours/byzfl':>11s} {'max |diff|':>11s}"
    print(header)
    print("-" * len(header))
    for name, rule in phalanx_rules(args.n, args.d, args.f, args.gm_iters, nu).items():
        if name not in reference:
            (our_ms,) = best_times_ms([lambda: rule(xs)], args.repeats)
            print(f"{name:46s} {our_ms:9.1f} {'-':>9s} {'-':>11s} {'-':>11s}")
            continue
        their_rule = reference[name]
        our_ms, their_ms = best_times_ms([lambda: rule(xs), lambda: their_rule(xs)], args.repeats)
        difference = "-" if name.startswith("bucketing") else f"{float((rule(xs) - their_rule(xs)).abs().max()):.2e}"
        print(f"{name:46s} {our_ms:9.1f} {their_ms:9.1f} {our_ms / their_ms:11.3f} {difference:>11s}")
    if reference:
        for rule_name, note in NOTES.items():
            print(f"note: {rule_name}: {note}")


if __name__ == "__main__":
    main()
