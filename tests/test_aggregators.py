"""Tests for the robust aggregation rules in phalanx.algorithms.robust.aggregators."""

import itertools

import pytest
import torch

from phalanx.algorithms.robust import aggregators as agg


def _honest_ball(count: int, d: int, radius: float, seed: int) -> torch.Tensor:
    """``count`` float64 points around a fixed center, each within ``radius`` of their mean."""
    generator = torch.Generator().manual_seed(seed)
    center = torch.randn(d, generator=generator, dtype=torch.float64)
    noise = torch.randn(count, d, generator=generator, dtype=torch.float64)
    noise -= noise.mean(dim=0)
    noise *= radius / (2 * torch.linalg.vector_norm(noise, dim=1).max())
    return center + noise


def _contaminated(n: int, f: int, d: int, seed: int, radius: float = 1.0, outlier_norm: float = 1e6) -> torch.Tensor:
    """n - f honest rows within ``radius`` of their mean, then f identical far outliers."""
    honest = _honest_ball(n - f, d, radius, seed)
    direction = torch.ones(d, dtype=torch.float64) / d**0.5
    return torch.cat([honest, (outlier_norm * direction).expand(f, d)])


def test_centered_clip_with_huge_tau_is_the_mean() -> None:
    xs = torch.randn(16, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(agg.centered_clip(xs, tau=1e12), xs.mean(dim=0), atol=1e-12)


def test_centered_clip_stops_at_a_fixed_point() -> None:
    xs = torch.randn(16, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    eps = 1e-6
    result = agg.centered_clip_with_info(xs, tau=5.0, eps=eps, max_iters=1000)
    direct = agg.centered_clip_residual(xs, result.value, 5.0)
    assert result.iterations < 1000
    # The last update had norm <= eps and the iteration contracts, so ||residual|| / n <= eps.
    assert torch.linalg.vector_norm(direct) / 16 <= eps
    assert result.residual_norm == pytest.approx(float(torch.linalg.vector_norm(direct)), rel=1e-3, abs=1e-9)


def test_centered_clip_stays_near_honest_mean_under_outliers() -> None:
    n, f, tau, radius = 16, 7, 10.0, 1.0
    xs = _contaminated(n, f, d=64, seed=2, radius=radius)
    honest_mean = xs[: n - f].mean(dim=0)
    v = agg.centered_clip(xs, tau=tau, eps=1e-9)
    # At the fixed point every outlier contributes a clipped vector of norm tau and, as long as
    # honest rows stay within tau of v, sum_honest (x_i - v) = (n - f)(mean_honest - v); hence
    # ||v - mean_honest|| <= f * tau / (n - f) = 7.78. Honest rows are within radius/2 + 7.78 < tau.
    bound = f * tau / (n - f)
    shift = float(torch.linalg.vector_norm(v - honest_mean))
    assert shift <= bound + 1e-6
    assert shift >= 0.9 * bound  # aligned outliers make the bound tight
    assert float(torch.linalg.vector_norm(xs.mean(dim=0) - honest_mean)) > 1e5


def test_centered_clip_residual_vanishes_only_at_the_fixed_point() -> None:
    xs = _contaminated(16, 5, d=64, seed=3)
    v = agg.centered_clip(xs, tau=1.0, eps=1e-10)
    at_output = torch.linalg.vector_norm(agg.centered_clip_residual(xs, v, 1.0))
    at_mean = torch.linalg.vector_norm(agg.centered_clip_residual(xs, xs.mean(dim=0), 1.0))
    assert at_output < 1e-8
    assert at_mean > 1.0


def test_centered_clip_float32_matches_plain_iteration_from_given_start() -> None:
    xs = torch.randn(12, 5000, generator=torch.Generator().manual_seed(4))
    v = torch.zeros(5000)
    for _ in range(7):
        offsets = xs - v
        weights = torch.clamp(2.0 / torch.linalg.vector_norm(offsets, dim=1), max=1.0)
        v = v + (weights[:, None] * offsets).mean(dim=0)
    ours = agg.centered_clip(xs, tau=2.0, start=torch.zeros(5000), eps=0.0, max_iters=7)
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, v, atol=1e-5)


def test_centered_clip_float32_is_accurate_from_a_far_start() -> None:
    # Rows sit ~42000 away from the zero start but only ~200 apart: float32 Gram products around
    # the start would lose ~1e-5 relative accuracy; the rule must notice and match float64.
    generator = torch.Generator().manual_seed(12)
    rows = 300 * torch.randn(20_000, generator=generator, dtype=torch.float64)
    rows = rows + torch.randn(16, 20_000, generator=generator, dtype=torch.float64)
    rows[-4:] += 50 * torch.randn(4, 20_000, generator=generator, dtype=torch.float64)
    xs = rows.float()
    ours = agg.centered_clip(xs, 100.0, start=torch.zeros(20_000), eps=1e-7, max_iters=5000)
    far_start = torch.zeros(20_000, dtype=torch.float64)
    reference = agg.centered_clip(xs.double(), 100.0, start=far_start, eps=1e-7, max_iters=5000)
    assert float(torch.linalg.vector_norm(ours.double() - reference) / torch.linalg.vector_norm(reference)) < 5e-7


def test_centered_clip_tau_schedule_and_zero_distance() -> None:
    xs = torch.zeros(5, 10, dtype=torch.float64)
    xs[4] = 3.0
    asked: list[int] = []

    def schedule(iteration: int) -> float:
        asked.append(iteration)
        return 1.0

    # Starting exactly on four rows (distance 0, weight 1); the fixed point balances them
    # against the clipped far row: 4 * ||v|| = tau.
    result = agg.centered_clip_with_info(xs, tau_schedule=schedule, start=xs[0], max_iters=50)
    assert asked[:3] == [0, 1, 2]
    assert torch.isfinite(result.value).all()
    assert float(torch.linalg.vector_norm(result.value)) == pytest.approx(0.25, abs=1e-6)
    with pytest.raises(ValueError, match="tau"):
        agg.centered_clip(xs, tau=0.0)


def test_krum_returns_an_honest_row() -> None:
    n, f = 11, 4
    xs = _contaminated(n, f, d=32, seed=5)
    xs[n - f :] += torch.randn(f, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    chosen = agg.krum(xs, f)
    assert any(torch.equal(chosen, row) for row in xs[: n - f])


def test_krum_matches_brute_force_scores() -> None:
    xs = torch.randn(9, 20, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    f = 2
    distances = torch.cdist(xs, xs) ** 2
    scores = [sorted(distances[i, j] for j in range(9) if j != i)[: 9 - f - 2] for i in range(9)]
    best = min(range(9), key=lambda i: sum(scores[i]))
    assert torch.equal(agg.krum(xs, f), xs[best])
    order = sorted(range(9), key=lambda i: sum(scores[i]))
    assert torch.allclose(agg.multi_krum(xs, f, m=4), xs[order[:4]].mean(dim=0))
    assert torch.allclose(agg.multi_krum(xs, f), xs[order[: 9 - f]].mean(dim=0))


def test_krum_uses_n_minus_f_minus_2_neighbours() -> None:
    # With 2 = n - f - 2 neighbours 5.05 has the tightest pair; with 3 neighbours 5.0 would win.
    xs = torch.tensor([[0.0], [0.1], [5.0], [5.05], [5.1]], dtype=torch.float64)
    assert torch.equal(agg.krum(xs, 1), torch.tensor([5.05], dtype=torch.float64))


def _bulyan_by_hand(xs: torch.Tensor, f: int) -> torch.Tensor:
    """Reference Bulyan with plain loops: recursive Krum, then per-coordinate beta closest to the median."""
    remaining = list(range(xs.shape[0]))
    selected = []
    while len(selected) < xs.shape[0] - 2 * f:
        neighbours = max(len(remaining) - f - 2, 1)
        scores = {
            i: sum(sorted(float(((xs[i] - xs[j]) ** 2).sum()) for j in remaining if j != i)[:neighbours])
            for i in remaining
        }
        best = min(remaining, key=lambda i: (scores[i], i))
        selected.append(best)
        remaining.remove(best)
    beta = len(selected) - 2 * f
    result = []
    for column in range(xs.shape[1]):
        values = sorted(float(xs[i, column]) for i in selected)
        middle = len(values) // 2
        median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
        closest = sorted(values, key=lambda value: abs(value - median))[:beta]
        result.append(sum(closest) / beta)
    return torch.tensor(result, dtype=xs.dtype)


@pytest.mark.parametrize(("n", "f"), [(11, 2), (8, 1), (15, 3)])
def test_bulyan_matches_reference(n: int, f: int) -> None:
    xs = torch.randn(n, 6, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    xs[:f] *= 50
    assert torch.allclose(agg.bulyan(xs, f), _bulyan_by_hand(xs, f), atol=1e-12)


def test_krum_and_bulyan_reject_too_few_peers() -> None:
    xs = torch.randn(10, 4)
    agg.krum(xs, 3)
    with pytest.raises(ValueError, match="n > 2f \\+ 2"):
        agg.krum(xs, 4)
    with pytest.raises(ValueError, match="n > 2f \\+ 2"):
        agg.multi_krum(xs, 4)
    agg.bulyan(torch.randn(11, 4), 2)
    with pytest.raises(ValueError, match="n >= 4f \\+ 3"):
        agg.bulyan(xs, 2)


def test_bulyan_ignores_outliers_and_averages_near_median() -> None:
    n, f = 11, 2
    xs = _contaminated(n, f, d=16, seed=8)
    out = agg.bulyan(xs, f)
    honest = xs[: n - f]
    assert (out >= honest.min(dim=0).values - 1e-12).all()
    assert (out <= honest.max(dim=0).values + 1e-12).all()
    same = torch.full((11, 3), 2.5)
    assert torch.equal(agg.bulyan(same, 2), torch.full((3,), 2.5))


def _sum_of_distances(xs: torch.Tensor, point: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(xs - point, dim=1).sum())


def test_geometric_median_beats_grid_search() -> None:
    points = [[0.0, 0.0], [4.0, 0.0], [0.0, 3.0], [5.0, 5.0], [1.0, 1.0], [30.0, -2.0], [2.0, 7.0]]
    xs = torch.tensor(points, dtype=torch.float64)
    ours = _sum_of_distances(xs, agg.geometric_median(xs, tol=1e-12, max_iters=10_000))
    axis_x = torch.linspace(float(xs[:, 0].min()), float(xs[:, 0].max()), 601, dtype=torch.float64)
    axis_y = torch.linspace(float(xs[:, 1].min()), float(xs[:, 1].max()), 601, dtype=torch.float64)
    grid = torch.cartesian_prod(axis_x, axis_y)
    grid_best = float(torch.cdist(grid, xs).sum(dim=1).min())
    assert ours <= grid_best + 1e-9
    assert ours < _sum_of_distances(xs, xs.mean(dim=0))


def test_coordinate_median_and_trimmed_mean_work_per_coordinate() -> None:
    odd = torch.tensor([[0.0, 10.0], [1.0, 0.0], [10.0, 1.0]])
    assert torch.equal(agg.coordinate_median(odd), torch.tensor([1.0, 1.0]))  # not a row of the input
    even = torch.tensor([[0.0, 12.0], [1.0, 4.0], [2.0, 8.0], [3.0, 0.0]])
    assert torch.equal(agg.coordinate_median(even), torch.tensor([1.5, 6.0]))
    spread = torch.tensor([[0.0, 100.0], [1.0, 0.0], [2.0, 1.0], [100.0, 2.0]])
    assert torch.equal(agg.trimmed_mean(spread, 1), torch.tensor([1.5, 1.5]))
    assert torch.equal(agg.trimmed_mean(spread, 0), spread.mean(dim=0))
    with pytest.raises(ValueError, match="2\\*trim < n"):
        agg.trimmed_mean(spread, 2)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 16, 19])
def test_coordinate_rules_match_sorting(n: int) -> None:
    xs = torch.randn(n, 40_000, generator=torch.Generator().manual_seed(n))
    ordered = xs.sort(dim=0).values
    middle = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    assert torch.equal(agg.coordinate_median(xs), middle)
    trim = (n - 1) // 2
    assert torch.allclose(agg.trimmed_mean(xs, trim), ordered[trim : n - trim].mean(dim=0), atol=1e-6)


def test_median_of_means_and_sign_majority() -> None:
    xs = torch.arange(12.0).reshape(6, 2)
    # Groups {0,1}, {2,3}, {4,5}: means [1,2], [5,6], [9,10]; median [5,6].
    assert torch.equal(agg.median_of_means(xs, 3), torch.tensor([5.0, 6.0]))
    assert torch.equal(agg.median_of_means(xs, 1), xs.mean(dim=0))
    with pytest.raises(ValueError, match="groups"):
        agg.median_of_means(xs, 7)
    votes = torch.tensor([[1.0, -2.0, 3.0, 0.5], [2.0, -1.0, -3.0, -0.5], [-100.0, -1.0, 0.0, 0.0]])
    assert torch.equal(agg.sign_majority(votes), torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_nearest_neighbor_mixing() -> None:
    xs = torch.tensor([[0.0], [1.0], [3.0], [10.0], [11.0]])
    mixed = agg.nearest_neighbor_mixing(xs, 2)
    assert mixed.shape == (5, 1)
    expected = torch.tensor([[4.0 / 3], [4.0 / 3], [4.0 / 3], [8.0], [8.0]])
    assert torch.allclose(mixed, expected)
    assert torch.allclose(agg.nearest_neighbor_mixing(xs, 0), xs.mean(dim=0).expand(5, 1))
    with pytest.raises(ValueError, match="2f < n"):
        agg.nearest_neighbor_mixing(xs, 3)


def test_bucketing_shapes_and_values() -> None:
    xs = torch.arange(7.0)[:, None] * torch.ones(1, 3)
    out = agg.bucketing(xs, 3, torch.Generator().manual_seed(0))
    assert out.shape == (3, 3)
    permutation = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    expected = torch.stack([xs[group].mean(dim=0) for group in permutation.split(3)])
    assert torch.allclose(out, expected)
    assert torch.equal(agg.bucketing(xs, 1, torch.Generator().manual_seed(0)), xs[permutation])
    with pytest.raises(ValueError, match="s >= 1"):
        agg.bucketing(xs, 0, torch.Generator())


@pytest.mark.parametrize("rule", ["mean", "median", "geometric_median", "sign_majority", "centered_clip"])
def test_rules_reject_bad_shapes(rule: str) -> None:
    aggregate = agg.make_aggregator(rule)
    with pytest.raises(ValueError, match="shape \\[n, d\\]"):
        aggregate(torch.zeros(3))
    with pytest.raises(ValueError, match="empty"):
        aggregate(torch.zeros(0, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_rule_keeps_shape_and_dtype(dtype: torch.dtype) -> None:
    xs = torch.randn(11, 50, generator=torch.Generator().manual_seed(9)).to(dtype)
    params = {
        "trimmed_mean": {"trim": 2},
        "krum": {"f": 2},
        "multi_krum": {"f": 2},
        "bulyan": {"f": 2},
        "median_of_means": {"groups": 5},
    }
    for name in agg.AGGREGATORS:
        out = agg.make_aggregator(name, **params.get(name, {}))(xs)
        assert out.shape == (50,), name
        assert out.dtype == dtype, name


def test_make_aggregator_composes_and_validates() -> None:
    xs = _contaminated(16, 7, d=8, seed=10)
    direct = agg.centered_clip(agg.nearest_neighbor_mixing(xs, 7), tau=1.0)
    assert torch.equal(agg.make_aggregator("centered_clip", tau=1.0, pre="nnm", f=7)(xs), direct)
    krum_after_nnm = agg.make_aggregator("krum", pre="nnm", f=3)
    assert torch.equal(krum_after_nnm(xs[:10]), agg.krum(agg.nearest_neighbor_mixing(xs[:10], 3), 3))
    bucketed = agg.make_aggregator("median", pre="bucketing", bucket_size=2, seed=5)
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        assert torch.equal(bucketed(xs), agg.coordinate_median(agg.bucketing(xs, 2, generator)))
    with pytest.raises(ValueError, match="unknown aggregator 'nope'.*'bulyan'"):
        agg.make_aggregator("nope")
    with pytest.raises(ValueError, match="does not take \\['tau'\\]"):
        agg.make_aggregator("median", tau=1.0)
    with pytest.raises(ValueError, match="unknown pre-aggregator"):
        agg.make_aggregator("median", pre="clip")
    with pytest.raises(ValueError, match="needs the Byzantine count f"):
        agg.make_aggregator("median", pre="nnm")


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_pairwise_distances_survive_huge_outliers(dtype: torch.dtype, tolerance: float) -> None:
    honest = (_honest_ball(6, 10, 1.0, seed=11) + 30.0).to(dtype)
    xs = torch.cat([honest, torch.full((2, 10), 1e12, dtype=dtype)])
    ours = agg._pairwise_squared_distances(xs)[:6, :6]
    exact = torch.tensor([[float(((a.double() - b.double()) ** 2).sum()) for b in honest] for a in honest])
    assert torch.allclose(ours, exact.double(), atol=tolerance)


@pytest.mark.parametrize("size", range(1, 13))
def test_sorting_network_sorts_every_binary_input(size: int) -> None:
    # 0-1 principle: a comparator network sorts all inputs iff it sorts all 0/1 inputs.
    for bits in itertools.product((0, 1), repeat=size):
        values = list(bits)
        for low, high in agg._sorting_network(size):
            if values[low] > values[high]:
                values[low], values[high] = values[high], values[low]
        assert values == sorted(bits)


def _with_huge_row(seed: int) -> torch.Tensor:
    """float32 stack whose row 3 is finite but of norm 3e19: its float32 squared norm (9e38) overflows."""
    xs = torch.randn(8, 500, generator=torch.Generator().manual_seed(seed))
    xs[3] = xs[3] / torch.linalg.vector_norm(xs[3]) * 3e19
    assert bool(xs.isfinite().all())
    return xs


@pytest.mark.parametrize("rule", ["centered_clip", "geometric_median"])
def test_huge_finite_row_gives_the_float64_result(rule: str) -> None:
    xs = _with_huge_row(0)
    got = agg.AGGREGATORS[rule](xs)
    reference = agg.AGGREGATORS[rule](xs.double())
    assert bool(got.isfinite().all())
    honest = torch.cat([xs[:3], xs[4:]]).double()
    # The huge row is clipped / down-weighted, so the result stays among the honest rows.
    assert torch.linalg.vector_norm(got.double() - honest.mean(dim=0)) < torch.linalg.vector_norm(honest, dim=1).max()
    assert torch.allclose(got.double(), reference, rtol=1e-4, atol=1e-4)


def test_centered_clip_with_infinite_tau_is_the_mean() -> None:
    xs = torch.randn(16, 300, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.allclose(agg.centered_clip(xs, tau=float("inf")), xs.mean(dim=0), atol=1e-12)
    v = xs[0]
    assert torch.allclose(agg.centered_clip_residual(xs, v, float("inf")), (xs - v).sum(dim=0), atol=1e-10)


def _inf_and_far_copies(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same stack twice: row 3 holds an inf in one, a far finite row in the other."""
    xs = torch.randn(8, 200, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    with_inf, far = xs.clone(), xs.clone()
    with_inf[3, 5] = float("inf")
    far[3] = 1e9
    return with_inf, far


def test_multi_krum_ignores_an_unselected_inf_row() -> None:
    with_inf, far = _inf_and_far_copies(3)
    got = agg.multi_krum(with_inf, f=2)
    assert bool(got.isfinite().all())
    assert torch.allclose(got, agg.multi_krum(far, f=2), atol=1e-12)


def test_nnm_keeps_rows_that_do_not_mix_the_inf_row() -> None:
    with_inf, far = _inf_and_far_copies(4)
    got, reference = agg.nearest_neighbor_mixing(with_inf, f=2), agg.nearest_neighbor_mixing(far, f=2)
    others = [i for i in range(8) if i != 3]
    assert bool(got[others].isfinite().all())
    assert torch.allclose(got[others], reference[others], atol=1e-12)


def test_median_of_means_and_bucketing_confine_an_inf_row_to_its_group() -> None:
    with_inf, _ = _inf_and_far_copies(5)
    got = agg.median_of_means(with_inf, groups=4)
    groups = torch.arange(8).tensor_split(4)
    means = torch.stack([with_inf[g].mean(dim=0) for g in groups])
    assert bool(got.isfinite().all())
    assert torch.allclose(got, agg.coordinate_median(means), atol=1e-12)
    buckets = agg.bucketing(with_inf, 2, torch.Generator().manual_seed(0))
    finite_rows = buckets.isfinite().all(dim=1)
    assert int((~finite_rows).sum()) == 1  # only the bucket that holds row 3
    assert not bool(buckets.isnan().any())


@pytest.mark.parametrize("n,f", [(3, 1), (5, 2), (7, 3), (16, 7), (20, 4)])
def test_one_rule_table_clamps_for_owners_and_names_the_impossible_for_studies(n: int, f: int) -> None:
    """Every rule built from `rule_parameters` runs on n rows when clamped; unclamped, a rule either runs
    with f itself or raises (the bench reports such a cell instead of quietly weakening the rule)."""
    from phalanx.algorithms.robust.reducers import make_reducer

    xs = torch.randn(n, 4, generator=torch.Generator().manual_seed(n * 100 + f))
    for name in agg.AGGREGATORS:
        clamped = agg.rule_parameters(name, n, f)
        assert all(0 <= v <= max(f, 2 * f + 1) for v in clamped.values())
        out = agg.make_aggregator(name, **clamped)(xs)
        assert torch.equal(out, make_reducer(name, f=f)(xs)) or name == "centered_clip"  # the owners' reducer: same table
        exact = agg.rule_parameters(name, n, f, clamp=False)
        assert set(exact.values()) <= {f, 2 * f + 1}
        try:
            agg.make_aggregator(name, **exact)(xs)
        except ValueError:
            assert exact != clamped  # only a parameter that had to be cut can make the rule refuse
    assert agg.rule_parameters("bulyan", 16, 7) == {"f": 3} and agg.rule_parameters("krum", 16, 7) == {"f": 6}
    assert agg.rule_parameters("median_of_means", 4, 3) == {"groups": 4}
