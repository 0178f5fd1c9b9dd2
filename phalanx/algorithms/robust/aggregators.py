"""Robust aggregation rules over a stack of peer vectors.

Every rule maps ``xs: Tensor[n, d]`` (float32 or float64, one row per peer)
to a single ``Tensor[d]``; the pre-aggregators (NNM, bucketing) map it to a
smaller or mixed stack. Rules are pure torch functions without I/O. Each
docstring states the largest number ``f`` of Byzantine rows the rule
tolerates, and rules that take ``f`` raise ``ValueError`` when ``n`` is too
small for it. Inputs are not checked for NaN or infinity, but a row holding
an infinity does not spoil rules that leave it out (distance-based rules see
it as infinitely far, group means touch only the groups that hold it), and a
finite row too large for float32 products is handled in float64.

Rules that need pairwise or point-to-row distances (CenteredClip, geometric
median, Krum, Multi-Krum, Bulyan, NNM) read the d-dimensional data once to
build a Gram matrix, summed in float64, and then work with n x n quantities,
so their cost barely grows with the number of iterations.
"""

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_CHUNK_BYTES = 1 << 17
_FLOAT32_MAX_CONDITION = 16.0


def _check_stack(xs: Tensor) -> tuple[int, int]:
    """Return (n, d) of a valid stack or raise ValueError saying what to fix."""
    if xs.dim() != 2:
        raise ValueError(
            f"expected a stack of vectors with shape [n, d], got shape {tuple(xs.shape)}; "
            "stack the peer vectors with torch.stack(vectors)"
        )
    if xs.shape[0] == 0:
        raise ValueError("expected at least one vector (n >= 1), got an empty stack")
    if not xs.is_floating_point():
        raise ValueError(f"expected a floating-point stack, got dtype {xs.dtype}; convert it with xs.float()")
    return xs.shape[0], xs.shape[1]


def _check_byzantine_count(f: int) -> None:
    if f < 0:
        raise ValueError(f"the Byzantine count f must be >= 0, got f={f}")


