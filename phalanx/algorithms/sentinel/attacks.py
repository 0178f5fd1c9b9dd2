"""Attacks on pipeline links: what a malicious relay sends instead of its honest tensors.

A relay computes its stage honestly, then hands each outgoing tensor (an
activation forward, an activation gradient backward) to its `LinkAttack`
policy, which returns what is actually sent and whether it tampered (the
attack log an experiment scores detection against; a verifier never reads
it). A policy attacks from `start_step`, on the `target` direction(s), on a
`fraction` of microbatches chosen from a seeded stream, so reruns repeat.
Target `aggregation` turns the same policy on the relay's contribution to its
stage's gradient all-reduce instead (one tensor per iteration, no link); target
`weights` on the stage weights the relay serves to a joiner or a behind
replica (one tensor per parameter, no link).
Pure torch, no I/O.

Formulas where the paper gives only names (each a parameter):
zeros: a constant (default 0); random: i.i.d. N(0, std^2) values; scaling:
factor * x (default -1); sign_flip: -mean|x| * sign(x) (the flipped sign
pattern with the magnitude of x, signSGD-style, so it differs from scaling);
delay: the tensor this relay sent `delay` steps earlier (another microbatch,
an older model); bias: x + bias * mean|x|; invisible_noise: a `portion` of the
coordinates replaced by Gaussian noise with the tensor's own mean and std;
mixed: one of several attacks per microbatch; framing: `base`'s tampering plus
an honest upstream peer written into the forwarded path and hop record; adaptive: the largest step from
the honest tensor towards a harmful one (default: its negation) that the
verifier's current fences still accept, times a safety `margin`. The adaptive
attacker is white-box: the experiment lends it the verifier's `probe`. mimic
(the paper's adaptive attack, black-box): its own EMA of the per-feature
mean plus honest-shaped noise (its honest deviations, token vectors shuffled).
budget: adaptive's white-box attacker that also knows the strike rule: the full harm on as many
microbatches as the rule allows without a ban (`spend` of every `strike_window`), adaptive otherwise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ...core.errors import ConfigError
from ...core.rng import py_stream, torch_stream

ACTIVATION, GRADIENT = "activation", "gradient"
AGGREGATION = "aggregation"  # not a link: the relay's own vector in its stage's all-reduce
WEIGHTS = "weights"  # not a link: the stage weights a replica serves to a joiner or a behind replica
TARGETS = ("activations", "gradients", "both", "aggregation", "weights")  # both: the two link directions


@dataclass(frozen=True)
class LinkView:
    """What a relay sees when it sends one tensor.

    `probe(tensor)` (white-box experiments only) says whether the verifier on
    this link would accept `tensor` for this microbatch right now; None when
    there is no verifier.
    """

    kind: str  # ACTIVATION, GRADIENT, AGGREGATION or WEIGHTS
    step: int
    microbatch: Hashable
    tensor: Tensor
    probe: Callable[[Tensor], bool] | None = None


@dataclass(frozen=True)
class Relayed:
    """What the relay sends, and (for the attack log) whether it tampered and how."""

    tensor: Tensor
    tampered: bool
    attack: str = "none"


@dataclass(kw_only=True)
class LinkAttack:
    """Base policy: honest unless the step, target and microbatch draw say attack."""

    name: ClassVar[str] = "none"
    target: str = "both"
    start_step: int = 0
    fraction: float = 1.0
    seed: int = 0
    worker: str = ""

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ConfigError(f"attack target={self.target!r} must be one of {', '.join(TARGETS)}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ConfigError(f"attack fraction={self.fraction} must be in [0, 1]")
        if self.start_step < 0:
            raise ConfigError(f"attack start_step={self.start_step} must be >= 0")

    def relay(self, view: LinkView) -> Relayed:
        """The tensor this relay sends for `view`."""
        self.observe(view)
        if not self.active(view):
            return Relayed(view.tensor, False)
        forged = self.forge(view, self._stream(view))
        if forged is None:
            return Relayed(view.tensor, False)
        return Relayed(forged, True, self.name)

    def active(self, view: LinkView) -> bool:
        """Whether this view is attacked: step, direction and the seeded microbatch draw."""
        if view.step < self.start_step or self.name == "none":
            return False
        both = self.target == "both" and view.kind in (ACTIVATION, GRADIENT)
        if not both and not self.target.startswith(view.kind):
            return False
        draw = py_stream(self.seed, "link-attack-select", self.worker, view.step, view.microbatch).random()
        return draw < self.fraction

    def observe(self, view: LinkView) -> None:
        """Hook run on every tensor, attacked or not, for attacks that keep history."""

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor | None:
        """The malicious tensor (None: cannot attack this one, send it honestly)."""
        return None

    def _stream(self, view: LinkView) -> torch.Generator:
        return torch_stream(self.seed, "link-attack", self.worker, view.kind, view.step, view.microbatch)


@dataclass(kw_only=True)
class Constant(LinkAttack):
    """Send a tensor whose entries all equal `value` (0: zeros)."""

    name: ClassVar[str] = "zeros"
    value: float = 0.0

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        return torch.full_like(view.tensor, self.value)


@dataclass(kw_only=True)
class RandomValues(LinkAttack):
    """Send i.i.d. N(0, std^2) values in place of the tensor."""

    name: ClassVar[str] = "random"
    std: float = 1.0

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        noise = torch.randn(view.tensor.shape, generator=gen, dtype=torch.float32)
        return (noise * self.std).to(view.tensor.dtype)


@dataclass(kw_only=True)
class Scaling(LinkAttack):
    """Send factor * x (default -1: the negated tensor)."""

    name: ClassVar[str] = "scaling"
    factor: float = -1.0

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        return view.tensor * self.factor


@dataclass(kw_only=True)
class SignFlip(LinkAttack):
    """Send -mean|x| * sign(x): the flipped sign pattern with the magnitude of x."""

    name: ClassVar[str] = "sign_flip"

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        x = view.tensor
        return -x.abs().mean() * torch.sign(x)


@dataclass(kw_only=True)
class Delay(LinkAttack):
    """Send the tensor of the same kind and slot sent `delay` steps earlier."""

    name: ClassVar[str] = "delay"
    delay: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delay < 1:
            raise ConfigError(f"delay attack delay={self.delay} must be >= 1")
        self._history: dict[str, deque[tuple[int, Tensor]]] = {}

    def observe(self, view: LinkView) -> None:
        history = self._history.setdefault(view.kind, deque())
        history.append((view.step, view.tensor.detach().clone()))
        while history and history[0][0] < view.step - self.delay:
            history.popleft()

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor | None:
        for step, old in self._history.get(view.kind, ()):
            if step <= view.step - self.delay and old.shape == view.tensor.shape:
                return old.clone()
        return None


@dataclass(kw_only=True)
class Bias(LinkAttack):
    """Send x + bias * mean|x|: every coordinate shifted by the same amount."""

    name: ClassVar[str] = "bias"
    bias: float = 1.0  # in units of the tensor's mean absolute value

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        return view.tensor + self.bias * view.tensor.abs().mean()


@dataclass(kw_only=True)
class InvisibleNoise(LinkAttack):
    """Replace a `portion` of the coordinates by Gaussian noise with the tensor's own mean and std."""

    name: ClassVar[str] = "invisible_noise"
    portion: float = 0.99  # fraction of coordinates replaced

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.portion <= 1.0:
            raise ConfigError(f"invisible_noise portion={self.portion} must be in (0, 1]")

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        x = view.tensor
        noise = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.dtype) * x.std() + x.mean()
        mask = torch.rand(x.shape, generator=gen) < self.portion
        return torch.where(mask, noise, x)


