"""Byzantine attack policies.

An attack is what a Byzantine peer runs at every step: it receives an
``AttackView`` (what that peer can see) and returns the vector it sends in
place of its honest gradient. ``AttackSchedule`` decides on which steps the
peer attacks; on the other steps it sends its own gradient unchanged.
Omniscient attacks (``omniscient = True``) also need the honest peers'
gradients of the current step. Randomness is derived from the run seed, the
step and a purpose string, so colluding attackers agree and reruns repeat.
Pure torch, no I/O.
"""

import functools
import hashlib
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor


def _generator(seed: int, purpose: str, *keys: int) -> torch.Generator:
    """A torch.Generator seeded with 63 bits of sha256(seed, purpose, keys)."""
    text = ":".join([str(seed), purpose, *map(str, keys)])
    digest = hashlib.sha256(text.encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)


@dataclass(frozen=True)
class AttackView:
    """What a Byzantine peer sees at one step.

    ``honest_gradients`` (Tensor[k, d]) is given only to omniscient attacks.
    ``recompute_gradient(relabel)`` recomputes the peer's own gradient on its
    own batch with labels mapped through ``relabel``; the caller supplies it.
    """

    step: int
    own_gradient: Tensor
    n: int
    f: int
    seed: int
    peer_index: int
    honest_gradients: Tensor | None = None
    recompute_gradient: Callable[[Callable[[Tensor], Tensor]], Tensor] | None = None


@dataclass(frozen=True)
class AttackSchedule:
    """Honest before ``start_step``; from then on attack every ``every``-th step."""

    start_step: int = 0
    every: int = 1

    def __post_init__(self) -> None:
        if self.start_step < 0 or self.every < 1:
            raise ValueError(
                f"need start_step >= 0 and every >= 1, got start_step={self.start_step}, every={self.every}"
            )

    def is_active(self, step: int) -> bool:
        """Whether the attacker deviates at ``step``."""
        return step >= self.start_step and (step - self.start_step) % self.every == 0


@dataclass(kw_only=True)
class Attack:
    """Base policy: send ``forge(view)`` on active steps and the own gradient otherwise."""

    omniscient: ClassVar[bool] = False
    schedule: AttackSchedule = field(default_factory=AttackSchedule)

    def __call__(self, view: AttackView) -> Tensor:
        """The vector this Byzantine peer sends at ``view.step``."""
        if view.own_gradient.dim() != 1:
            raise ValueError(f"own_gradient must be a flat vector [d], got shape {tuple(view.own_gradient.shape)}")
        self.observe(view)
        if not self.schedule.is_active(view.step):
            return view.own_gradient
        return self.forge(view)

    def observe(self, view: AttackView) -> None:
        """Hook run on every step, active or not, for attacks that keep history."""

    def forge(self, view: AttackView) -> Tensor:
        """The malicious vector for an active step."""
        raise NotImplementedError

    def state(self) -> dict:
        """What this attack remembers across steps (tensors and plain values), for checkpoints."""
        return {}

    def load_state(self, state: dict) -> None:
        """Take back what `state` returned."""


def _honest(view: AttackView) -> Tensor:
    """The honest gradients of an omniscient attack's view, in the own gradient's dtype."""
    if view.honest_gradients is None:
        raise ValueError("this attack is omniscient: pass the honest gradients in AttackView.honest_gradients")
    return view.honest_gradients.to(view.own_gradient.dtype)


def _honest_std(honest: Tensor) -> Tensor:
    """Per-coordinate sample standard deviation (Bessel-corrected, like torch.std)."""
    if honest.shape[0] < 2:
        raise ValueError(f"the per-coordinate std needs at least 2 honest gradients, got {honest.shape[0]}")
    return honest.std(dim=0, correction=1)


@dataclass(kw_only=True)
class SignFlip(Attack):
    """Send -scale * own gradient (BTARD: sign flipping amplified by lambda = 1000)."""

    scale: float = 1000.0

    def forge(self, view: AttackView) -> Tensor:
        return view.own_gradient * -self.scale


@functools.lru_cache(maxsize=2)
def _shared_direction(seed: int, size: int, dtype: torch.dtype) -> Tensor:
    """The run's common random unit vector of length ``size`` (cached; never modify it)."""
    direction = torch.randn(size, generator=_generator(seed, "random_direction", size), dtype=torch.float64)
    return (direction / torch.linalg.vector_norm(direction)).to(dtype)


@dataclass(kw_only=True)
class RandomDirection(Attack):
    """Send scale * u for a unit direction u shared by all attackers (BTARD, lambda = 1000).

    u is fixed for the whole run: it depends only on the run seed (and d),
    so colluders agree without communicating.
    """

    scale: float = 1000.0

    def forge(self, view: AttackView) -> Tensor:
        gradient = view.own_gradient
        return _shared_direction(view.seed, gradient.numel(), gradient.dtype) * self.scale