def _chunk_columns(dtype: torch.dtype) -> int:
    """Columns per chunk so that one row of a chunk stays small and cache-resident."""
    return max(1, _CHUNK_BYTES // dtype.itemsize)


def _gram(xs: Tensor, center: Tensor | None, product_dtype: torch.dtype) -> Tensor:
    """Float64 Gram matrix of the rows of ``xs - center``.

    Chunks of columns are shifted and multiplied in ``product_dtype``; the
    chunk products are summed in float64.
    """
    n, d = xs.shape
    step = _chunk_columns(product_dtype)
    shift = None if center is None else center.to(product_dtype)
    gram = torch.zeros(n, n, dtype=torch.float64)
    scratch = torch.empty(n, min(step, d), dtype=product_dtype)
    for begin in range(0, d, step):
        block = xs[:, begin : begin + step]
        shifted = scratch[:, : block.shape[1]]
        if shift is None:
            shifted.copy_(block)
        elif block.dtype == product_dtype:
            torch.sub(block, shift[begin : begin + step], out=shifted)
        else:
            shifted.copy_(block).sub_(shift[begin : begin + step])
        gram += shifted @ shifted.T
    return gram


def _squared_distances_from_gram(gram: Tensor) -> Tensor:
    """Squared distances from a Gram matrix; a pair involving a non-finite row is infinitely far apart."""
    norms = gram.diagonal()
    squared = (norms[:, None] + norms[None, :] - 2.0 * gram).nan_to_num(nan=float("inf"))
    return squared.clamp_min(0.0).fill_diagonal_(0.0)


def _centering_condition(gram: Tensor) -> float:
    """max_i ||y_i||^2 / median_j ||y_i - y_j||^2: how far the center is from rows, relative to their spread."""
    n = gram.shape[0]
    others = _squared_distances_from_gram(gram)[~torch.eye(n, dtype=torch.bool)].view(n, n - 1)
    spread = others.median(dim=1).values
    return float((gram.diagonal() / spread).nan_to_num(nan=0.0).max())


def _gram_around(xs: Tensor, center: Tensor | None) -> Tensor:
    """Float64 Gram matrix of ``xs - center`` (``xs`` itself when center is None), accurate for distances.

    Distances are differences of Gram entries, so they lose accuracy when the
    rows are far from the center compared to their spread. For float32
    stacks, chunk products are formed in float32 (about twice as fast) when
    every row's squared distance to the center is at most
    ``_FLOAT32_MAX_CONDITION`` times its median squared distance to the other
    rows, and recomputed in float64 otherwise, in particular when a finite
    row is so large (norm above ~1e19) that its float32 products overflow.
    """
    if xs.dtype != torch.float32 or xs.shape[0] == 1:
        return _gram(xs, center, torch.float64)
    gram = _gram(xs, center, torch.float32)
    if bool(gram.isfinite().all()) and _centering_condition(gram) <= _FLOAT32_MAX_CONDITION:
        return gram
    return _gram(xs, center, torch.float64)


def _distances_to_point(gram: Tensor, coefficients: Tensor) -> Tensor:
    """Distances from each row y_i to the point sum_j c_j y_j, given the Gram matrix of the rows."""
    offsets = torch.eye(gram.shape[0], dtype=gram.dtype) - coefficients
    squared = ((offsets @ gram) * offsets).sum(dim=1)
    return squared.clamp_min(0.0).sqrt()


def _norm_in_span(gram: Tensor, coefficients: Tensor) -> float:
    """Norm of the vector sum_j c_j y_j, given the Gram matrix of the rows y_j."""
    return float((coefficients @ gram @ coefficients).clamp_min(0.0).sqrt())


def _point_in_span(xs: Tensor, center: Tensor, coefficients: Tensor) -> Tensor:
    """Materialise center + sum_j c_j (x_j - center) in the dtype of ``xs``."""
    point = coefficients.to(xs.dtype) @ xs
    return point.add_(center, alpha=1.0 - float(coefficients.sum()))


def _pairwise_squared_distances(xs: Tensor) -> Tensor:
    """Float64 matrix of squared Euclidean distances between rows, zero on the diagonal."""
    return _squared_distances_from_gram(_gram_around(xs, None))


def _group_means(xs: Tensor, groups: Sequence[Tensor]) -> Tensor:
    """Tensor[len(groups), d] whose row g is the mean of the rows of ``xs`` listed in ``groups[g]``.

    One 0/1 matrix product when every value is finite; otherwise each group is
    summed on its own, since 0 * inf in the product would put NaN into groups
    that do not hold the non-finite row.
    """
    if not bool(xs.isfinite().all()):
        return torch.stack([xs[torch.as_tensor(members)].mean(dim=0) for members in groups])
    membership = torch.zeros(len(groups), xs.shape[0], dtype=xs.dtype)
    for row, members in enumerate(groups):
        membership[row, members] = 1.0
    sizes = torch.tensor([len(members) for members in groups], dtype=xs.dtype)
    return (membership @ xs).div_(sizes[:, None])


@functools.lru_cache(maxsize=None)
def _sorting_network(size: int) -> tuple[tuple[int, int], ...]:
    """Comparators of Batcher's odd-even merge sort for ``size`` inputs.

    The network is built for the next power of two and comparators touching
    the (virtual, +inf) padding positions are dropped, which keeps it valid.
    """
    width = 1 << max(size - 1, 0).bit_length()
    comparators = []
    block = 1
    while block < width:
        stride = block
        while stride >= 1:
            for base in range(stride % block, width - stride, 2 * stride):
                for offset in range(min(stride, width - base - stride)):
                    low, high = base + offset, base + offset + stride
                    if low // (2 * block) == high // (2 * block) and high < size:
                        comparators.append((low, high))
            stride //= 2
        block *= 2
    return tuple(comparators)


def _reduce_sorted_columns(xs: Tensor, reduce_rows: Callable[[list[Tensor]], Tensor]) -> Tensor:
    """Sort every column of ``xs`` and reduce the sorted rows to one vector.

    Columns are sorted chunk by chunk with a sorting network of elementwise
    min/max operations, which is much faster than ``torch.sort(dim=0)`` for the
    small n of peer stacks.
    """
    n, d = xs.shape
    network = _sorting_network(n)
    step = _chunk_columns(xs.dtype)
    reduced = torch.empty(d, dtype=xs.dtype)
    for begin in range(0, d, step):
        rows = list(xs[:, begin : begin + step].unbind(0))
        for low, high in network:
            smaller = torch.minimum(rows[low], rows[high])
            rows[high] = torch.maximum(rows[low], rows[high])
            rows[low] = smaller
        reduced[begin : begin + step] = reduce_rows(rows)
    return reduced


def _middle_of_sorted(rows: list[Tensor]) -> Tensor:
    middle = len(rows) // 2
    if len(rows) % 2:
        return rows[middle]
    return (rows[middle - 1] + rows[middle]) / 2


def _mean_of_middle(rows: list[Tensor], trim: int) -> Tensor:
    kept = rows[trim : len(rows) - trim]
    total = kept[0].clone()
    for row in kept[1:]:
        total += row
    return total.div_(len(kept))


def _krum_scores(squared_distances: Tensor, neighbours: int) -> Tensor:
    """Sum of squared distances from each row to its ``neighbours`` closest other rows."""
    others = squared_distances.clone().fill_diagonal_(float("inf"))
    return others.sort(dim=1).values[:, :neighbours].sum(dim=1)


def _krum_order(xs: Tensor, f: int) -> Tensor:
    n, _ = _check_stack(xs)
    _check_byzantine_count(f)
    if n <= 2 * f + 2:
        raise ValueError(f"Krum needs n > 2f + 2, got n={n}, f={f}; add peers or lower f to at most {(n - 3) // 2}")
    return _krum_scores(_pairwise_squared_distances(xs), n - f - 2).argsort(stable=True)


def mean(xs: Tensor) -> Tensor:
    """Coordinate-wise mean. Tolerates f = 0 Byzantine rows."""
    _check_stack(xs)
    return xs.mean(dim=0)


def coordinate_median(xs: Tensor) -> Tensor:
    """Coordinate-wise median. Tolerates f < n/2.

    For even n each coordinate is the mean of its two middle values.
    """
    _check_stack(xs)
    return _reduce_sorted_columns(xs, _middle_of_sorted)


def trimmed_mean(xs: Tensor, trim: int) -> Tensor:
    """Coordinate-wise mean after dropping the ``trim`` smallest and ``trim`` largest values.

    Tolerates f <= trim; requires 2 * trim < n.
    """
    n, _ = _check_stack(xs)
    if trim < 0 or 2 * trim >= n:
        raise ValueError(
            f"trimmed_mean needs 0 <= trim and 2*trim < n, got trim={trim}, n={n}; use trim <= {(n - 1) // 2}"
        )
    return _reduce_sorted_columns(xs, functools.partial(_mean_of_middle, trim=trim))


@dataclass(frozen=True)
class ClipResult:
    """Output of CenteredClip with its convergence diagnostics.

    ``residual_norm`` is ||sum_i (x_i - v) min(1, tau/||x_i - v||)|| at the
    returned ``value`` with the last tau used (see ``centered_clip_residual``).
    """

    value: Tensor
    iterations: int
    residual_norm: float


def _check_tau(tau: float) -> float:
    if not tau > 0:
        raise ValueError(f"the clipping radius tau must be > 0, got tau={tau}")
    return tau


def _clip_weights(distances: Tensor, tau: float) -> Tensor:
    """min(1, tau / distance) per row: 1 inside the radius (also for tau = inf), tau / distance outside."""
    return torch.where(distances <= tau, torch.ones_like(distances), tau / distances)


def _clip_update(gram: Tensor, coefficients: Tensor, tau: float) -> Tensor:
    """Coefficients of one CenteredClip step (1/n) sum_i (y_i - v) min(1, tau/||y_i - v||)."""
    weights = _clip_weights(_distances_to_point(gram, coefficients), tau)
    return (weights - weights.sum() * coefficients) / gram.shape[0]


def _start_point(xs: Tensor, start: Tensor | None) -> Tensor:
    if start is None:
        return coordinate_median(xs)
    if start.shape != xs.shape[1:]:
        raise ValueError(f"start must have shape {tuple(xs.shape[1:])} like one row of xs, got {tuple(start.shape)}")
    return start.to(xs.dtype)


def centered_clip_with_info(
    xs: Tensor,
    tau: float = 1.0,
    *,
    start: Tensor | None = None,
    eps: float = 1e-6,
    max_iters: int = 1000,
    tau_schedule: Callable[[int], float] | None = None,
) -> ClipResult:
    """CenteredClip (Karimireddy et al. 2021; BTARD Sec 3.1) with diagnostics.

    Iterates v <- v + (1/n) sum_i (x_i - v) min(1, tau_l / ||x_i - v||) from
    ``start`` (default: the coordinate-wise median; pass the previous
    aggregate to warm-start) until the norm of an update (in the units of
    ``xs``) is <= ``eps`` or ``max_iters`` updates were made.
    ``tau_schedule(l)``, when given, overrides ``tau`` at iteration l. A row
    at distance 0 gets weight 1. Tolerates f < n/2 (BTARD assumes
    delta < 1/2; Karimireddy et al. prove their guarantee for delta <= 0.1).

    The iterates stay in start + span{x_i - start}, so they are tracked as n
    float64 coefficients over the Gram matrix of the x_i - start: the
    d-dimensional data is read once for the Gram matrix (twice for float32
    stacks far from ``start`` compared to their spread) and once to
    materialise the result.
    """
    n, _ = _check_stack(xs)
    if eps < 0 or max_iters < 0:
        raise ValueError(f"need eps >= 0 and max_iters >= 0, got eps={eps}, max_iters={max_iters}")
    center = _start_point(xs, start)
    gram = _gram_around(xs, center)
    coefficients = torch.zeros(n, dtype=torch.float64)

    def tau_at(iteration: int) -> float:
        return _check_tau(tau if tau_schedule is None else tau_schedule(iteration))

    iterations = 0
    for iteration in range(max_iters):
        update = _clip_update(gram, coefficients, tau_at(iteration))
        coefficients += update
        iterations = iteration + 1
        if _norm_in_span(gram, update) <= eps:
            break
    last_tau = tau_at(max(iterations - 1, 0))
    residual = _norm_in_span(gram, _clip_update(gram, coefficients, last_tau)) * n
    return ClipResult(_point_in_span(xs, center, coefficients), iterations, residual)


def centered_clip(
    xs: Tensor,
    tau: float = 1.0,
    *,
    start: Tensor | None = None,
    eps: float = 1e-6,
    max_iters: int = 1000,
    tau_schedule: Callable[[int], float] | None = None,
) -> Tensor:
    """CenteredClip aggregate; see ``centered_clip_with_info``. Tolerates f < n/2."""
    return centered_clip_with_info(
        xs, tau, start=start, eps=eps, max_iters=max_iters, tau_schedule=tau_schedule
    ).value


def centered_clip_residual(xs: Tensor, v: Tensor, tau: float) -> Tensor:
    """sum_i (x_i - v) min(1, tau / ||x_i - v||), computed directly in the dtype of ``xs``.

    It vanishes at the CenteredClip fixed point; BTARD's Verification 2 checks
    its projection on a shared random direction.
    """
    _check_stack(xs)
    _check_tau(tau)
    offsets = xs - v
    weights = _clip_weights(torch.linalg.vector_norm(offsets, dim=1), tau)
    return weights.to(offsets.dtype) @ offsets


def geometric_median(
    xs: Tensor,
    *,
    eps: float = 1e-8,
    max_iters: int = 100,
    tol: float = 1e-7,
    start: Tensor | None = None,
) -> Tensor:
    """Geometric median by smoothed Weiszfeld iterations (Pillutla et al. 2022).

    z <- sum_i w_i x_i / sum_i w_i with w_i = 1 / max(eps, ||x_i - z||), from
    ``start`` (default: coordinate-wise median) until z moves by <= ``tol``
    or after ``max_iters`` iterations. Tolerates f < n/2.
    """
    n, _ = _check_stack(xs)
    if eps <= 0 or tol < 0 or max_iters < 0:
        raise ValueError(f"need eps > 0, tol >= 0 and max_iters >= 0, got eps={eps}, tol={tol}, max_iters={max_iters}")
    center = _start_point(xs, start)
    gram = _gram_around(xs, center)
    coefficients = torch.zeros(n, dtype=torch.float64)
    for _ in range(max_iters):
        weights = 1.0 / _distances_to_point(gram, coefficients).clamp_min(eps)
        updated = weights / weights.sum()
        moved = _norm_in_span(gram, updated - coefficients)
        coefficients = updated
        if moved <= tol:
            break
    return _point_in_span(xs, center, coefficients)


def krum(xs: Tensor, f: int) -> Tensor:
    """Krum (Blanchard et al. 2017): the row with the smallest sum of squared
    distances to its n - f - 2 nearest other rows (first such row on ties).

    Tolerates f Byzantine rows when n > 2f + 2.
    """
    return xs[_krum_order(xs, f)[0]].clone()


def multi_krum(xs: Tensor, f: int, m: int | None = None) -> Tensor:
    """Multi-Krum: mean of the ``m`` rows with the best Krum scores (default m = n - f).

    Tolerates f Byzantine rows when n > 2f + 2.
    """
    order = _krum_order(xs, f)
    n = xs.shape[0]
    count = n - f if m is None else m
    if not 1 <= count <= n:
        raise ValueError(f"multi_krum needs 1 <= m <= n, got m={count}, n={n}")
    return _group_means(xs, [order[:count]])[0]


def bulyan(xs: Tensor, f: int) -> Tensor:
    """Bulyan (El Mhamdi et al. 2018) on top of Krum.

    Selects theta = n - 2f rows by applying Krum repeatedly to the rows not
    yet selected (scores use the max(r - f - 2, 1) nearest of the r remaining
    rows), then, per coordinate, averages the beta = theta - 2f selected
    values closest to the coordinate-wise median of the selection.
    Tolerates f Byzantine rows when n >= 4f + 3.
    """
    n, _ = _check_stack(xs)
    _check_byzantine_count(f)
    if n < 4 * f + 3:
        raise ValueError(f"Bulyan needs n >= 4f + 3, got n={n}, f={f}; add peers or lower f to at most {(n - 3) // 4}")
    squared_distances = _pairwise_squared_distances(xs)
    remaining = list(range(n))
    selected = []
    for _ in range(n - 2 * f):
        within = squared_distances[remaining][:, remaining]
        scores = _krum_scores(within, max(len(remaining) - f - 2, 1))
        selected.append(remaining.pop(int(scores.argmin())))
    chosen = xs[selected]
    deviations = (chosen - coordinate_median(chosen)).abs()
    closest = deviations.topk(n - 4 * f, dim=0, largest=False).indices
    return chosen.gather(0, closest).mean(dim=0)


def median_of_means(xs: Tensor, groups: int) -> Tensor:
    """Coordinate-wise median of the means of ``groups`` consecutive, near-equal groups of rows.

    Tolerates f < groups / 2 (each Byzantine row spoils at most one group).
    """
    n, _ = _check_stack(xs)
    if not 1 <= groups <= n:
        raise ValueError(f"median_of_means needs 1 <= groups <= n, got groups={groups}, n={n}")
    members = torch.arange(n).tensor_split(groups)
    return coordinate_median(_group_means(xs, members))


def sign_majority(xs: Tensor) -> Tensor:
    """signSGD with majority vote (Bernstein et al. 2019): sign(sum_i sign(x_i)), 0 on ties.

    A coordinate on which the honest rows agree cannot be flipped while f < n/2.
    """
    _check_stack(xs)
    return torch.sign(torch.sign(xs).sum(dim=0))


def nearest_neighbor_mixing(xs: Tensor, f: int) -> Tensor:
    """NNM (Allouah et al. 2023): replace each row by the mean of its n - f nearest rows, itself included.

    Returns Tensor[n, d]; meant to run before a robust rule. Requires 2f < n.
    """
    n, _ = _check_stack(xs)
    _check_byzantine_count(f)
    if 2 * f >= n:
        raise ValueError(f"nearest_neighbor_mixing needs 2f < n, got n={n}, f={f}; lower f to at most {(n - 1) // 2}")
    nearest = _pairwise_squared_distances(xs).topk(n - f, dim=1, largest=False).indices
    return _group_means(xs, list(nearest))


def bucketing(xs: Tensor, s: int, generator: torch.Generator) -> Tensor:
    """Bucketing (Karimireddy et al. 2022): shuffle the rows, then average consecutive buckets of ``s``.

    Returns Tensor[ceil(n / s), d]; the last bucket holds the leftover rows.
    Meant to run before a robust rule: a Byzantine row spoils only its own
    bucket, so the rule then faces at most f spoiled rows out of ceil(n / s).
    """
    n, _ = _check_stack(xs)
    if s < 1:
        raise ValueError(f"bucketing needs a bucket size s >= 1, got s={s}")
    permutation = torch.randperm(n, generator=generator)
    return _group_means(xs, permutation.split(s))


AGGREGATORS: dict[str, Callable[..., Tensor]] = {
    "mean": mean,
    "centered_clip": centered_clip,
    "median": coordinate_median,
    "geometric_median": geometric_median,
    "trimmed_mean": trimmed_mean,
    "krum": krum,
    "multi_krum": multi_krum,
    "bulyan": bulyan,
    "median_of_means": median_of_means,
    "sign_majority": sign_majority,
}

PRE_AGGREGATORS: tuple[str, ...] = ("nnm", "bucketing")


def rule_parameters(name: str, n: int, f: int, *, clamp: bool = True) -> dict[str, int]:
    """The parameters of rule `name` over `n` rows of which up to `f` may be Byzantine: the one (rule, n, f)
    table every system uses (partition owners, Aspis's coordinator, the robustness bench).

    With `clamp`, a parameter is cut to what `n` rows allow, for a peer that aggregates however many
    rows reached it; without, it is `f` itself and the rule raises ValueError when `n` is too small
    (a study that must not weaken the rule it names). Rules without such a parameter get none.
    """
    def cut(limit: int) -> int:
        return max(0, min(f, limit)) if clamp else f

    if name == "trimmed_mean":
        return {"trim": cut((n - 1) // 2)}
    if name == "median_of_means":
        return {"groups": max(1, min(2 * f + 1, n)) if clamp else 2 * f + 1}
    if name in ("krum", "multi_krum"):
        return {"f": cut((n - 3) // 2)}
    if name == "bulyan":
        return {"f": cut((n - 3) // 4)}
    return {}


def _accepted_parameters(rule: Callable[..., Tensor]) -> set[str]:
    return set(list(inspect.signature(rule).parameters)[1:])


def _pre_aggregator(pre: str | None, params: dict[str, Any]) -> tuple[Callable[[Tensor], Tensor] | None, set[str]]:
    """Build the pre-aggregation step and name the parameters it consumes."""
    if pre is None:
        return None, set()
    if pre == "nnm":
        if "f" not in params:
            raise ValueError("pre='nnm' needs the Byzantine count f, e.g. make_aggregator(name, pre='nnm', f=3)")
        return functools.partial(nearest_neighbor_mixing, f=params["f"]), {"f"}
    if pre == "bucketing":
        if "bucket_size" not in params:
            raise ValueError(
                "pre='bucketing' needs bucket_size, e.g. make_aggregator(name, pre='bucketing', bucket_size=2)"
            )
        generator = torch.Generator().manual_seed(int(params.get("seed", 0)))
        return functools.partial(bucketing, s=params["bucket_size"], generator=generator), {"bucket_size", "seed"}
    raise ValueError(f"unknown pre-aggregator {pre!r}; choose one of {list(PRE_AGGREGATORS)} or None")


def make_aggregator(name: str, *, pre: str | None = None, **params: Any) -> Callable[[Tensor], Tensor]:
    """Build ``xs -> Tensor[d]`` from a rule name in ``AGGREGATORS`` and its keyword parameters.

    ``pre`` optionally mixes the stack first: ``"nnm"`` uses ``f`` (which is
    also passed to the rule when the rule takes ``f``), ``"bucketing"`` uses
    ``bucket_size`` and ``seed`` (default 0; the returned callable draws a new
    permutation per call from a generator seeded once). Example:
    ``make_aggregator("centered_clip", tau=1.0, pre="nnm", f=7)``.
    """
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; choose one of {sorted(AGGREGATORS)}")
    rule = AGGREGATORS[name]
    mix, consumed = _pre_aggregator(pre, params)
    accepted = _accepted_parameters(rule)
    unknown = set(params) - accepted - consumed
    if unknown:
        raise ValueError(f"{name!r} does not take {sorted(unknown)}; it takes {sorted(accepted)}")
    bound = functools.partial(rule, **{key: value for key, value in params.items() if key in accepted})
    if mix is None:
        return bound
    return lambda xs: bound(mix(xs))