@dataclass(kw_only=True)
class Mixed(LinkAttack):
    """Each attacked microbatch gets one of `attacks`, drawn from the seeded stream."""

    name: ClassVar[str] = "mixed"
    attacks: str = "zeros,random,scaling,sign_flip,bias,invisible_noise"
    _parts: list[LinkAttack] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [n.strip() for n in self.attacks.split(",") if n.strip()]
        if not names or any(n not in LINK_ATTACKS or n in ("mixed", "none") for n in names):
            raise ConfigError(f"mixed attacks={self.attacks!r} must name attacks from {', '.join(LINK_ATTACKS)} (not mixed/none)")
        self._parts = [LINK_ATTACKS[n](target=self.target, start_step=self.start_step, seed=self.seed,
                                       worker=self.worker) for n in names]

    def observe(self, view: LinkView) -> None:
        for part in self._parts:
            part.observe(view)

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor | None:
        part = self._parts[int(torch.randint(len(self._parts), (1,), generator=gen))]
        return part.forge(view, gen)


@dataclass(kw_only=True)
class Adaptive(LinkAttack):
    """Send x + lam * (harm(x) - x) with the largest lam in [0, 1] the verifier accepts, times `margin`.

    harm is `scale` * x (default -1: the negation). The search is a bisection
    of `steps` probes. Without a probe (no verifier) it sends harm(x) outright.
    """

    name: ClassVar[str] = "adaptive"
    scale: float = -1.0
    margin: float = 0.9
    steps: int = 8

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        x = view.tensor
        harm = x * self.scale
        if view.probe is None or view.probe(harm):
            return harm
        lo, hi = 0.0, 1.0
        for _ in range(self.steps):
            mid = (lo + hi) / 2
            if view.probe(x + mid * (harm - x)):
                lo = mid
            else:
                hi = mid
        return x + self.margin * lo * (harm - x)