@dataclass(kw_only=True)
class LabelFlip(Attack):
    """Send the gradient recomputed on the own batch with labels l -> num_classes - 1 - l.

    BTARD flips CIFAR-10 labels, hence num_classes = 10 by default.
    """

    num_classes: int = 10

    def forge(self, view: AttackView) -> Tensor:
        if view.recompute_gradient is None:
            raise ValueError("LabelFlip needs AttackView.recompute_gradient to redo its gradient on flipped labels")
        return view.recompute_gradient(lambda labels: self.num_classes - 1 - labels)


@dataclass(kw_only=True)
class DelayedGradient(Attack):
    """Send the own gradient from ``delay`` steps ago (BTARD: 1000), or the oldest one seen.

    Keeps copies of the own gradients of up to ``delay + 1`` steps, observed
    on every step including honest ones: memory is about (delay + 1) * d
    elements.
    """

    delay: int = 1000
    _history: deque[tuple[int, Tensor]] = field(default_factory=deque, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.delay < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay}")

    def observe(self, view: AttackView) -> None:
        self._history.append((view.step, view.own_gradient.detach().clone()))
        target = view.step - self.delay
        while len(self._history) > 1 and self._history[1][0] <= target:
            self._history.popleft()

    def forge(self, view: AttackView) -> Tensor:
        return self._history[0][1].clone()

    def state(self) -> dict:
        return {"history": [[step, gradient] for step, gradient in self._history]}

    def load_state(self, state: dict) -> None:
        self._history = deque((step, gradient.clone()) for step, gradient in state.get("history", []))


@dataclass(kw_only=True)
class InnerProductManipulation(Attack):
    """Send -epsilon * mean of the honest gradients (Xie et al. 2020; BTARD tests 0.1 and 0.6). Omniscient."""

    omniscient: ClassVar[bool] = True
    epsilon: float = 0.1

    def forge(self, view: AttackView) -> Tensor:
        return _honest(view).mean(dim=0) * -self.epsilon


def alie_z(n: int, f: int) -> float:
    """ALIE's z (Baruch et al. 2019): s = floor(n/2 + 1) - f, z = Phi^-1((n - s) / n)."""
    supporters = math.floor(n / 2 + 1) - f
    quantile = (n - supporters) / n
    if not 0 < quantile < 1:
        raise ValueError(f"ALIE's z is unbounded for n={n}, f={f} (needs 0 < (n - s)/n < 1); pass z explicitly")
    return statistics.NormalDist().inv_cdf(quantile)


@dataclass(kw_only=True)
class ALIE(Attack):
    """A Little Is Enough (Baruch et al. 2019): send mean - z * std of the honest gradients.

    std is the per-coordinate Bessel-corrected sample std (``torch.std``);
    z defaults to ``alie_z(view.n, f)`` with f clamped to leave at least one
    supporter (bans can shrink the group below what ``view.f`` assumed). Omniscient.
    """

    omniscient: ClassVar[bool] = True
    z: float | None = None

    def forge(self, view: AttackView) -> Tensor:
        honest = _honest(view)
        z = alie_z(view.n, min(view.f, math.floor(view.n / 2))) if self.z is None else self.z
        return honest.mean(dim=0) - z * _honest_std(honest)


@dataclass(kw_only=True)
class Constant(Attack):
    """Send a vector whose entries all equal ``value`` (Aspis Sec VII; the value is our choice)."""

    value: float = 100.0

    def forge(self, view: AttackView) -> Tensor:
        return torch.full_like(view.own_gradient, self.value)


@dataclass(kw_only=True)
class Reversed(Attack):
    """Send -c * own gradient (Aspis Sec VII "reversed gradient"; c is our choice)."""

    c: float = 100.0

    def forge(self, view: AttackView) -> Tensor:
        return view.own_gradient * -self.c


@dataclass(kw_only=True)
class GaussianNoise(Attack):
    """Send a pure N(0, std^2) vector, independent per attacker and step.

    The own gradient is ignored; std = 200 follows the Gaussian Byzantine
    workers of Blanchard et al. 2017.
    """

    std: float = 200.0

    def forge(self, view: AttackView) -> Tensor:
        gradient = view.own_gradient
        generator = _generator(view.seed, "gaussian_noise", view.step, view.peer_index)
        noise = torch.randn(gradient.numel(), generator=generator, dtype=gradient.dtype)
        return noise * self.std


@dataclass(kw_only=True)
class Mimic(Attack):
    """Send a copy of the gradient of honest peer ``target`` (row of honest_gradients). Omniscient."""

    omniscient: ClassVar[bool] = True
    target: int = 0

    def forge(self, view: AttackView) -> Tensor:
        honest = _honest(view)
        if not 0 <= self.target < honest.shape[0]:
            raise ValueError(f"Mimic target {self.target} is not a row of the {honest.shape[0]} honest gradients")
        return honest[self.target].clone()