@dataclass(kw_only=True)
class StrikeBudget(Adaptive):
    """The white-box attacker that also knows the strike rule: outside the fences as often as it allows.

    It steps outside the fences on purpose, as often as the rule lets it without a ban, and rides
    their edge otherwise.

    It sends the full harm (the negation) on a microbatch while fewer than `spend` of its last
    `strike_window` microbatches (the verifier's window) carried an out-of-fence tensor, and the
    `Adaptive` edge-riding step otherwise. With `spend` = strikes - 1 (default 3 - 1) its own flags never
    reach the rule; blame the verifier adds for downstream gradients can still tip it over.
    """

    name: ClassVar[str] = "budget"
    spend: int = 2
    strike_window: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.spend < self.strike_window:
            raise ConfigError(f"budget spend={self.spend} must be in [0, strike_window={self.strike_window})")
        self._recent: deque[list] = deque(maxlen=self.strike_window)  # [microbatch, spent a flag on it]

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        entry = next((e for e in self._recent if e[0] == view.microbatch), None)
        if entry is None:
            entry = [view.microbatch, False]
            self._recent.append(entry)
        harm = view.tensor * self.scale
        if view.probe is None or view.probe(harm):
            return harm
        if entry[1] or sum(e[1] for e in self._recent) < self.spend:
            entry[1] = True  # one strike per microbatch: once spent, its other tensors are free
            return harm
        return super().forge(view, gen)


@dataclass(kw_only=True)
class MimicEMA(LinkAttack):
    """The paper's adaptive attack: send the EMA plus noise shaped like honest noise.

    The relay keeps its own EMA (factor `beta`) of the per-feature mean of the
    tensors it computes, of each kind, the same statistic a verifier keeps (it
    cannot read the verifier's, but it sees what it sends). It sends that EMA
    plus honest-shaped noise: the deviations of its honest tensor from its
    per-feature mean, with the token vectors shuffled (same distribution per
    feature, no relation left to the microbatch's tokens). The per-feature mean
    and the projected quantiles of what it sends are then those of honest
    traffic; what the downstream stage gets carries nothing of its input.
    """

    name: ClassVar[str] = "mimic"
    beta: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(f"mimic beta={self.beta} must be in [0, 1)")
        self._ema: dict[str, Tensor] = {}

    def observe(self, view: LinkView) -> None:
        mean = view.tensor.detach().reshape(-1, view.tensor.shape[-1]).float().mean(dim=0)
        old = self._ema.get(view.kind)
        self._ema[view.kind] = mean if old is None or old.shape != mean.shape else self.beta * old + (1 - self.beta) * mean

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor:
        x = view.tensor
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        noise = (rows - rows.mean(dim=0))[torch.randperm(rows.shape[0], generator=gen)]
        return (self._ema[view.kind] + noise).reshape(x.shape).to(x.dtype)


@dataclass(kw_only=True)
class Framing(LinkAttack):
    """Tamper like `base`, and write an honest upstream peer into what is forwarded, to share the blame.

    The tensor part is `base`'s; the framing itself is protocol-level (the
    relay rewrites the path and the upstream hop record of its forward carries,
    naming `frames_victim` instead of the peer it got the microbatch from), so
    the runtime relay does it when `frames` is set. The victim is drawn from a
    seeded stream among the previous stage's peers.
    """

    name: ClassVar[str] = "framing"
    frames: ClassVar[bool] = True
    base: str = "scaling"
    _part: LinkAttack = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base not in LINK_ATTACKS or self.base in ("framing", "none"):
            raise ConfigError(f"framing base={self.base!r} must name a link attack (not framing/none)")
        self._part = LINK_ATTACKS[self.base](target=self.target, start_step=self.start_step, seed=self.seed,
                                             worker=self.worker)

    def observe(self, view: LinkView) -> None:
        self._part.observe(view)

    def forge(self, view: LinkView, gen: torch.Generator) -> Tensor | None:
        return self._part.forge(view, gen)

    def victim(self, candidates: list[str]) -> str | None:
        """The honest-looking peer to frame (the same one all along: blame adds up on it)."""
        return py_stream(self.seed, "framing-victim", self.worker).choice(sorted(candidates)) if candidates else None


LINK_ATTACKS: dict[str, type[LinkAttack]] = {
    cls.name: cls
    for cls in (LinkAttack, Constant, RandomValues, Scaling, SignFlip, Delay, Bias, InvisibleNoise, Mixed, Adaptive,
                StrikeBudget, MimicEMA, Framing)
}


def make_link_attack(name: str, **params) -> LinkAttack:
    """Build a link attack by name; keyword params go to its dataclass."""
    if name not in LINK_ATTACKS:
        raise ConfigError(f"unknown link attack {name!r}; allowed: {', '.join(LINK_ATTACKS)}")
    try:
        return LINK_ATTACKS[name](**params)
    except TypeError as exc:
        raise ConfigError(f"link attack {name!r}: {exc}") from None