_PERTURBATIONS = ("std", "unit_vector", "sign")


def _perturbation(honest: Tensor, mean: Tensor, kind: str) -> Tensor:
    if kind == "std":
        return -_honest_std(honest)
    if kind == "unit_vector":
        return -mean / torch.linalg.vector_norm(mean).clamp_min(torch.finfo(mean.dtype).tiny)
    return -torch.sign(mean)


def _largest_scale(quadratic: Tensor, linear: Tensor, constant: Tensor) -> float:
    """Largest g >= 0 with quadratic * g^2 - 2 * linear * g + constant <= 0 for every entry.

    Every ``constant`` is <= 0 (g = 0 is feasible), so each feasible set is
    an interval [0, root] and the answer is the smallest root.
    """
    discriminant = (linear**2 - quadratic * constant).clamp_min(0.0)
    roots = (linear + discriminant.sqrt()) / quadratic
    return float(roots.min().clamp_min(0.0))


@dataclass(kw_only=True)
class _AgrAgnostic(Attack):
    """Shejwalkar & Houmansadr 2021 (NDSS): send mean + gamma * p with the largest feasible gamma.

    p is -std (default, per coordinate, Bessel-corrected), -mean/||mean||
    ("unit_vector") or -sign(mean) ("sign"). The paper bisects on gamma; both
    constraints are convex quadratics in gamma, so the largest feasible gamma
    is solved exactly in float64 and shrunk by 1e-6 relative so that float
    rounding cannot break the constraint. Omniscient.
    """

    omniscient: ClassVar[bool] = True
    objective: ClassVar[str]
    perturbation: str = "std"

    def __post_init__(self) -> None:
        if self.perturbation not in _PERTURBATIONS:
            raise ValueError(f"unknown perturbation {self.perturbation!r}; choose one of {list(_PERTURBATIONS)}")

    def forge(self, view: AttackView) -> Tensor:
        honest = _honest(view)
        wide = honest.double()
        mean = wide.mean(dim=0)
        direction = _perturbation(wide, mean, self.perturbation)
        squared_scale = direction.dot(direction)
        if squared_scale == 0:
            return mean.to(honest.dtype)
        centered = wide - mean
        gram = centered @ centered.T
        alignment = centered @ direction
        norms = gram.diagonal()
        pairwise = (norms[:, None] + norms[None, :] - 2.0 * gram).clamp_min(0.0)
        if self.objective == "max":
            gamma = _largest_scale(squared_scale, alignment, norms - pairwise.max())
        else:
            count = honest.shape[0]
            gamma = _largest_scale(count * squared_scale, alignment.sum(), norms.sum() - pairwise.sum(dim=1).max())
        return (mean + gamma * (1.0 - 1e-6) * direction).to(honest.dtype)


@dataclass(kw_only=True)
class MinMax(_AgrAgnostic):
    """Min-Max (Shejwalkar & Houmansadr 2021): send mean + gamma * p, gamma bounded by honest distances.

    gamma is as large as keeps the largest distance to any honest gradient <= the largest honest pairwise distance.

    ``perturbation`` picks p: "std" (default), "unit_vector" or "sign". Omniscient.
    """

    objective: ClassVar[str] = "max"


@dataclass(kw_only=True)
class MinSum(_AgrAgnostic):
    """Min-Sum (Shejwalkar & Houmansadr 2021): send mean + gamma * p, gamma bounded by honest sums.

    gamma is as large as keeps the sum of squared distances to the honest gradients <= the largest such sum of an honest one.

    ``perturbation`` picks p: "std" (default), "unit_vector" or "sign". Omniscient.
    """

    objective: ClassVar[str] = "sum"


ATTACKS: dict[str, type[Attack]] = {
    "sign_flip": SignFlip,
    "random_direction": RandomDirection,
    "label_flip": LabelFlip,
    "delayed_gradient": DelayedGradient,
    "ipm": InnerProductManipulation,
    "alie": ALIE,
    "constant": Constant,
    "reversed": Reversed,
    "gaussian": GaussianNoise,
    "mimic": Mimic,
    "min_max": MinMax,
    "min_sum": MinSum,
}


def make_attack(name: str, schedule: AttackSchedule, **params: Any) -> Attack:
    """Instantiate the attack registered as ``name`` in ``ATTACKS`` with its parameters."""
    if name not in ATTACKS:
        raise ValueError(f"unknown attack {name!r}; choose one of {sorted(ATTACKS)}")
    try:
        return ATTACKS[name](schedule=schedule, **params)
    except TypeError as error:
        raise ValueError(f"bad parameters for attack {name!r}: {error}") from error
