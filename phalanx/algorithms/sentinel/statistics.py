"""SENTINEL: momentum statistics that verify the traffic between pipeline stages.

A trusted verifier sees every activation a stage sends forward over a link and
every activation gradient the next stage sends back over it. For each link and
direction it keeps an exponential moving average (EMA) of what honest traffic
looks like, measures how far each incoming tensor lies from it, and flags the
tensor when the distances leave adaptive Tukey fences. Flagged tensors do not
update the EMA; a flagged (or tainted) gradient is replaced by the gradient
momentum; repeated flags ban the sending worker. Pure: no I/O, no clock.

Choices where the paper is silent (each is a `SentinelConfig` field):

* **Per feature, not per coordinate.** Two microbatches hold different text,
  so coordinate (b, t, c) of one has no relation to coordinate (b, t, c) of
  the next: a per-coordinate EMA averages unrelated tokens, and a distance
  taken coordinate by coordinate is dominated by the data's own spread (an
  all-zero tensor is then about as far from the EMA as an honest one). The
  statistics are therefore taken over the last axis (features) with every
  other axis pooled: the per-feature mean over the B*T token vectors (token
  noise shrinks by sqrt(B*T), so mean shifts, sign changes and scalings stand
  out), plus the quantile functions of the token vectors projected on random
  directions (the distribution's shape, for attacks that keep the mean). This
  is also independent of the microbatch size and sequence length, and costs
  O(C) memory per link instead of O(B*T*C).
* **Distances** (on the per-feature mean m_x of the tensor and the EMA m):
  ``l1`` mean |m_x - m|; ``l2`` ||m_x - m|| / ||m|| (normalized Euclidean);
  ``sign`` the fraction of features with sign(m_x) != sign(m) (a zero counts
  as a flip); ``swd`` the sliced 1-Wasserstein distance: mean over
  `projections` seeded random unit directions and `quantiles` levels of
  |Q_x - Q|, where Q is the EMA of the projected quantile functions (in 1-D the
  average of quantile functions is the Wasserstein barycentre, so Q is the
  EMA's distribution).
* **``scale``**: log(mean |Q_x| / mean |Q|) over the projected quantiles,
  i.e. log c for a tensor scaled by c, fenced linearly on both sides. The
  distances above saturate when a tensor shrinks (a tensor scaled by c -> 0 is
  at most as far from the EMA as zeros), so their log fences let a white-box
  attacker shrink its activations about tenfold (and its gradients, once
  ``align`` forbids negating them); the honest stage after it that normalises
  its input (the head's LayerNorm) then answers with input gradients as many
  times too large, which are flagged against that honest stage (measured:
  honest head relays banned at 37.5%). Honest activations keep their scale
  from one microbatch to the next (log IQR 0.03-0.1 here), gradients less so
  (0.08-0.15), so ``scale`` bounds the shrink (to 0.71 in the white-box test).
  On gradients only the lower side counts: shrinking is the harm there
  (``align`` forbids negating, ``swd``'s log fence inflating), while honest
  gradients grow whenever the loss does, and a flagged tensor never updates
  the fence: measured two-sided, a detect-only run whose attackers kept
  damaging the model flagged 35 honest gradients and convicted 3 honest relays.
  Measured on activations only, it let the attackers' shrunk gradients
  through (37.5%: fewer attackers banned, one honest relay banned).
* **Gain** (option `gain`, off; not a voting distance; on links whose output follows its input,
  ``align`` fence above 0.2): log of the spread of the output's centred
  token sketch over that of the input the verifiers delivered to its stage,
  flagged below a median fence of the link's accepted gains. ``scale``'s
  reference is the link's EMA, which learns accepted shrunk tensors, so at
  37.5% (above a Tukey fence's 25% breakdown) the white-box attacker's
  accepted shrink grew with the run (c = 0.11 after 12 iterations); the
  gain is anchored on what the verifiers delivered, an honest residual stage
  fed a shrunk input has a larger gain, not a smaller one, and the median
  fence stays bounded against fewer than half of the window.
* **Staleness: ``bind``.** The distances above compare a tensor with the
  link's history, so a replayed tensor (delay: an honest tensor of another
  microbatch, sent many steps earlier) passes them all. ``bind`` ties a
  stage's output to its input for the same microbatch: the verifier records a
  sketch of what it delivers to a stage (its input forward, the gradient of
  its output backward: token vectors centred per position, projected on
  `bind_projections` seeded directions) and compares the stage's own output
  with it: 1 - linear CKA of the two sketches. A stage maps each token's input
  to its output, so the token-by-token similarity structure carries over
  (CKA 0.3-0.9 for honest tensors here); an output of another microbatch keeps
  none of it (CKA 0.01-0.05, ``bind`` near 1), whatever the delay. Above its
  fence, ``bind`` counts only beyond `bind_floor` (0.9): late in training an
  honest stage's gradient can drift far from the window (CKA 0.1-0.5) while
  still far from unrelated; below its lower fence (an output that copies its
  input) it counts as usual.
* **``align``**: the cosine of the same two sketches. Sign-aware
  where ``bind`` is not: a white-box attacker's negated gradient passes
  ``sign`` (noise on a gradient's near-zero per-feature means), ``swd`` and
  ``bind``, not ``align``. Below its fence it flags the tensor only at or
  under `align_floor` (0): a residual stage's output is its input plus a
  correction, so a positive cosine, however low, is a large correction
  (honest gradients of stage 2 sat at 0.92-0.95, fence 0.685, and single
  microbatches scored 0.50-0.66: false flags), a reversed output is not.
  Between the floor and the fence it is evidence about what flowed into the
  sender (an honest stage fed a white-box attacker's shrunk activations
  corrects a lot), held against the workers upstream of it only (see
  Strikes): no flag, no substitute, not learned.
* **Tainted microbatches.** A forward tensor of a microbatch flagged upstream
  is judged on ``bind`` alone (its stage was fed a tampered input, so only the
  comparison with that input says something about it), from
  `tainted_bind_floor`, against its sender alone.
* **Fences.** Tukey fences (or, `fence="median"`, median -+ (k + 1/2)*2*MAD,
  whose breakdown point is 50% instead of 25%) over the last `window` accepted distances:
  [Q1 - k*IQR, Q3 + k*IQR] with k = 5 (wider than Tukey's "far out" 3, which
  flagged ~0.4% of honest GPT traffic; 5 flags ~0.1%). l1, l2 and swd are
  fenced on a log scale (`log_fences`): they are positive and right-skewed,
  and training drift scales them. The lower fence matters: a tensor that
  copies the EMA is implausibly close to it (against the EMA only: against
  the senders' median an honest tensor can be as close, see `_outside`). The IQR is floored (`min_spread`
  in log units, one feature's resolution 1/C for ``sign``) so a window of
  near-identical values does not turn every wiggle into a flag.
  **Per sender** (`fence="senders"`, an option: with bursty routing in a stage
  of 3 relays and a fast-moving model it banned an honest relay in 3 of 60 toy
  trials, the pooled Tukey fence in none (review RS, session 24, HIGH 2);
  session 23 fixed its honest
  bans in small off-path groups, traced to the magnitudes' lower fence and to
  windows holding distances to two references: `_outside`, `_remeasure`;
  session 24 the one at the session-23 merge, where a relay banned by another
  defence still voted on a link of 2 sending relays: `_present`): each
  quartile and the IQR are taken over each present sender's own last
  `sender_window` accepted values and then the median across senders
  (`sender_fence`), once at least 3 senders vote (before that, the pooled
  median fence with 3 or more present senders, else the pooled Tukey fence). A pooled window
  is a mix whose proportions the senders choose: at 37.5% malicious the
  white-box attacker's values sat on Q1, and each turnover of the window
  moved the fence k*IQR further (accepted shrink c: 0.7 -> 0.11, and the loss
  gap grew with the run). One vote per sender bounds each fence by the honest
  senders' own quartiles for any minority of senders, and since the honest
  values are measured against the same EMA as the liar's, the accepted
  ``scale`` stays within (k + 1/2)*S of the honest ones (S the honest
  senders' median IQR) however far the EMA has moved. For exchangeable honest
  replicas it is the pooled fence up to sampling noise. A live sender votes
  once it has `sender_window` accepted tensors (`_voters_of`): one vote per
  identity needs identities that last (a liar cycling identities gains no
  votes; honest relays that change identity faster lose theirs). The distances are then taken against the coordinate-wise
  median across the live senders of each one's last 2 accepted summaries,
  not against the EMA (`_reference`): the EMA learns the liars' accepted
  tensors, so it moved with them, every honest tensor looked further off,
  the fences (made of honest distances) widened and the liars went further
  (toy stage: the shrink to c 0.28-0.5 at 45% of the traffic; a mean-shift
  rider 7-fold, review RC). Per tensor, an accepted value is then at least
  med(Q1_s) - k*S against a reference no minority moves: on ``scale``, c >=
  about exp(-(k + 1/2) * S) times an honest tensor of the link, S the
  senders' median (corrected) IQR of ``scale``, with fewer than half of the
  voting senders lying, however long the run. That bounds the white-box
  shrink, not every harm: a mean shift of the size the k = 5 log fences
  admit per tensor (review RC's rider) cost +10% in 15 simulated iterations.
* **Warm-up.** The first `warmup` tensors of each link and direction are
  trusted (the paper's honest warm-up): they build the EMA and the windows.
* **Vote.** A tensor is flagged when `vote` of the distances (any, majority,
  all) are outside their fences. Malformed tensors (wrong feature size,
  non-finite values) are always flagged.
* **Detect-only** (`detect_only`): everything above runs, but the strike rule
  only *convicts* (reported in `Verdict.convicted`), nobody is banned, so F1
  can be measured over every tampered tensor of a run.
* **Protocol breaches** (`reject`): a tensor whose sender forged or dropped a
  hop signature is flagged against the sender alone (no upstream blame).
* **Strikes.** A worker is banned when `strikes` of the last `strike_window`
  microbatches it handled carry a flag against it (one strike per microbatch).
  A flag is held against the sender and against every worker the verifier saw
  sending that microbatch forward upstream of it: an activation gradient is
  odd when the activation that produced it was odd, and an attacker whose
  forward tensors pass the fences (delay, adaptive) shows up as odd gradients
  from the honest workers after it. Random routing spreads that blame over
  the honest workers while the attacker collects all of it; once a worker is
  banned, the strikes it shared with others are taken off them (explained).
  A tensor reversed against (``align``) or unrelated to (``bind``) the input
  its own stage was given is not explained by that input: that flag is the
  sender's alone (at 37.5% malicious, an honest relay upstream of several
  attackers otherwise collected a share of each one's flags and was banned),
  and such flags also ban at `strikes` among the sender's last `own_window`
  (32) microbatches: an attacker that knows the strike rule (`budget`) keeps
  2 flags in every 8, and no input makes an honest stage reverse its output.
  So is an output shrunk to nothing (its centred sketch spreads at most
  1e-2 of its input's: zeros, zeros plus tiny noise, 1e-3 * x) on an
  untainted microbatch, on a link whose output follows its input (``align``
  fence above 0.2: residual stages, not the head, which a LayerNorm makes
  answer one logit vector to tokens that differ only in scale): ``align``
  and ``bind`` are undefined or blind there, and no delivered input makes a
  residual stage cancel itself (37.5% `zeros`: an honest relay upstream of
  two attackers was banned with them).
  A flag on an activation whose stage added a mean (output mean minus input
  mean on every feature, fenced against the link's history) or shrank it
  (gain) to a usual input (its mean and spread inside Tukey's inner fences,
  not seen shrunk upstream; decided from the input alone, never from the
  output the sender controls) is the sender's alone too, in `strike_window`
  only: a pre-norm residual stage's correction ignores a shift of its whole
  input (37.5% `bias`: an honest relay upstream of two attackers was banned).
  The other way round, an ``align`` between `align_floor` and its fence (a
  large correction) flags no tensor and is a strike against the upstream
  workers alone. A gradient the flagged worker computed from a substitute
  is not judged (it follows the momentum, not honest traffic). A gradient
  flagged only for being larger than usual (magnitudes above their fences),
  by no more than its stage's forward input was seen shrunk at the same link,
  is a flag (substituted) held against the upstream workers alone: a stage
  behind a LayerNorm answers an input shrunk by c with gradients 1/c as large
  (`_grown_by_shrunk_input`; 37.5% `adaptive`: the honest head was banned).
  A tensor flagged only for being larger than usual while the input the
  verifiers delivered to its stage for that microbatch was itself an outlier
  (its spread beyond the link's fence on the usual inputs'), and grown by no
  more than that input past the ``scale`` fence, is flagged but not held
  against its sender: the microbatch's input explains it
  (`_large_as_its_input`; issue 18's `all` seed 2: three outlier microbatches
  banned an honest relay). A gradient's is held against nobody; an
  activation's against the upstream workers alone, who delivered that input
  and may have made it (a relay that grows its outputs within its own fences
  is otherwise never struck: session 24).
* **Stage-wide drift.** Under the honest-majority-per-stage assumption the
  replicas of a stage share its parameters, so when the latest tensors of at
  least half of a stage's other senders are fence-flagged (the judged sender
  never counts for itself; the stage size is the most senders the window
  ever held, so at least two honest replicas must be flagged at once), the
  flags are spread over most of every other link's senders (each carrying
  flagged microbatches of at least half the stage's distinct senders, so not
  explained by a minority upstream nor faked by one liar), and a tensor
  moves with its stage (inside median fences around the other senders'
  latest tensors), the model moved: the tensor is judged "drift" (learned
  only within `learn_k`), and this track's strikes of the move are taken
  back. A verifier never wipes out a stage that way (25% `adaptive`, seed 2:
  all four stage-1 relays were banned at once). A sender that stands out
  during a move (zeros) is flagged as usual.
* **Resends.** The same tensor of the same microbatch resent by the same
  sender over the same link (a retried delivery) gets its first verdict back:
  nothing is learned or struck twice (churn: resends filled a warm-up). A
  different tensor on the same delivered input is equivocation, flagged
  against the sender alone; resends judged again (the input or taint
  changed) are neither learned nor remembered by the drift rule.
* **Response.** Forward, the tensor is passed on unchanged (the pipeline keeps
  moving, as in the paper's figure 5) and the microbatch is tainted: later
  checks of it downstream are on ``bind`` alone (above), and every gradient of
  it from the flagged worker's stage back is replaced by the gradient momentum
  (the link's EMA per-feature mean broadcast to the tensor's shape). Backward,
  a flagged gradient is replaced the same way, and the gradients computed from
  a substitute further back are passed on without being judged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...core.errors import ConfigError
from ...core.rng import torch_stream

DISTANCES = ("l1", "l2", "sign", "swd", "scale", "bind", "align")
BOUND = ("bind", "align")  # distances between a stage's output and its own input for the same microbatch
MAGNITUDES = ("l1", "l2", "swd")  # fenced on a log scale when `log_fences`
VOTES = ("any", "majority", "all")
FENCES = ("senders", "tukey", "median")
SENDER_VOTES = ("identity", "weighted")
FORWARD, BACKWARD = "forward", "backward"


OWN_ALIGN_BASELINE = 0.2  # a flag is the sender's own only on a link whose align fence stays above this (review, session 18)
# an output whose centred sketch spreads less than this fraction of its input's is "shrunk to nothing": no honest
# residual stage does that (measured: 1.0-1.25 on 2-block GPT stages at initialisation, both directions), zeros or
# 1e-3 * x do
SHRUNK_RATIO = 1e-2
SENDER_VALUES = 4  # accepted values a sender needs before its quartiles count in the `senders` fence
SENDERS = 3  # senders with that many values needed for the `senders` fence (fewer: the pooled Tukey fence)
SHRUNK_INPUT = -0.2  # ``scale`` of a stage's input (log) below which its large correction is explained by it (c < 0.82)
GONE_GAPS = 3  # a sender is gone only after this many of its usual gaps without an accepted tensor (`Sentinel._present`)

@dataclass(frozen=True)
class SentinelConfig:
    """Every unknown of the paper, with the value chosen here."""

    beta_h: float = 0.9  # EMA factor of activations (paper's default; 0 = last accepted tensor)
    beta_g: float = 0.8  # EMA factor of activation gradients (paper's default)
    distances: str = "sign,swd,bind,align,scale"  # comma-separated subset of DISTANCES (vote ablation: docs/notes/issue-16.md)
    vote: str = "any"  # how many out-of-fence distances flag a tensor: any, majority or all
    k: float = 5.0  # Tukey multiplier; 3 ("far out") gave ~0.4% false flags on the GPT's traffic, 5 about 0.1%
    window: int = 64  # accepted distances kept per link, direction and distance
    warmup: int = 200  # trusted tensors per link and direction before any flag (covers the fast early drift)
    two_sided: bool = True  # also flag distances below the lower fence (copies of the EMA)
    log_fences: bool = True  # fence log(l1), log(l2), log(swd): they are positive and right-skewed
    min_spread: float = 0.05  # IQR floor of the fenced values (log units: 5%); sign's floor is 1/C
    projections: int = 16  # random directions of the sliced Wasserstein distance
    bind_projections: int = 32  # random directions of the input/output sketches of the ``bind`` distance
    bind_floor: float = 0.9  # ``bind`` above its fence counts only above this (CKA < 0.1: unrelated sketches score 0.01-0.05)
    tainted_bind_floor: float = 0.95  # the same on a microbatch tainted upstream (its input is suspect); replays score 0.958+
    reversed_align: float = 0.0  # ``align`` below its fence and this: an output reversed against its input, a flag on the sender alone
    align_floor: float = 0.0  # ``align`` below its fence flags only at or under this; above it, it is evidence against the sender's upstream
    quantiles: int = 32  # levels of each projected quantile function
    strikes: int = 3  # flags among a worker's last `strike_window` checks that ban it
    strike_window: int = 8
    own_window: int = 32  # `strikes` flags on a sender's own input relation (reversed, unrelated) among its last this many microbatches ban too
    seed: int = 0  # run seed of the projection streams
    # senders: Tukey's fence from per-sender quartiles (`sender_fence`; a minority of senders cannot move it);
    # tukey: [Q1 - k*IQR, Q3 + k*IQR] over the pooled window; median: median -+ (k + 1/2) * 2*MAD (breakdown 50%)
    fence: str = "tukey"
    sender_window: int = 8  # accepted distances kept per sender and distance for the `senders` fence
    # who votes in the `senders` fence and reference: identity (one vote per live identity with `sender_window`
    # tensors over its lifetime) or weighted (each live sender weighs min(its tensors in the window, sender_window) /
    # sender_window, weighted medians; review RC of session 22, findings 0 and 2: see `Sentinel._voters_of`)
    sender_vote: str = "identity"
    stage_relays: int = 0  # relays per stage where the deployment knows it (weighted vote: a sender's cap); 0 = unknown
    learn_k: float = 0.0  # > 0: only tensors inside Tukey fences of this multiplier update the EMA and windows
    detect_only: bool = False  # flag and respond, never ban: a worker reaching the strike rule is convicted (reported)
    remembered: int = 4096  # microbatches whose first verdicts are kept for resends (oldest dropped first)
    gain: bool = False  # flag outputs whose gain over their input lies below the link's median fence (off: see `_shrinks`)

    def __post_init__(self) -> None:
        for key in ("beta_h", "beta_g"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"sentinel.{key}={getattr(self, key)} must be in [0, 1)")
        names = self.distance_names
        if not names or any(n not in DISTANCES for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"sentinel.distances={self.distances!r} must be distinct names from {', '.join(DISTANCES)}")
        if self.vote not in VOTES:
            raise ConfigError(f"sentinel.vote={self.vote!r} must be one of {', '.join(VOTES)}")
        if self.fence not in FENCES:
            raise ConfigError(f"sentinel.fence={self.fence!r} must be one of {', '.join(FENCES)}")
        if self.stage_relays < 0:
            raise ConfigError(f"sentinel.stage_relays={self.stage_relays} must be >= 0 (0: unknown)")
        if self.sender_vote not in SENDER_VOTES:
            raise ConfigError(f"sentinel.sender_vote={self.sender_vote!r} must be one of {', '.join(SENDER_VOTES)}")
        if not (math.isfinite(self.learn_k) and 0 <= self.learn_k):
            raise ConfigError(f"sentinel.learn_k={self.learn_k} must be 0 (off) or a positive number")
        if not (math.isfinite(self.k) and self.k > 0):
            raise ConfigError(f"sentinel.k={self.k} must be a positive number")
        if self.learn_k >= self.k:
            # every accepted tensor lies inside the k-fences, so learn_k-fences as wide or wider filter nothing
            raise ConfigError(f"sentinel.learn_k={self.learn_k} must be below sentinel.k={self.k} (or 0 to turn it off)")
        if self.window < 4:
            raise ConfigError(f"sentinel.window={self.window} must be >= 4 (quartiles need a few values)")
        if self.sender_window < SENDER_VALUES:
            raise ConfigError(f"sentinel.sender_window={self.sender_window} must be >= {SENDER_VALUES} (a sender's "
                              f"quartiles need a few values)")
        if self.warmup < 5:
            raise ConfigError(f"sentinel.warmup={self.warmup} must be >= 5 (fences need at least 4 distances)")
        for key in ("bind_floor", "tainted_bind_floor"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"sentinel.{key}={getattr(self, key)} must be in [0, 1]")
        if self.tainted_bind_floor < self.bind_floor:
            raise ConfigError(f"sentinel.tainted_bind_floor={self.tainted_bind_floor} must be >= sentinel.bind_floor="
                              f"{self.bind_floor} (a stage fed a tampered input binds to it no better than to an honest one)")
        for key in ("reversed_align", "align_floor"):
            if not -1.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"sentinel.{key}={getattr(self, key)} must be in [-1, 1] (a cosine)")
        if not 0.0 <= self.min_spread < 1.0:
            raise ConfigError(f"sentinel.min_spread={self.min_spread} must be in [0, 1)")
        for key in ("projections", "bind_projections", "quantiles", "strikes", "strike_window", "own_window",
                    "remembered"):
            if getattr(self, key) < 1:
                raise ConfigError(f"sentinel.{key}={getattr(self, key)} must be >= 1")
        if self.strikes > self.strike_window:
            raise ConfigError(f"sentinel.strikes={self.strikes} must be <= sentinel.strike_window={self.strike_window}")
        if self.own_window < self.strike_window:
            # own-relation flags count in both rules, so a shorter own window could never ban first: the rule is off
            raise ConfigError(f"sentinel.own_window={self.own_window} must be >= sentinel.strike_window="
                              f"{self.strike_window} (set it equal to turn the longer memory of own-relation flags off)")

    @property
    def distance_names(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.distances.split(",") if n.strip())


@dataclass(frozen=True)
class Summary:
    """What the statistics keep of one tensor: per-feature mean and projected quantiles."""

    mean: Tensor  # [C]
    quantiles: Tensor  # [quantiles, projections]


@dataclass(frozen=True)
class Fence:
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(frozen=True)
class Verdict:
    """The verifier's decision on one tensor.

    `flagged` is detection (fences or a malformed tensor); `substitute`, set
    only backward, is what the verifier sends on instead of the tensor (the
    gradient momentum), for a flagged gradient or one from a worker flagged on
    the same microbatch forward (`reason` "tainted").
    """

    link: int
    direction: str
    worker: str
    microbatch: Hashable
    flagged: bool
    reason: str  # ok, warmup, fence, malformed, tainted, banned
    distances: tuple[tuple[str, float], ...] = ()
    outside: tuple[str, ...] = ()  # distances outside their fences
    bans: tuple[str, ...] = ()  # workers this verdict's strikes banned
    convicted: tuple[str, ...] = ()  # workers this verdict's strikes brought to the strike rule (banned unless detect-only)
    suspects: tuple[str, ...] = ()  # workers a flag was held against (the sender and, if blamed, its upstream)
    settled: tuple[Verdict, ...] = ()  # held gradient verdicts this one's judgement struck (`Sentinel._settle`)
    substitute: Tensor | None = field(default=None, repr=False)

    def passed_on(self, tensor: Tensor) -> Tensor:
        """The tensor the verifier sends on: the substitute if any, else the tensor."""
        return tensor if self.substitute is None else self.substitute


# ---------------------------------------------------------------------------
# pure statistics


def tukey_fence(values: list[float] | tuple[float, ...], k: float, floor: float = 0.0) -> Fence:
    """[Q1 - k*IQR, Q3 + k*IQR] with quartiles by linear interpolation (numpy's default).

    The IQR used is max(IQR, floor).
    """
    if len(values) < 2:
        raise ValueError(f"a fence needs at least 2 values, got {len(values)}")
    ordered = sorted(values)
    q1, q3 = _quantile(ordered, 0.25), _quantile(ordered, 0.75)
    spread = max(q3 - q1, floor)
    return Fence(q1 - k * spread, q3 + k * spread)


def median_fence(values: list[float] | tuple[float, ...], k: float, floor: float = 0.0) -> Fence:
    """median -+ (k + 1/2) * max(2*MAD, floor): Tukey's fence where the data are symmetric (Q3 - median =
    MAD, IQR = 2*MAD), but with a 50% breakdown point instead of 25%.

    Why it matters: an adversary that controls a fraction e of the window and places its values at the
    upper fence moves Q3 onto its own values once e >= 1/4, so each Tukey fence lies k*IQR beyond the last
    one and the fence drifts without bound. The median and the MAD stay between honest quantiles (at most
    the honest 0.5/(1-e) quantile) for any e < 1/2, so this fence stays bounded against a contaminated
    window (not against honest values that move because honest stages are fed tampered inputs).
    """
    if len(values) < 2:
        raise ValueError(f"a fence needs at least 2 values, got {len(values)}")
    ordered = sorted(values)
    mid = _quantile(ordered, 0.5)
    mad = _quantile(sorted(abs(v - mid) for v in ordered), 0.5)
    half = (k + 0.5) * max(2 * mad, floor)
    return Fence(mid - half, mid + half)


def sender_fence(per_sender: list[list[float]], k: float, floor: float = 0.0,
                 weights: list[float] | None = None) -> Fence:
    """Tukey's fence with each quartile and the IQR taken per sender, then the median across senders:
    [med(Q1_s) - k * S, med(Q3_s) + k * S], S = max(med(IQR_s * n_s / (n_s - 4/3)), MAD(M_s), floor), n_s the
    sender's count, M_s its median.

    The IQR of a few values underestimates the distribution's (normal data, n = 8: by 17%; the factor
    n / (n - 4/3) matches the measured 0.834, 0.891, 0.927 at n = 8, 12, 16), which made the fence narrower than the
    pooled one and flagged honest tensors (37.5% `adaptive`, seed 0: an honest head relay banned at iteration 28).

    Why: a pooled window's quartiles (Tukey) break down at 25% of its values and its median at 50%, and how many
    of the values are an adversary's is up to it (37.5% of the relays, or more by taking more microbatches). Each
    sender here has one vote per statistic, so with fewer than half of the senders the three medians stay between
    the honest senders' own values whatever the liars send and however much of the traffic they carry. For
    exchangeable honest senders (replicas of one stage) it is the pooled Tukey fence up to sampling noise. A
    sender with fewer than `SENDER_VALUES` values (a distance not measured on all of its tensors) votes on the
    quartiles and counts as spread 0: it cannot widen the fence. Who votes, and with what weight (`weights`: the
    medians across senders are then weighted medians), is the caller's (`Sentinel._voters_of`)."""
    if len(per_sender) < 1 or any(len(values) < 1 for values in per_sender):
        raise ValueError("a sender fence needs at least one sender, each with at least one value")
    median = _median if weights is None else lambda values: weighted_median(values, weights)  # noqa: E731
    rows = [sorted(values) for values in per_sender]
    q1 = median([_quantile(r, 0.25) for r in rows])
    q3 = median([_quantile(r, 0.75) for r in rows])
    # a sender with fewer than SENDER_VALUES values votes on the quartiles and counts as no spread
    iqrs = [(_quantile(r, 0.75) - _quantile(r, 0.25)) * len(r) / (len(r) - 4 / 3) if len(r) >= SENDER_VALUES else 0.0
            for r in rows]
    # never narrower than the senders' own medians lie apart (their MAD; a sender with fewer values counts as 0): a
    # model that moves while each sender sends in bursts of one version spreads the senders, not each one's values
    # (review RS s24 HIGH 2: 3 honest relays, one banned in 3 of 60 trials; none with this). Liars fewer than half of
    # the senders move the MAD up to the honest deviations' 0.5 / (1 - e) quantile (x1.9 at 3 of 8), not further;
    # twice the MAD (the IQR of symmetric data) gave that room to review RC s22's mean-shift rider (its accepted
    # shift doubled: `test_three_of_eight_senders_cannot_grow_an_accepted_mean_shift_through_the_reference`).
    centre = median([_quantile(r, 0.5) for r in rows])
    apart = median([abs(_quantile(r, 0.5) - centre) if len(r) >= SENDER_VALUES else 0.0 for r in rows])
    spread = max(median(iqrs), apart, floor)
    return Fence(q1 - k * spread, q3 + k * spread)


def _median(values: list[float]) -> float:
    return _quantile(sorted(values), 0.5)


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The value where the cumulative weight of the sorted values reaches half of the total (the mean of the two
    values around it where it is reached exactly): the ordinary median when the weights are equal."""
    pairs = sorted(zip(values, weights))
    half, cum = sum(weights) / 2, 0.0
    for i, (value, weight) in enumerate(pairs):
        cum += weight
        if math.isclose(cum, half, rel_tol=1e-9, abs_tol=1e-12) and i + 1 < len(pairs):
            return (value + pairs[i + 1][0]) / 2
        if cum > half:
            return value
    return pairs[-1][0]


def _weighted_median_rows(rows: Tensor, weights: list[float]) -> Tensor:
    """Coordinate-wise `weighted_median` of the rows of a [S, ...] tensor."""
    if len(set(weights)) == 1:
        return torch.quantile(rows, 0.5, dim=0)
    flat = rows.reshape(rows.shape[0], -1)
    return torch.tensor([weighted_median(flat[:, j].tolist(), weights) for j in range(flat.shape[1])],
                        dtype=rows.dtype).reshape(rows.shape[1:])


def _quantile(ordered: list[float], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def projections(seed: int, link: int, direction: str, features: int, count: int) -> Tensor:
    """Seeded random unit directions [features, count] of a link's sliced Wasserstein distance."""
    gen = torch_stream(seed, "sentinel-projections", link, direction, features)
    dirs = torch.randn(features, count, generator=gen)
    return dirs / dirs.norm(dim=0, keepdim=True)


def summarize(tensor: Tensor, proj: Tensor, levels: int) -> Summary:
    """Per-feature mean and projected quantile functions of a tensor [..., C]."""
    rows = tensor.detach().reshape(-1, tensor.shape[-1]).float()
    mean = rows.mean(dim=0)
    projected = rows @ proj  # [N, P]
    grid = (torch.arange(levels, dtype=torch.float32) + 0.5) / levels
    return Summary(mean, torch.quantile(projected, grid, dim=0))


def distances(x: Summary, ref: Summary, names: tuple[str, ...] = DISTANCES) -> dict[str, float]:
    """Distances of a tensor's summary to the reference (the EMA), by name."""
    out = {}
    diff = x.mean - ref.mean
    for name in names:
        if name == "l1":
            out[name] = diff.abs().mean().item()
        elif name == "l2":
            out[name] = (diff.norm() / ref.mean.norm().clamp_min(1e-30)).item()
        elif name == "sign":
            out[name] = (torch.sign(x.mean) != torch.sign(ref.mean)).float().mean().item()
        elif name == "swd":
            out[name] = (x.quantiles - ref.quantiles).abs().mean().item()
        elif name == "scale":
            out[name] = math.log(max(x.quantiles.abs().mean().item(), 1e-30) / max(ref.quantiles.abs().mean().item(), 1e-30))
        elif name in BOUND:
            continue  # needs the stage's input for the same microbatch: see `binding` and `align`
        else:
            raise ValueError(f"unknown distance {name!r}; known: {', '.join(DISTANCES)}")
    return out


def bind_sketch(tensor: Tensor, proj: Tensor) -> Tensor:
    """The token vectors of a tensor [..., C] projected on `proj` [C, P], for the ``bind`` distance.

    A tensor [B, T, C] with B > 1 is centred per position (the mean over the
    batch at each position is taken off), so what remains is what the text of
    this microbatch puts there, not what every microbatch shares (positions)."""
    t = tensor.detach().float()
    if t.dim() >= 3 and t.shape[0] > 1:
        t = t - t.mean(dim=0, keepdim=True)
    return t.reshape(-1, t.shape[-1]) @ proj


def binding(inp: Tensor, out: Tensor) -> float | None:
    """1 - linear CKA between a stage's input and output sketches of one microbatch (None: not comparable).

    A stage maps each token's input to its output, so tokens that look alike
    coming in look alike going out: the token-by-token similarity structure of
    the output follows the input's (linear CKA is high, about 0.4-0.8 here).
    An output replayed from another microbatch (a stale tensor) or made up
    loses that structure: CKA falls near 0, so the distance rises near 1.
    """
    if inp.shape != out.shape or inp.shape[0] < 2:
        return None
    a = inp - inp.mean(dim=0, keepdim=True)
    b = out - out.mean(dim=0, keepdim=True)
    norm = (a.T @ a).norm() * (b.T @ b).norm()
    if not torch.isfinite(norm) or norm.item() <= 1e-30:
        return None
    return 1.0 - ((b.T @ a).pow(2).sum() / norm).item()


def align(inp: Tensor, out: Tensor) -> float | None:
    """The cosine between a stage's output sketch and its input sketch for one microbatch (None: not
    comparable): <a, b> / (|a| |b|) over the centred sketches.

    Where ``bind`` (CKA) is blind to sign, this is not: a residual block's
    output is its input plus a correction, and its input gradient is the
    output's gradient plus a correction, so the cosine is clearly positive
    (0.5-0.98 on the GPT's block stages); a negated tensor makes it negative. It is scale-invariant,
    so an honest stage fed a scaled input (a LayerNorm undoes the scale) keeps
    its value, and it is anchored on what the verifiers delivered to the stage:
    relays cannot feed it, only ride its fence. (A slope <a, b> / <a, a> would
    also see scaling, but an honest stage behind a LayerNorm fed a scaled
    input changes its slope too: measured, it flagged the honest head.)
    """
    if inp.shape != out.shape or inp.shape[0] < 2:
        return None
    a = inp - inp.mean(dim=0, keepdim=True)
    b = out - out.mean(dim=0, keepdim=True)
    norm = a.norm() * b.norm()
    if not torch.isfinite(norm) or norm.item() <= 1e-30:
        return None
    value = ((a * b).sum() / norm).item()
    return value if math.isfinite(value) else None


def ema(old: Summary, new: Summary, beta: float) -> Summary:
    """beta * old + (1 - beta) * new, field by field."""
    return Summary(old.mean * beta + new.mean * (1 - beta), old.quantiles * beta + new.quantiles * (1 - beta))


def vote(outside: int, total: int, rule: str) -> bool:
    """Whether `outside` of `total` out-of-fence distances flag a tensor under `rule`."""
    if rule == "any":
        return outside >= 1
    if rule == "majority":
        return 2 * outside > total
    if rule == "all":
        return outside == total
    raise ValueError(f"unknown vote {rule!r}; known: {', '.join(VOTES)}")


def _scaled(name: str, value: float, config: SentinelConfig) -> float:
    """The scale the fences work on: log for the magnitudes (l1, l2, swd) when `log_fences`."""
    if name not in MAGNITUDES or not config.log_fences:
        return value
    return math.log(max(value, 1e-300))


def _spread_ratio(inp: Tensor, out: Tensor) -> float:
    """The spread of an output's centred sketch over its input's (inf: not comparable, or an input with no spread)."""
    if inp.shape != out.shape or inp.shape[0] < 2:
        return math.inf
    spread_in = (inp - inp.mean(dim=0, keepdim=True)).norm().item()
    spread_out = (out - out.mean(dim=0, keepdim=True)).norm().item()
    if not (math.isfinite(spread_in) and math.isfinite(spread_out)) or spread_in <= 1e-30:
        return math.inf
    return spread_out / spread_in


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether two recorded input sketches are the same (both missing counts as the same)."""
    return a is b or (a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b)))


def _split(sketch: Tensor) -> tuple[Tensor, Tensor] | None:
    """The token rows of a `Sentinel.sketch` (what ``bind`` and ``align`` compare) and the tensor's full
    per-feature mean; None when the sketch is not laid out as `Sentinel.sketch` lays it out."""
    if sketch.dim() != 2 or sketch.shape[0] < 2 or sketch.shape[1] < 1:
        return None
    features = float(sketch[-1, 0])
    if not features.is_integer() or features < 1 or bool(sketch[-1, 1:].any()):
        return None
    features = int(features)
    rows = -(-features // sketch.shape[1])
    if sketch.shape[0] < rows + 2:  # at least one token row
        return None
    return sketch[:-rows - 1], sketch[-rows - 1:-1].reshape(-1)[:features]


def _tokens(sketch: Tensor) -> Tensor:
    """The token rows of a well-formed `Sentinel.sketch` (`record_input` keeps no other)."""
    return _split(sketch)[0]


def _mean(sketch: Tensor) -> Tensor:
    """The full per-feature mean of a well-formed `Sentinel.sketch`."""
    return _split(sketch)[1]


def _log_spread(tokens: Tensor) -> Tensor:
    """log of the norm of a token sketch centred over its tokens."""
    return (tokens - tokens.mean(dim=0, keepdim=True)).norm().clamp_min(1e-30).log()


def _digest(tensor: Tensor) -> bytes | None:
    """What identifies a resent tensor: a hash of its shape, dtype and bytes (None: not a tensor)."""
    if not isinstance(tensor, Tensor):
        return None
    raw = tensor.detach().cpu().contiguous()
    h = hashlib.blake2b(f"{tuple(raw.shape)}{raw.dtype}".encode(), digest_size=16)
    if raw.numel():
        h.update(memoryview(raw.reshape(-1).view(torch.uint8).numpy()))  # read in place, not copied to bytes
    return h.digest()


# ---------------------------------------------------------------------------
# the verifier's state machine


@dataclass
class _Judged:
    """One tensor a track judged, as the stage-wide drift rule remembers it."""

    worker: str
    microbatch: Hashable
    scaled: dict[str, float]  # its distances on the fenced scale
    outside: tuple[str, ...]  # the distances that flagged it (empty: not flagged, or flagged as the sender's own)
    path: dict[int, str]  # who else sent the microbatch forward, per link (not the sender's own stage)
    forgiven: bool = False


@dataclass(frozen=True)
class _First:
    """The first judgement of a sender's tensor of a microbatch over a link, and what it was judged against."""

    digest: bytes
    verdict: Verdict
    given: Tensor | None  # the sketch of the input the verifiers had delivered to the sender's stage (None: none)
    taint: tuple[int, str] | None  # the microbatch's forward flag at the time


class _MeanTrack:
    """EMA of a projected per-feature mean (a stage's input, or the correction it adds to it) and the window of the
    distances of accepted ones to it (linear: on a log scale a Tukey fence of k = 5 lets a mean move 20-50x its
    usual distance, measured on the GPT's stages, where a bias attacker moves it 15-30x)."""

    def __init__(self, window: int) -> None:
        self.ref: Tensor | None = None
        self.window: deque[float] = deque(maxlen=window)

    def distance(self, value: Tensor) -> float:
        return (value - self.ref).norm().item()

    def learn(self, value: Tensor, beta: float) -> None:
        if self.ref is not None:
            self.window.append(self.distance(value))
        self.ref = value if self.ref is None else self.ref * beta + value * (1 - beta)


class _Track:
    """EMA, projections and distance windows of one link and direction."""

    def __init__(self, names: tuple[str, ...], window: int, link: int, direction: str) -> None:
        self.link, self.direction = link, direction
        self.ref: Summary | None = None
        self.proj: Tensor | None = None
        self.accepted = 0
        self.windows = {n: deque(maxlen=window) for n in names}
        self.recent: deque[_Judged] = deque(maxlen=window)  # the last tensors judged, one per (sender, microbatch)
        self.peak: frozenset[str] = frozenset()  # the most senders `recent` ever held: flooding cannot shrink the stage
        self.given = _MeanTrack(window)  # the mean of what the verifiers delivered to the sender's stage
        self.given_spread = _MeanTrack(window)  # the log spread of its centred token sketch
        self.correction = _MeanTrack(window)  # the sender's output mean minus that input mean
        self.gains: deque[float] = deque(maxlen=window)  # log spread of the output's token sketch over its input's
        self.accepted_from: deque[str] = deque(maxlen=window)  # the sender of each of the last accepted tensors
        self.by_sender: dict[str, dict[str, deque[float]]] = {}  # sender -> distance -> its last accepted values
        self.sender_fences: dict[tuple, object] = {}  # (distance, k, accepted, convicted) -> fence (a cache; and the reference)
        self.summaries: dict[str, deque[Summary]] = {}  # sender -> its last accepted summaries (`Sentinel._reference`)
        self.lifetime: dict[str, int] = {}  # sender -> tensors of it accepted so far (`Sentinel._voters_of`)
        self.against_median: bool | None = None  # whether the windows hold distances to the senders' median (`_remeasure`)
        self.kept: deque[Summary] = deque(maxlen=window)  # the summaries of the distances in `windows` (`_remeasure`)


class Sentinel:
    """The statistics of every link a verifier watches, and the strike ledger.

    A runtime verifier calls `check_forward` for each activation a worker sends
    over a link and `check_backward` for each activation gradient, then sends
    on `verdict.passed_on(tensor)`. `link` s is the boundary between stages s
    and s+1: forward tensors on it come from stage s, backward ones from stage
    s+1. `banned()` is the set routing must avoid.
    """

    def __init__(self, config: SentinelConfig | None = None) -> None:
        self.config = config or SentinelConfig()
        self._names = self.config.distance_names
        self._tracks: dict[tuple[int, str], _Track] = {}
        # worker -> [microbatch, flagged, co-suspects, own, (link, direction) of the flags] of its last microbatches
        self._history: dict[str, deque[list]] = {}
        self._paths: dict[Hashable, dict[int, str]] = {}  # microbatch -> forward sender per link
        self._banned: set[str] = set()
        self._convicted: set[str] = set()  # reached the strike rule (banned, or only reported in detect-only mode)
        self._tainted: dict[Hashable, tuple[int, str]] = {}  # microbatch -> (link, worker) of its forward flag
        self._replaced: dict[Hashable, int] = {}  # microbatch -> backward link where a substitute was sent
        self._inputs: dict[Hashable, dict[tuple[int, str], Tensor]] = {}  # microbatch -> (stage, direction) -> sketch
        self._bind_proj: dict[int, Tensor] = {}  # features -> projection of the bind sketches
        self._judged: dict[Hashable, dict[tuple[int, str, str], _First]] = {}  # resends: see `_once`
        self._scales: dict[Hashable, dict[int, float]] = {}  # microbatch -> forward link -> ``scale`` judged there
        self._forwarded: dict[Hashable, set[int]] = {}  # microbatch -> links whose forward tensor of it was judged here
        # microbatch -> the strikes of its gradients judged before their activation over the same link (see `_settle`)
        self._held: dict[Hashable, list[tuple[Verdict, Callable[[], dict]]]] = {}

    def banned(self) -> frozenset[str]:
        return frozenset(self._banned)

    def convicted(self) -> frozenset[str]:
        """Workers that reached the strike rule: the banned ones, or in detect-only mode those that would be."""
        return frozenset(self._convicted)

    def check_forward(self, link: int, worker: str, microbatch: Hashable, tensor: Tensor,
                      upstream: Mapping[int, str] | None = None) -> Verdict:
        """Judge an activation `worker` sends over `link`; it is passed on unchanged either way.

        `upstream` (link -> sender) names who sent the microbatch forward over
        earlier links, for a verifier that did not see those links itself (one
        verifier per boundary); links it saw keep what it saw.
        """
        return self._once(link, FORWARD, worker, microbatch, tensor, upstream, self._judge_forward)

    def _judge_forward(self, link: int, worker: str, microbatch: Hashable, tensor: Tensor, learn: bool) -> Verdict:
        origin = self._tainted.get(microbatch)
        if origin is not None and link > origin[0]:
            return self._check_bound(link, worker, microbatch, tensor)
        verdict = self._check(link, FORWARD, worker, microbatch, tensor, learn=learn)
        if verdict.flagged and origin is None:
            self._tainted[microbatch] = (link, worker)
        return verdict

    def check_backward(self, link: int, worker: str, microbatch: Hashable, tensor: Tensor,
                       upstream: Mapping[int, str] | None = None) -> Verdict:
        """Judge an activation gradient `worker` sends back over `link`; send on `verdict.passed_on(tensor)`.

        Gradients of a microbatch flagged forward at link s are replaced from
        link s - 1 onwards (judged only when they come from the flagged worker
        and it computed them from a gradient that was not replaced).
        Gradients computed from a substitute are passed on but not judged: they
        are honest work on a tensor the verifier itself made. `upstream` as in
        `check_forward`.
        """
        return self._once(link, BACKWARD, worker, microbatch, tensor, upstream, self._judge_backward)

    def _judge_backward(self, link: int, worker: str, microbatch: Hashable, tensor: Tensor, learn: bool) -> Verdict:
        origin = self._tainted.get(microbatch)
        replaced = self._replaced.get(microbatch)
        # the gradient a worker computed from a substitute follows the momentum (a per-feature mean: about 18x
        # smaller here), not honest traffic, so the link's statistics say nothing about it (measured: each false
        # forward flag of an honest relay drew a second one on its gradient, `scale` at log -2.6..-3.2)
        from_substitute = replaced is not None and link < replaced
        if origin is not None and link >= origin[0] - 1:
            if link == origin[0] - 1 and worker == origin[1] and not from_substitute:
                verdict = self._check(link, BACKWARD, worker, microbatch, tensor, learn=False, alone=True)
            else:
                verdict = Verdict(link, BACKWARD, worker, microbatch, False, "tainted")
        elif replaced is not None and link < replaced:
            verdict = Verdict(link, BACKWARD, worker, microbatch, False, "tainted")
        else:
            # a gradient whose activation this verifier has not judged yet (off the path, the copies race: the
            # hivemind secure-pipeline test, a stage's gradient of the zeros attacker's activation arrived first, at
            # ``scale`` +4.1, and dragged the EMA so that every honest gradient after it sat at -2.8 and an honest
            # relay was banned), or of a microbatch forgotten since (dropped at a ban), is judged but not learned.
            # Its strikes wait for that activation's verdict (`_settle`): flagged there (the launch, session 24: the
            # zeros attacker's activations, and the honest next stage's gradients of them judged first, `swd` alone,
            # banned that honest relay), the taint explains the gradient, as if it had come after it.
            forwarded = link in self._forwarded.get(microbatch, ()) or (link, FORWARD) not in self._tracks
            verdict = self._check(link, BACKWARD, worker, microbatch, tensor, learn=learn and forwarded,
                                  held=not forwarded)
        if link == 0:
            self.forget(microbatch)
        if not (verdict.flagged or verdict.reason == "banned" or origin is not None and link >= origin[0] - 1):
            return verdict
        if link > 0:
            self._replaced[microbatch] = link
        reason = "tainted" if verdict.reason in ("ok", "warmup") else verdict.reason
        return dataclasses.replace(verdict, reason=reason, substitute=self.momentum(link, tensor))

    def reject(self, link: int, direction: str, worker: str, microbatch: Hashable, reason: str, like: Tensor,
               taint: bool = True) -> Verdict:
        """Flag a tensor whose sender broke the protocol around it (a forged or missing hop signature), held
        against the sender alone, with the usual response: forward, the microbatch is tainted (not `taint`: the
        caller does it with `mark_tainted` once it knows the tensor reached the microbatch's path); backward, the
        gradient momentum is sent instead."""
        if worker in self._banned:
            return Verdict(link, direction, worker, microbatch, True, "banned")
        verdict = self._strike(Verdict(link, direction, worker, microbatch, True, reason), blame_upstream=False)
        if direction == FORWARD and not taint:
            return verdict
        if direction == FORWARD:
            self._tainted.setdefault(microbatch, (link, worker))
            return self._settled(verdict)
        if link > 0:
            self._replaced[microbatch] = link
        return dataclasses.replace(verdict, substitute=self.momentum(link, like))

    def forget(self, microbatch: Hashable) -> None:
        """Drop what is remembered of a microbatch (done at its link-0 backward check; call it
        when a microbatch's backward will not come: crash, reroute)."""
        self._tainted.pop(microbatch, None)
        self._replaced.pop(microbatch, None)
        self._paths.pop(microbatch, None)
        self._inputs.pop(microbatch, None)
        self._judged.pop(microbatch, None)
        self._scales.pop(microbatch, None)
        self._forwarded.pop(microbatch, None)
        self._held.pop(microbatch, None)

    @property
    def binds(self) -> bool:
        """Whether ``bind`` or ``align`` is used (then verifiers record what they deliver to each stage)."""
        return any(n in self._names for n in BOUND)

    def sketch(self, tensor: Tensor) -> Tensor:
        """The bind sketch of a tensor (directions seeded by the run and the feature count, shared by every link),
        then the tensor's full per-feature mean (C floats, zero-padded to ceil(C / bind_projections) rows; for the
        stage's correction, `_adds_its_own_mean`: on the bind directions alone a bias in their null space, half the
        features on the GPT, would not move it; review RC, session 21) and a last row that holds C. `_split` takes
        it apart."""
        features = tensor.shape[-1]
        proj = self._projection(features)
        width = proj.shape[1]
        rows = -(-features // width)
        mean = torch.zeros(rows * width + width)
        mean[:features] = tensor.detach().float().reshape(-1, features).mean(dim=0)
        mean[rows * width] = features
        return torch.cat([bind_sketch(tensor, proj), mean.reshape(rows + 1, width)])

    def _projection(self, features: int) -> Tensor:
        if features not in self._bind_proj:
            self._bind_proj[features] = projections(self.config.seed, -1, "bind", features, self.config.bind_projections)
        return self._bind_proj[features]

    def record_input(self, microbatch: Hashable, stage: int, direction: str, sketch: Tensor) -> None:
        """What was delivered to `stage` for `microbatch` in `direction` (its forward input, or the gradient of
        its output); the stage's own output in that direction is then bound to it. A boundary verifier
        records what it delivers and passes the sketch to the verifier of the stage's outgoing link. A sketch not
        laid out as `sketch` lays it out is not kept."""
        if _split(sketch) is not None:
            self._inputs.setdefault(microbatch, {})[(stage, direction)] = sketch

    def mark_tainted(self, microbatch: Hashable, link: int, worker: str) -> None:
        """Another verifier flagged `worker`'s activation of `microbatch` on `link` (as `check_forward` would here)."""
        self._tainted.setdefault(microbatch, (link, worker))
        self._settle(microbatch)  # drops the held gradient strikes the taint explains (strikes nobody)

    def mark_replaced(self, microbatch: Hashable, link: int) -> None:
        """Another verifier sent the momentum instead of `microbatch`'s gradient on `link`."""
        if link > 0:
            self._replaced[microbatch] = max(link, self._replaced.get(microbatch, link))

    def taint_of(self, microbatch: Hashable) -> tuple[int, str] | None:
        """(link, worker) of the forward flag that tainted a microbatch, if any."""
        return self._tainted.get(microbatch)

    def ban(self, worker: str) -> None:
        """Ban `worker` on another verifier's word (its traffic is refused from now on)."""
        if worker not in self._banned:
            self._convict(worker)
            self._banned.add(worker)

    def momentum(self, link: int, like: Tensor, direction: str = BACKWARD) -> Tensor:
        """The momentum of a link and direction (default: the gradient momentum), broadcast to `like`'s
        shape (zeros before any EMA)."""
        track = self._tracks.get((link, direction))
        if track is None or track.ref is None or track.ref.mean.shape[0] != like.shape[-1]:
            return torch.zeros_like(like)
        return track.ref.mean.to(like.dtype).expand(like.shape).clone()

    def reference(self, link: int, direction: str) -> Summary | None:
        """The EMA of a link and direction (None before the first tensor)."""
        track = self._tracks.get((link, direction))
        return None if track is None else track.ref

    def fences(self, link: int, direction: str) -> dict[str, Fence] | None:
        """Current fences per distance (on the fenced scale: log for l1/l2/swd), None while warming up."""
        track = self._tracks.get((link, direction))
        if track is None or track.accepted < self.config.warmup:
            return None
        self._settled_reference(track)  # the windows on the reference in force before any fence is taken
        return {n: self._fence(track, n) for n in self._names if len(track.windows[n]) >= 4}

    def probe(self, link: int, direction: str, tensor: Tensor, microbatch: Hashable = None) -> tuple[str, ...] | None:
        """The distances a tensor would have outside the fences, without any state change.

        None while warming up (anything passes). With `microbatch`, ``bind`` is
        measured against that microbatch's recorded input. This is the white-box
        view an adaptive attacker is granted in experiments; the verifier never needs it.
        """
        track = self._tracks.get((link, direction))
        fences = self.fences(link, direction)
        if fences is None or track is None or not self._well_formed(track, tensor):
            return None if fences is None else tuple(self._names)
        summary = summarize(tensor, track.proj, self.config.quantiles)
        dist = self._distances(track, link, direction, microbatch, tensor, summary)
        shrinks = self.config.gain and self._shrinks(track, dist, self._means(link, direction, microbatch, tensor))
        return self._outside(track, dist) + (("gain",) if shrinks else ())

    def would_accept(self, link: int, direction: str, tensor: Tensor, microbatch: Hashable = None) -> bool:
        """Whether `tensor` would pass the vote right now (no state change; True while warming up)."""
        track = self._tracks.get((link, direction))
        if self.fences(link, direction) is None or track is None:
            return True
        if not self._well_formed(track, tensor):
            return False
        summary = summarize(tensor, track.proj, self.config.quantiles)
        dist = self._distances(track, link, direction, microbatch, tensor, summary)
        if self.config.gain and self._shrinks(track, dist, self._means(link, direction, microbatch, tensor)):
            return False
        return not vote(len(self._outside(track, dist)), self._voters(track, dist), self.config.vote)

    # -- internals ---------------------------------------------------------

    def _once(self, link: int, direction: str, worker: str, microbatch: Hashable, tensor: Tensor,
              upstream: Mapping[int, str] | None, judge) -> Verdict:
        """Judge a tensor once: a sender that sends the same tensor of the same microbatch over the same link
        again (a delivery retried after the receiver refused or left) gets the first verdict back; nothing is
        learned or struck twice. Measured (issue 18's churn run, seed 1): stage 2 stalled and every stage-1
        relay resent its outputs up to 24 times, so the link's 200 warm-up tensors were a dozen microbatches of
        one model version, the fences that narrow, and the first step after it flagged every replica of the
        stage (all four convicted).

        A resend is never learned nor remembered by the drift rule again (one entry per sender and microbatch:
        resends cannot flood it). A *different* tensor of the same microbatch from the same sender while the
        input the verifiers delivered to its stage is the same is equivocation (an honest stage computes one
        output per input): flagged against the sender alone (reason "equivocation"), so a sender cannot probe
        the fences with variants of one microbatch. Where the input is unknown (link 0 forward, no ``bind``)
        or changed (its upstream resent another input), and where the same tensor comes back after the
        microbatch was tainted or its input recorded, it is judged again against the current state, but
        neither learned nor remembered."""
        self._learn_path(microbatch, upstream)
        if direction == FORWARD:
            self._forwarded.setdefault(microbatch, set()).add(link)
        digest = _digest(tensor)
        key = (link, direction, worker)
        given = self._given(link, direction, microbatch)
        earlier = self._judged.get(microbatch, {}).get(key)
        if digest is None or earlier is None or worker in self._banned:
            verdict = judge(link, worker, microbatch, tensor, True)
        elif (earlier.digest == digest and earlier.taint == self._tainted.get(microbatch)
              and _same(earlier.given, given)):
            return dataclasses.replace(earlier.verdict, bans=(), convicted=())
        elif earlier.digest != digest and earlier.given is not None and _same(earlier.given, given):
            return self.reject(link, direction, worker, microbatch, "equivocation", tensor)
        else:
            verdict = judge(link, worker, microbatch, tensor, False)
            return self._settled(verdict) if direction == FORWARD else verdict
        if direction == FORWARD:
            verdict = self._settled(verdict)
        if digest is not None and not (direction == BACKWARD and link == 0):  # link 0's backward ends the microbatch
            self._judged.setdefault(microbatch, {})[key] = _First(digest, verdict, given, self._tainted.get(microbatch))
            while len(self._judged) > self.config.remembered:  # microbatches whose link-0 backward never came
                del self._judged[next(iter(self._judged))]
        return verdict

    def _given(self, link: int, direction: str, microbatch: Hashable) -> Tensor | None:
        """The sketch of what the verifiers delivered to the stage that sends over `link` in `direction`."""
        stage = link if direction == FORWARD else link + 1
        return self._inputs.get(microbatch, {}).get((stage, direction))

    def _learn_path(self, microbatch: Hashable, upstream: Mapping[int, str] | None) -> None:
        if upstream:
            path = self._paths.setdefault(microbatch, {})
            for link, worker in upstream.items():
                path.setdefault(link, worker)

    def _check(self, link: int, direction: str, worker: str, microbatch: Hashable, tensor: Tensor,
               learn: bool, alone: bool = False, held: bool = False) -> Verdict:
        """Judge a tensor on the link's fences. `learn`: it may update the baseline and is remembered by the
        drift rule (not for resends); `alone`: a flag is held against the sender only (its own forward flag
        explains it); `held`: its strikes wait for the microbatch's activation over the link (`_settle`)."""
        if worker in self._banned:
            return Verdict(link, direction, worker, microbatch, True, "banned")
        track = self._tracks.setdefault((link, direction), _Track(self._names, self.config.window, link, direction))
        if not self._well_formed(track, tensor):
            return self._count(Verdict(link, direction, worker, microbatch, True, "malformed"), held, dict)
        if track.proj is None:
            track.proj = projections(self.config.seed, link, direction, tensor.shape[-1], self.config.projections)
        summary = summarize(tensor, track.proj, self.config.quantiles)
        if track.ref is None:
            if learn:
                track.ref, track.accepted = summary, 1
            return Verdict(link, direction, worker, microbatch, False, "warmup")
        dist = self._distances(track, link, direction, microbatch, tensor, summary)
        means = self._means(link, direction, microbatch, tensor)
        named = tuple(dist.items())
        if track.accepted < self.config.warmup:
            if learn:
                self._accept(track, direction, worker, summary, dist, means)
                self._remember(track, link, direction, worker, microbatch, dist, ())
            return Verdict(link, direction, worker, microbatch, False, "warmup", named)
        outside = self._outside(track, dist) + (("gain",) if self._shrinks(track, dist, means) else ())
        # the gain is not one of the voting distances: below its fence it flags on its own
        flagged = "gain" in outside or vote(len(outside), self._voters(track, dist), self.config.vote)
        own = flagged and (self._disowns_input(track, dist)
                           or self._shrunk_to_nothing(track, link, direction, microbatch, tensor))
        # the sender's alone too, but remembered as long as any flag, and still a flag a move of the stage explains
        adds_own_mean = flagged and not own and self._adds_its_own_mean(track, link, direction, microbatch, dist, means)
        if learn:
            flags = outside if flagged and not own else ()
            judged = self._remember(track, link, direction, worker, microbatch, dist, flags)
            stage = self._stage_drift(track, judged) if judged.outside else None
            if stage is not None:
                # the stage moved, not this sender: relearn (only what lies near the stage's median, with `learn_k`),
                # and the flags of the move are no evidence
                if self._inner_stage(stage, judged):
                    self._accept(track, direction, worker, summary, dist, means)
                return self._strike(Verdict(link, direction, worker, microbatch, False, "drift", named, outside))
        if learn and direction == FORWARD and "scale" in dist:
            self._scales.setdefault(microbatch, {})[link] = dist["scale"]
        corrected = not flagged and self._large_correction(track, dist)
        if learn and not flagged and not corrected and self._inner(track, dist):
            self._accept(track, direction, worker, summary, dist, means)
        verdict = Verdict(link, direction, worker, microbatch, flagged, "fence" if flagged else "ok", named, outside)

        def blame() -> dict:
            """`_strike`'s arguments, decided when the strike is counted: a held gradient's once the activation over
            its link is judged, whose ``scale`` `shrunk` and `_grown_by_shrunk_input` read (review RS s25 1: decided
            before it, the honest head's gradients grown by inputs accepted shrunk were struck against the head)."""
            # the sender's forward input crossed link - 1 (its output gradient's forward input, link itself)
            shrunk = self._scales.get(microbatch, {}).get(link - 1 if direction == FORWARD else link, 0.0) < SHRUNK_INPUT
            grown = flagged and not own and not alone and self._grown_by_shrunk_input(track, link, direction,
                                                                                   microbatch, dist, outside)
            large = (flagged and not own and not adds_own_mean and not grown
                     and self._large_as_its_input(track, dist, outside, means))
            # forward, the outlier input is what the upstream senders delivered, which they may have made (within
            # their own fences): held against them alone; backward, against nobody (see `_large_as_its_input`)
            made_upstream = large and direction == FORWARD and not alone
            return dict(blame_upstream=not alone, own=own or adds_own_mean, lasting=own,
                        upstream_only=not alone and (corrected or grown or made_upstream),
                        shrunk_input=(corrected and shrunk) or grown or made_upstream,
                        explained=large and not made_upstream)

        return self._count(verdict, held, blame)

    def _count(self, verdict: Verdict, held: bool, blame: Callable[[], dict]) -> Verdict:
        """Strike now (`blame()`: `_strike`'s arguments), or, `held`, once the microbatch's activation over the
        verdict's link is judged (`_settle`)."""
        if not held:
            return self._strike(verdict, **blame())
        self._held.setdefault(verdict.microbatch, []).append((verdict, blame))
        while len(self._held) > self.config.remembered:  # activations that never came: their gradients strike nobody
            del self._held[next(iter(self._held))]
        return verdict

    def _settled(self, verdict: Verdict) -> Verdict:
        """`verdict` (on an activation, or a taint) with the held gradient strikes it settles, and their bans."""
        struck = self._settle(verdict.microbatch)
        if not struck:
            return verdict
        bans = verdict.bans + tuple(w for v in struck for w in v.bans)
        convicted = verdict.convicted + tuple(w for v in struck for w in v.convicted)
        return dataclasses.replace(verdict, bans=tuple(dict.fromkeys(bans)), convicted=tuple(dict.fromkeys(convicted)),
                                   settled=struck)

    def _settle(self, microbatch: Hashable) -> tuple[Verdict, ...]:
        """The held strikes of a microbatch's gradients (judged before its activation over their link): dropped
        where its forward taint explains the gradient (as `_judge_backward` does with a gradient that comes after
        the taint), struck once that activation is judged (against its sender and those upstream, known by now),
        else still held. The gradients' verdicts as struck (suspects, bans)."""
        struck: list[Verdict] = []
        waiting = []
        for verdict, blame in self._held.pop(microbatch, ()):
            origin, replaced = self._tainted.get(microbatch), self._replaced.get(microbatch)
            if replaced is not None and verdict.link < replaced:
                continue  # computed from a substitute (review RS s25 1, LOW)
            alone = False
            if origin is not None and verdict.link >= origin[0] - 1:
                if verdict.link != origin[0] - 1 or verdict.worker != origin[1]:
                    continue
                alone = True  # its sender's own forward flag: held against it alone
            if verdict.link not in self._forwarded.get(microbatch, ()):
                waiting.append((verdict, blame))
                continue
            struck.append(self._strike(verdict, **{**blame(), **({"blame_upstream": False} if alone else {})}))
        if waiting:
            self._held[microbatch] = waiting
        return tuple(struck)

    def _remember(self, track: _Track, link: int, direction: str, worker: str, microbatch: Hashable,
                  dist: dict[str, float], outside: tuple[str, ...]) -> _Judged:
        own_link = link if direction == FORWARD else link + 1  # where the sender's stage sent it forward
        path = {l: w for l, w in self._paths.get(microbatch, {}).items() if l != own_link and w != worker}
        judged = _Judged(worker, microbatch, {n: _scaled(n, v, self.config) for n, v in dist.items()}, outside, path)
        for old in [j for j in track.recent if j.worker == worker and j.microbatch == microbatch]:
            track.recent.remove(old)
        track.recent.append(judged)
        return judged

    def _stage_drift(self, track: _Track, judged: _Judged) -> dict[str, Fence] | None:
        """Whether a flagged tensor is part of a move of its whole stage (a change of the model), not a lie: the
        stage's median fences it moves with, or None.

        Honest majority per stage: more than half of a stage's replicas are honest and share its parameters,
        so their outputs move together when the model (or the link's reference) moves, and a minority of liars
        cannot make most of them look odd. Three conditions, on each other live sender's latest tensor among
        this track's last `window` judged tensors (one entry per sender and microbatch; the judged sender's own
        tensors never count for itself):
        (1) the latest tensors of at least half of the stage's live senders other than this one are fence-flagged
        (not the sender's own), at least two. The stage size is the larger of the senders in the window and the
        most it ever held (flooding cannot shrink it; departures and fresh identities only make the rule
        stricter). With f < n/2 liars, f - 1 of them among the others, this needs at least two honest replicas
        whose latest tensor is flagged (one background false flag is not enough), and on an even stage it holds
        when every honest replica moves, whatever the liars send; on an odd stage the liars can withhold it (the
        strike rule then applies, as without this rule). A stage of 2 live senders never drifts (one other
        sender: no fence in (3)); in a stage of 3, both others' latest tensors must be flagged.
        (2) on every other link of the flagged microbatches' paths, the upstream senders that carried flagged
        microbatches of at least max(2, half the stage) distinct flagged senders are more than half of that
        link's senders, at least two: flags confined to the microbatches of a minority upstream are evidence
        about that minority (the strike rule handles them), and one liar in the stage cannot spread its own
        flags over honest upstream senders to fake a spread.
        (3) the tensor's outside distances lie inside median fences (breakdown 50%; k, the usual IQR floors) around
        the latest tensors of the other live senders (at least 2): it moves with the majority of its stage, so a
        liar sending something else during a move is still flagged. Measured: 25% seed 2 `adaptive`, the link-1
        verifier flagged all four stage-1 relays on `sign` within iteration 41 (3 honest) and banned them all."""
        latest = {j.worker: j for j in track.recent if j.worker not in self._convicted}  # latest tensor per sender
        if len(latest) > len(track.peak - self._convicted):
            track.peak = frozenset(latest)
        size = max(len(latest), len(track.peak - self._convicted))
        others = [j for w, j in latest.items() if w != judged.worker]
        moved = {j.worker for j in others if j.outside}
        if len(moved) < 2 or 2 * len(moved) < size:
            return None
        spread = max(2, (size + 1) // 2)
        for link in {link for j in track.recent for link in j.path}:
            senders = {j.path[link] for j in track.recent if link in j.path} - self._convicted
            carried: dict[str, set[str]] = {}
            for j in track.recent:
                if link in j.path and j.outside and j.worker not in self._convicted:
                    carried.setdefault(j.path[link], set()).add(j.worker)
            hit = {w for w, movers in carried.items() if len(movers) >= spread} - self._convicted
            if len(senders) >= 2 and (len(hit) < 2 or 2 * len(hit) <= len(senders)):
                return None
        stage = self._stage_fences(others, self.config.k, track)
        if not self._moves_with(stage, judged):
            return None
        self._forgive(track, stage)
        return stage

    def _stage_fences(self, latest: list[_Judged], k: float, track: _Track) -> dict[str, Fence]:
        """Median fences (multiplier `k`, the usual IQR floors) around the given latest tensors, per distance."""
        fences = {}
        for name in self._names:
            values = [j.scaled[name] for j in latest if name in j.scaled]
            if len(values) >= 2:
                fences[name] = median_fence(values, k, self._floor(track, name))
        return fences

    @staticmethod
    def _moves_with(stage: dict[str, Fence], judged: _Judged) -> bool:
        return all(n in stage and stage[n].contains(judged.scaled[n]) for n in judged.outside)

    def _inner_stage(self, stage: dict[str, Fence], judged: _Judged) -> bool:
        """Whether a drift tensor may update the baseline: with `learn_k`, only when its outside distances lie
        within the stage's median fences narrowed to `learn_k` (as `_inner` on the link's fences)."""
        if self.config.learn_k <= 0:
            return True
        scale = (self.config.learn_k + 0.5) / (self.config.k + 0.5)
        for name in judged.outside:
            fence = stage[name]
            mid, half = (fence.low + fence.high) / 2, (fence.high - fence.low) / 2 * scale
            if not mid - half <= judged.scaled[name] <= mid + half:
                return False
        return True

    def _forgive(self, track: _Track, stage: dict[str, Fence]) -> None:
        """The strikes this track's flags of the move gave (to their senders and the workers upstream) are
        taken back: the flags that moved with the stage, not those of a sender that stood out. Only this
        track's share of a strike goes: a flag on the same microbatch from another link or direction (one
        verifier sees every link under `data_node` placement) keeps it."""
        source = (track.link, track.direction)
        for judged in track.recent:
            if not judged.outside or judged.forgiven or not self._moves_with(stage, judged):
                continue
            judged.forgiven = True
            for worker, history in self._history.items():
                for entry in history:
                    if entry[0] == judged.microbatch and not entry[3] and (
                            worker == judged.worker or judged.worker in entry[2]):
                        entry[4].discard(source)
                        if not entry[4]:
                            entry[1], entry[2] = False, set()

    def _check_bound(self, link: int, worker: str, microbatch: Hashable, tensor: Tensor) -> Verdict:
        """An activation of a microbatch tainted upstream: the stage computed on a tampered input, so the
        link's statistics say nothing about its sender, but ``bind`` still does (it compares the stage's
        output with the input this microbatch actually delivered to it). Judged on ``bind`` alone, never
        learned, only above its upper fence (and `tainted_bind_floor`), a flag held against the sender alone;
        otherwise passed as "tainted". Without this, a second
        attacker on a microbatch the first one tainted is never judged. No "shrunk to nothing" rule here: the
        input is tampered by definition, and a crafted input can make an honest stage answer a constant (the
        head: LayerNorm ignores scale, so tokens a[b,t] * v give identical logits; review of session 20)."""
        tainted = Verdict(link, FORWARD, worker, microbatch, False, "tainted")
        track = self._tracks.get((link, FORWARD))
        if ("bind" not in self._names or track is None or track.ref is None or track.accepted < self.config.warmup
                or worker in self._banned or not self._well_formed(track, tensor)):
            return tainted
        inp = self._inputs.get(microbatch, {}).get((link, FORWARD))
        inp = None if inp is None else _tokens(inp)
        out = _tokens(self.sketch(tensor))
        # an output with (almost) no token structure left binds to nothing: on a tampered input that says nothing
        # against the stage (the head fed tokens that differ only in scale answers one logit vector, and the CKA of
        # its rounding noise with the input is near 0)
        bound = None if inp is None or _spread_ratio(inp, out) <= SHRUNK_RATIO else binding(inp, out)
        if bound is None:
            return tainted
        dist = {"bind": bound}
        # only "unrelated to its input" counts here: a stage fed a replayed or made-up input may well bind to
        # it more tightly than usual (below the lower fence), which says nothing against the stage, or more
        # loosely (the honest head fed random noise: 0.90-0.92), so the floor is higher than `bind_floor`
        outside = tuple(n for n in self._outside(track, dist)
                        if bound > max(self._fence(track, n).high, self.config.tainted_bind_floor))
        if not outside:
            return dataclasses.replace(tainted, distances=tuple(dist.items()))
        verdict = Verdict(link, FORWARD, worker, microbatch, True, "fence", tuple(dist.items()), outside)
        return self._strike(verdict, blame_upstream=False)

    def _well_formed(self, track: _Track, tensor: Tensor) -> bool:
        if not isinstance(tensor, Tensor) or tensor.dim() < 1 or tensor.numel() == 0 or not tensor.is_floating_point():
            return False
        if track.ref is not None and tensor.shape[-1] != track.ref.mean.shape[0]:
            return False
        return bool(torch.isfinite(tensor).all())

    def _accept(self, track: _Track, direction: str, worker: str, summary: Summary, dist: dict[str, float],
                means: tuple[Tensor, Tensor] | None = None) -> None:
        beta = self.config.beta_h if direction == FORWARD else self.config.beta_g
        track.ref = ema(track.ref, summary, beta)
        track.accepted += 1
        own = track.by_sender.setdefault(worker, {})
        track.summaries.setdefault(worker, deque(maxlen=self.config.sender_window)).append(summary)
        track.kept.append(summary)
        for name, value in dist.items():
            track.windows[name].append(_scaled(name, value, self.config))
            own.setdefault(name, deque(maxlen=self.config.sender_window)).append(_scaled(name, value, self.config))
        track.accepted_from.append(worker)
        track.lifetime[worker] = track.lifetime.get(worker, 0) + 1
        if len(track.by_sender) > len(track.accepted_from):  # senders gone from the window are forgotten
            live = set(track.accepted_from)
            for gone in [w for w in track.by_sender if w not in live]:
                del track.by_sender[gone]
                track.summaries.pop(gone, None)
                track.lifetime.pop(gone, None)
        if means is not None:
            track.given.learn(means[0], beta)
            track.given_spread.learn(means[2], beta)
            track.correction.learn(means[1], beta)
            track.gains.append(means[3])

    def _settled_reference(self, track: _Track) -> Summary:
        """`_reference`, with the windows measured again (`_remeasure`) when it changed kind since they were filled;
        called before any fence of the track is taken (`_distances`, `fences`), so that a probe does not cache
        fences of windows against the other reference (review RC, session 23, LOW 4)."""
        reference = self._reference(track)
        if track.against_median is not None and (reference is not track.ref) != track.against_median:
            self._remeasure(track, reference)
            for key in [key for key in track.sender_fences if key[0] != "reference"]:
                del track.sender_fences[key]
        track.against_median = reference is not track.ref
        return reference

    def _remeasure(self, track: _Track, reference: Summary) -> None:
        """The reference changed kind (the senders' median took over from the EMA, or back): the windows of the
        distances taken against it, pooled and per sender, are measured again from the summaries they came from,
        against the new one. Values against two references are not one sample: at the session-22 merge the windows,
        filled against the lagging EMA, put the fences where no honest tensor measured against the median lay (an
        honest relay banned), and back on the EMA, windows of distances to the median (honest replicas of one model
        version nearly coincide) fence out every honest tensor. Emptying them instead left the pooled fence in charge
        until each sender had refilled, long enough for the white-box shrink to reach c 0.22 (toy stage).
        ``bind`` and ``align`` do not depend on the reference."""
        names = tuple(n for n in self._names if n not in BOUND)
        for name in names:
            values = [_scaled(name, distances(s, reference, (name,))[name], self.config) for s in track.kept]
            track.windows[name] = deque(values[-len(track.windows[name]):] if track.windows[name] else (),
                                        maxlen=self.config.window)
        for worker, own in track.by_sender.items():
            kept = list(track.summaries.get(worker, ()))
            for name in names:
                if name in own:
                    values = [_scaled(name, distances(s, reference, (name,))[name], self.config) for s in kept]
                    own[name] = deque(values[-len(own[name]):], maxlen=self.config.sender_window)

    def _means(self, link: int, direction: str, microbatch: Hashable,
               tensor: Tensor) -> tuple[Tensor, Tensor, Tensor, float] | None:
        """(the full per-feature mean of what the verifiers delivered to the sender's stage for this microbatch,
        the sender's output mean minus it, the log spread of that input's centred token sketch, and the log gain:
        the output's spread minus it); None without a recorded input, or where the stage changes the feature
        count (the head: its output mean and its input mean are not in one space)."""
        given = self._given(link, direction, microbatch) if self.binds else None
        if given is None:
            return None
        (tokens, mean), (out_tokens, out_mean) = _split(given), _split(self.sketch(tensor))
        if tokens.shape[0] < 2 or out_tokens.shape != tokens.shape or out_mean.shape != mean.shape:
            return None
        spread = _log_spread(tokens)
        gain = (_log_spread(out_tokens) - spread).item()
        return mean, out_mean - mean, spread.reshape(1), gain

    def _adds_its_own_mean(self, track: _Track, link: int, direction: str, microbatch: Hashable,
                           dist: dict[str, float], means: tuple[Tensor, Tensor, Tensor, float] | None) -> bool:
        """Whether a flagged activation's stage added a mean of its own to a usual input: the correction (output
        mean minus the mean of what the verifiers delivered to the stage, on every feature) lies above its fence
        while that input's mean and spread lie inside their own, on a link whose output follows its input
        (residual stages).

        A pre-norm residual stage answers x + f(LayerNorm(x)): a shift of every feature of its input by one
        constant passes through unchanged and leaves its correction f exactly as it was, so an honest stage fed
        a biased input is not odd here (its flag stays shared with the upstream workers), while a sender that
        adds a bias is. Measured: 37.5% seed 1 `bias`, the honest stage-1 relay that fed two stage-2 attackers
        took a share of each one's biased outputs (`sign, swd`) and was banned at its third, before either.
        Such a flag is held against the sender alone (`strikes` in `strike_window`; not the longer
        `own_window`, since an input this stage rarely gets can also move its correction).

        Decided from the input alone (review RC, session 21): the sender controls its output's ``align`` and
        ``bind``, so a guard on them let a biased liar opt out with noise that took ``align`` just under its
        fence; an input seen shrunk at link - 1 (the honest reason for a large correction) turns the rule off.
        Activations only: "a pre-norm stage ignores a shift of its input" is about activations, and a backward
        flag's shares belong to the forward upstream, whose input this gate does not see."""
        if direction != FORWARD or means is None or len(track.correction.window) < 4:
            return False
        if len(track.windows.get("align", ())) < 4 or self._fence(track, "align").low < OWN_ALIGN_BASELINE:
            return False
        if self._scales.get(microbatch, {}).get(link - 1, 0.0) < SHRUNK_INPUT:
            return False
        # a usual input: its mean and its spread inside Tukey's inner fences (k = 1.5) of the inputs the stage got
        usual_input = all(part.distance(value) <= tukey_fence(list(part.window), 1.5).high
                          for part, value in ((track.given, means[0]), (track.given_spread, means[2])))
        odd = (track.correction.distance(means[1]) > tukey_fence(list(track.correction.window), self.config.k).high
               or self._shrinks(track, dist, means))
        return usual_input and odd

    def _shrinks(self, track: _Track, dist: dict[str, float], means: tuple[Tensor, Tensor, Tensor, float] | None) -> bool:
        """Whether the sender's output is smaller against its own input than the stage's outputs are: its log gain
        (the spread of its centred token sketch over that of what the verifiers delivered to its stage) lies below
        the median fence of the gains of the link's accepted tensors, on a link whose output follows its input.

        `scale` compares a tensor with the link's EMA, which learns the accepted tensors: at 37.5% the white-box
        attackers' shrunk tensors (and the honest ones a residual stage carries on from them) drag it down, so the
        accepted shrink grows with the run (session 19: c = 0.11 by iteration 37). The gain is anchored on the
        input the verifiers delivered, which relays cannot feed: an honest residual stage fed c x passes a gain
        at least its usual one (its correction is not shrunk), so only the attackers' own values sit at the low
        edge, and against fewer than half of the window a median fence stays bounded (`median_fence`).

        Off by default (`SentinelConfig.gain`), measured (37.5%, seed 0, white-box `adaptive`, docs/notes/issue-16.md,
        session 21): it holds the accepted shrink (toy stage: c >= 0.64 for 184 microbatches, 0.107 without), and
        the 40-iteration gap falls from +1.84% to +0.75%, but over 120 iterations that run collapsed at iteration
        62 (a move of the head's gradients shared upstream: five honest relays banned, +19.6%; without it +4.31%,
        two honest relays banned)."""
        if not self.config.gain or means is None or len(track.gains) < 4 or "align" not in dist or len(
                track.windows["align"]) < 4:
            return False
        if self._fence(track, "align").low < OWN_ALIGN_BASELINE:
            return False
        return means[3] < median_fence(list(track.gains), self.config.k, self.config.min_spread).low

    def _distances(self, track: _Track, link: int, direction: str, microbatch: Hashable, tensor: Tensor,
                   summary: Summary) -> dict[str, float]:
        dist = distances(summary, self._settled_reference(track), self._names)
        if self.binds:
            stage = link if direction == FORWARD else link + 1
            inp = self._inputs.get(microbatch, {}).get((stage, direction))
            if inp is not None:
                inp, out = _tokens(inp), _tokens(self.sketch(tensor))
                for name, measure in (("bind", binding), ("align", align)):
                    value = measure(inp, out) if name in self._names else None
                    if value is not None:
                        dist[name] = value
        return dist

    def _reference(self, track: _Track) -> Summary:
        """What a tensor's distances are taken against. With `fence="senders"` (at least 3 live senders): the
        coordinate-wise median across the live senders of each one's mean of its last 2 accepted summaries; else
        the link's EMA. The EMA learns every accepted tensor, so liars that ride a fence drag it, each honest tensor
        then lies further from it, the fences (made of honest distances) widen and the liars go further: against
        the EMA the white-box shrink fell to c 0.28-0.5 with 45% of the traffic (toy stage), and a mean-shift rider
        (review RC, session 22) grew its accepted shift 7-fold and reached +5.8% in 15 iterations of the simulator.
        A minority of the live senders cannot move a median across senders, whatever share of the traffic it
        carries. The EMA stays the momentum (the substitute of a flagged gradient)."""
        if self.config.fence != "senders":
            return track.ref
        key = ("reference", track.accepted, len(self._convicted))
        if key not in track.sender_fences:
            voters = self._voters_of(track)
            latest = [list(track.summaries[w])[-2:] for w in voters]  # each sender's last 2
            if len(latest) < SENDERS:
                track.sender_fences[key] = None
            else:
                weights = [voters[w] for w in voters]
                means = torch.stack([sum(s.mean for s in own) / len(own) for own in latest])
                quantiles = torch.stack([sum(s.quantiles for s in own) / len(own) for own in latest])
                track.sender_fences[key] = Summary(_weighted_median_rows(means, weights),
                                                   _weighted_median_rows(quantiles, weights))
        return track.sender_fences[key] if track.sender_fences[key] is not None else track.ref

    def _voters_of(self, track: _Track) -> dict[str, float]:
        """The senders that vote in the per-sender fences and the reference, with their weights: live (among the
        window's last accepted tensors), not convicted, and (`sender_vote="identity"`) with at least `sender_window`
        accepted tensors over their lifetime, weight 1; or (`"weighted"`) any, weighing min(its tensors among the
        window's last accepted ones, `sender_window`) / `sender_window`.

        One vote per identity is only sound while identities cost something: liars that took a fresh identity for
        every lie held most of the votes and framed every honest sender (review RC, session 22, finding 0: all five
        honest senders banned on the toy stage, with votes from the first value, and with 4 values at window 64).
        With a lifetime of `sender_window` tensors before it votes, a liar cycling identities holds at most its
        tensors in the window / `sender_window` votes, no more than without cycling (3 at 37.5% of a 64-tensor
        window). The price: an honest relay that takes a fresh identity more often than every `sender_window`
        accepted tensors does not vote (review RC MED 2: with 2 of 5 honest relays doing so every 3 tensors the liars
        held half of the votes); the vote rests on identities that last, which the pipeline's admission of joiners
        (`data_node`) does not enforce.

        The weighted vote (review RC, session 22) counts what a sender carries now instead: identities then cost
        nothing and buy nothing. Liars hold at most (their tensors in the window) / `sender_window` of the weight
        however they spread them over identities (cycled, or built and kept live: the patient liar, RC's
        `cycling_patient.py`, whose 9 identities each hold one tensor in the window and weigh 1/8), an honest relay
        that changes identity keeps the weight of its tensors still in the window, and one that goes quiet loses it
        as its tensors leave. The cap keeps a sender that carries more than its share (a faster relay) at one vote,
        so the weight is that of a vote per sender where senders carry their share, and the liars' capped traffic
        where they cycle. The tensors counted are those accepted, so a liar flagged often weighs less.

        The cap must be a relay's fair share of the window: in a stage of R relays an honest relay carries about
        `window` / R tensors, and capped at fewer it weighs no more than one of a liar's identities, so a liar that
        spreads its share over a few identities outweighs it (review RC, session 23: 3 relays, 1 liar over 3
        identities, window 64, cap 8: the liar weighed 2.6 against 2, both honest relays banned). So the cap is
        ceil(`window` / `stage_relays`) where the deployment states the stage's size (the configuration, never the
        live identities, which liars can add), else `sender_window` (8: a fair share at 8 relays per stage, window
        64; with fewer relays per stage and the size unstated, the weighted vote does not hold).

        **Scope of each** (review RC, session 23; toy stage, the white-box shrink). Identity (the default) holds
        while identities last: a liar that builds a few identities of `sender_window` lies each and keeps them live
        outvotes the honest relays (8 relays, 3 liars x 3 identities: all 5 honest banned; Table 1's 25% geometry, 4
        relays, 1 liar x 4 identities: all 3 honest banned), and honest relays that change identity faster than
        every `sender_window` tensors lose their votes; it holds at any traffic share (60% measured). Weighted holds
        against any identity scheme with the cap at the stage's share and the configured stage present, but it is a
        median of the accepted traffic: liars carrying half of a link's tensors over several identities each banned
        every honest relay; and with fewer relays alive than `stage_relays` the honest ones are capped again (5 of
        8 alive, 2 liars: all 3 honest banned). Neither survives both a Sybil of identities and a majority of the
        traffic; the pipeline gives joiners no cost today (`data_node`)."""
        live = self._present(track)
        if self.config.sender_vote == "weighted":
            relays = self.config.stage_relays
            cap = math.ceil(self.config.window / relays) if relays else self.config.sender_window
            counts = {w: 0 for w in live}
            for w in track.accepted_from:
                if w in counts:
                    counts[w] += 1
            return {w: min(counts[w], cap) / cap for w in sorted(live)}
        return {w: 1.0 for w in sorted(live) if track.lifetime.get(w, 0) >= self.config.sender_window}

    def _present(self, track: _Track) -> frozenset[str]:
        """The senders still present on the link: among the window's last accepted tensors, not convicted, and not
        gone. A sender is gone when, since its last accepted tensor, at least 2 of the present senders that sent
        after it, and more than half of those counted with it, have each had `sender_window` accepted tensors, and
        more than `GONE_GAPS` of its usual gaps have passed since (its usual gap: the window's accepted tensors over
        its own among them); judged from the most recent sender back, so that two quiet identities do not keep each
        other present.

        Why: a sender another defence banned (BTARD bans a stage replica; this verifier is not told) stays in the
        window for `window` accepted tensors. Counted present, it made a link of 2 sending relays look like 3: at
        the session-23 merge (hivemind secure-pipeline test, link 2 forward) the banned all-reduce liar was a third
        voter, the senders' median reference then sat on the older of the two live relays' latest versions while one
        relay sent a burst of one version, the sending relays' windows filled with near-identical values, and an
        honest relay was banned on ``scale`` alone when the model moved. A gone sender neither votes nor counts
        toward the median fallback; it votes again from its next accepted tensor.

        What it costs against liars: to take an honest relay out, the senders with `sender_window` tensors since its
        last must be more than half of those that sent after it, so a minority of liars needs honest senders among
        them (8 relays, 3 liars: 2 honest relays with 8 tensors each since the honest one's last, a gap of about 50
        tensors for a relay with an eighth of the traffic); a liar's own identities go as soon as the honest relays
        have sent that much. A slow honest relay is not gone for being slow (review RS, session 24, HIGH 1: in a
        3-relay stage with traffic shares 0.45 / 0.45 / 0.10 the slow relay was gone whenever the other two had sent 8
        each since its last, ~15% of the checks; the stage then had 2 present senders, the pooled Tukey fence and the
        EMA reference, and the white-box shrink reached c 0.001): it is gone after `GONE_GAPS` of its usual gaps
        (0.9^30 = 4% of the time at a tenth of the traffic; toy: c >= 0.66, as without `_present`), a relay banned
        elsewhere after a few iterations (the reproduction: 3 x 36 / 8 tensors). A sender with at most `GONE_GAPS`
        tensors in the window is never gone before it leaves it. What a liar can still do: take most of the traffic
        from an honest relay that had its share, so that its silence looks like a departure."""
        key = ("present", track.accepted, len(self._convicted))
        if key not in track.sender_fences:
            order = list(track.accepted_from)
            last = {w: i for i, w in enumerate(order) if w not in self._convicted}
            present: list[str] = []
            for worker in sorted(last, key=last.get, reverse=True):  # the most recent sender first
                since: dict[str, int] = {}
                for w in order[last[worker] + 1:]:
                    since[w] = since.get(w, 0) + 1
                after = [w for w in present if w in since]
                busy = sum(since[w] >= self.config.sender_window for w in after)
                gap, usual = len(order) - 1 - last[worker], len(order) / order.count(worker)
                if not (busy >= 2 and 2 * busy > len(after) + 1 and gap > GONE_GAPS * usual):
                    present.append(worker)
            track.sender_fences[key] = frozenset(present)
        return track.sender_fences[key]

    def _disowns_input(self, track: _Track, dist: dict[str, float]) -> bool:
        """Whether the sender's tensor is reversed against (``align`` below its fence and `reversed_align`) or
        unrelated to (``bind`` above its fence and `tainted_bind_floor`) what the verifiers delivered to its
        stage for this microbatch. Both compare the stage with its actual input, so whatever that input was, an
        honest stage does not do this (honest residual stages: align 0.4-0.97 here, also when fed a shrunk
        input; the honest head, whose sketches share no directions, near 0): such a flag is not explained by
        what flowed into the sender and is held against it alone. Without this, at 37.5% malicious an honest
        stage-1 relay that forwarded to several stage-2 attackers collected a share of each one's reversed
        outputs and reached the strike rule before any of them (the `budget` attacker keeps each of its own
        counts at 2)."""
        fenced = lambda n: n in dist and len(track.windows[n]) >= 4  # noqa: E731
        # Only where the stage's output measurably follows its input (the head's does not: its align sits near 0,
        # so a crafted input could push it below its fence, and the flag would frame the honest head alone).
        if not fenced("align") or self._fence(track, "align").low < OWN_ALIGN_BASELINE:
            return False
        if dist["align"] < min(self.config.reversed_align, self._fence(track, "align").low):
            return True
        return fenced("bind") and dist["bind"] > max(self.config.tainted_bind_floor, self._fence(track, "bind").high)

    def _shrunk_to_nothing(self, track: _Track, link: int, direction: str, microbatch: Hashable,
                           tensor: Tensor) -> bool:
        """Whether the sender's output has (almost) no token structure left against what the verifiers delivered
        to its stage for this microbatch: the spread of its centred sketch is at most `SHRUNK_RATIO` of the
        input's (zeros, a constant, zeros plus tiny noise, 1e-3 * x). Only on a link whose output follows its
        input (its ``align`` fence stays above `OWN_ALIGN_BASELINE`: residual stages, forward and backward),
        where an honest stage passes its input's token structure on at about its size (1.0-1.25 measured), and
        only on an untainted microbatch (`_check` only). Not on the head: behind a LayerNorm, an upstream liar
        can feed it tokens that differ only in scale, and it answers identical logits (review of session 20).
        No input the verifiers passed makes a residual stage cancel itself, so such a flag is the sender's own.
        Measured: 37.5% seed 1 `zeros`, two stage-2 attackers' zero outputs were shared with the honest
        stage-1 relay that fed them, three shares within an iteration, and it was banned with them; on an
        all-zero sketch ``align`` and ``bind`` are not defined, so the rule for reversed outputs did not apply."""
        if not self.binds or not isinstance(tensor, Tensor):
            return False
        if len(track.windows.get("align", ())) < 4 or self._fence(track, "align").low < OWN_ALIGN_BASELINE:
            return False
        inp = self._given(link, direction, microbatch)
        if inp is None or _tokens(inp).shape[0] < 2:
            return False
        return _spread_ratio(_tokens(inp), _tokens(self.sketch(tensor))) <= SHRUNK_RATIO

    def _grown_by_shrunk_input(self, track: _Track, link: int, direction: str, microbatch: Hashable,
                               dist: dict[str, float], outside: tuple[str, ...]) -> bool:
        """Whether a flagged gradient is only larger than usual, by no more than its stage's forward input was seen
        shrunk at this link: every distance outside lies above its fence and is a magnitude (l1, l2, swd), and its
        ``scale`` plus the input's (log) stays under the gradient ``scale`` fence. A stage that normalises its input
        (the head's LayerNorm) answers an input shrunk by c with input gradients about 1/c as large, so such a flag
        is evidence about the workers upstream only (as `_large_correction` forward). Measured: 37.5% seed 0
        `adaptive` under per-sender fences, link-2 attackers' accepted activations at scale -0.5 and the honest head
        relay's gradients on them flagged on ``swd`` (scale +0.59, +0.63), three in four iterations: it was banned
        before the attackers. The growth it excuses is bounded by the shrink the link's own fences accepted."""
        scale_in = self._scales.get(microbatch, {}).get(link)
        if direction != BACKWARD or scale_in is None or scale_in >= SHRUNK_INPUT or "scale" not in dist:
            return False
        if len(track.windows["scale"]) < 4 or dist["scale"] + scale_in > self._fence(track, "scale").high:
            return False
        return bool(outside) and all(n in MAGNITUDES and _scaled(n, dist[n], self.config) > self._fence(track, n).high
                                     for n in outside)

    def _large_as_its_input(self, track: _Track, dist: dict[str, float], outside: tuple[str, ...],
                            means: tuple[Tensor, Tensor, Tensor, float] | None) -> bool:
        """Whether a flagged tensor is only larger than usual while what the verifiers delivered to its stage for
        this microbatch was itself an outlier the same way: every distance outside lies above its fence and is a
        magnitude (l1, l2, swd); the log spread of the stage's input lies above the usual inputs' (EMA) by more
        than the link's Tukey fence (`k`) on their distances to it; and its ``scale`` less that excess lies inside
        the ``scale`` fence (it grew by no more than its input explains, past what the link accepts). Such a
        flag is not the sender's: the tensor is still flagged (and a gradient replaced), but on a gradient it is a
        strike against nobody, and on an activation a strike against the upstream workers alone (`_check`).

        Why not nobody forward (session 24): the input of a forward tensor is what the upstream relays sent, and a
        relay that grows its outputs as far as its own fences accept (white-box, 1.2-1.4x on the toy stage) makes
        the honest next stage's outputs such flags; held against nobody, they were the only evidence against it
        and it was never banned (10 toy seeds: 15 of 23 flags unstruck, banned in 0; without the rule in 3;
        `test_an_upstream_that_grows_its_outputs_within_its_fences_...`). Backward, the input is the gradient the
        next stage sent, and the workers a flag is held against (the sender and the forward upstream) did not
        make it. What a sender still gets: on a microbatch whose input is that far out (the data's ~1.4%, or every
        microbatch a colluding upstream inflates, which then takes the strikes), a magnitude lie up to its input's
        excess past the ``scale`` fence goes without a strike of its own; the tensor is still flagged, so it is
        answered as any flag (a gradient replaced by the momentum, an activation's microbatch tainted).

        Decided from the input, which the sender does not control (the verifier of the link before judged it),
        and bounded by ``scale``: a sender that lies on ``swd`` while its input is usual, or that grows its output
        beyond the ``scale`` fence by more than its input grew, is held to it as before. Measured: issue 18's
        `all` cell, seed 2, microbatches 313, 318, 319 were the largest tensors of every link (forward swd rank
        101-108 of 105-109), and stage 2's gradients of them on link 1 were flagged on ``swd`` alone (log swd
        0.01-0.25 above its fence, ``scale`` 0.35-0.40) while the gradient delivered to that stage spread
        0.24-0.27 (log) above the usual, beyond the fence of 0.16-0.17: the honest relay 5 was banned at the
        third (session 22: relay 6, another routing, the same microbatches). Inputs that far out: 8 of 555
        backward tensors of that run, none forward."""
        if means is None or not outside or len(track.given_spread.window) < 4 or track.given_spread.ref is None:
            return False
        if not all(n in MAGNITUDES and _scaled(n, dist[n], self.config) > self._fence(track, n).high for n in outside):
            return False
        if "scale" not in dist or len(track.windows["scale"]) < 4:
            return False
        excess = (means[2] - track.given_spread.ref).item()
        if excess <= tukey_fence(list(track.given_spread.window), self.config.k).high:
            return False
        return self._fence(track, "scale").contains(dist["scale"] - excess)

    def _large_correction(self, track: _Track, dist: dict[str, float]) -> bool:
        """``align`` below its fence but above `align_floor`: the stage's correction outweighs its pass-through,
        which an honest stage does now and then and an honest stage fed a shrunk input does often: evidence about
        what flowed into the sender, held against the workers upstream of it only."""
        return ("align" in dist and len(track.windows["align"]) >= 4
                and self.config.align_floor < dist["align"] < self._fence(track, "align").low)

    def _inner(self, track: _Track, dist: dict[str, float]) -> bool:
        """Whether an accepted tensor may update the baseline: with `learn_k`, only when every distance lies
        inside the narrower fences (an attacker riding the edge of the k-fences cannot drag the baseline)."""
        if self.config.learn_k <= 0:
            return True
        return all(self._fence(track, n, self.config.learn_k).contains(_scaled(n, dist[n], self.config))
                   for n in dist if len(track.windows[n]) >= 4)

    def _voters(self, track: _Track, dist: dict[str, float]) -> int:
        """How many distances take part in the vote: those measured that have a fence."""
        return sum(1 for n in dist if len(track.windows[n]) >= 4)

    def _outside(self, track: _Track, dist: dict[str, float]) -> tuple[str, ...]:
        """Distances outside their fences (a distance without enough history, e.g. ``bind`` whose input
        sketch was missing for most tensors, is not fenced yet).

        A magnitude (l1, l2, swd) below its fence counts only against the EMA, and only with `two_sided`: the
        lower fence is there for a tensor that copies the EMA. Against the senders' median (`_reference`) an honest
        tensor of the current model version can sit as close as a copy: honest replicas' tensors of one version are
        nearly identical, so with 2 of 3 senders' latest summaries from the current iteration an honest one sat at
        log ``swd`` -6.0 while the fence, from values measured against the lagging EMA, was -4.8 (the session-22
        merge: an honest off-path relay banned). What a copy would hide, ``bind`` and ``align`` see (a tensor made
        from the reference's statistics is unrelated to the stage's input), and a copy of the median moves nothing.
        Without them (ablation variants such as ``sign,swd``) nothing else sees a white-box copy of the median (token
        rows whose summary is the reference's: review RC, session 23, 0 of 6 flagged), so there the lower fence
        stays, with the false-flag risk above in small groups of replicas."""
        low_magnitudes = self.config.two_sided and (self._reference(track) is track.ref or not self.binds)
        return tuple(n for n in self._names if n in dist and len(track.windows[n]) >= 4
                     and not self._fence(track, n).contains(_scaled(n, dist[n], self.config))
                     and not (n in MAGNITUDES and not low_magnitudes
                              and _scaled(n, dist[n], self.config) < self._fence(track, n).low)
                     and not (n == "bind" and self.config.bind_floor > dist[n] > self._fence(track, n).high)
                     and not (n == "align" and self.config.align_floor < dist[n] < self._fence(track, n).low)
                     # a gradient counts on ``scale`` only when shrunk (honest gradients grow with the loss)
                     and not (n == "scale" and track.direction == BACKWARD and dist[n] > self._fence(track, n).high))

    def _fence(self, track: _Track, name: str, k: float | None = None) -> Fence:
        k = self.config.k if k is None else k
        if self.config.fence == "senders":
            key = (name, k, track.accepted, len(self._convicted))  # it changes only when these do
            if key not in track.sender_fences:
                # the present senders (`_present`) with enough accepted values of this distance
                voters = self._voters_of(track)
                voting = [w for w in voters if track.by_sender[w].get(name)]
                rows = [list(track.by_sender[w][name]) for w in voting]
                weights = None if self.config.sender_vote == "identity" else [voters[w] for w in voting]
                if len(track.sender_fences) > 4 * len(self._names) + 4:
                    track.sender_fences.clear()
                track.sender_fences[key] = (sender_fence(rows, k, self._floor(track, name), weights)
                                            if len(rows) >= SENDERS else None)
            if track.sender_fences[key] is not None:
                return track.sender_fences[key]
        # `senders` without enough voters but with enough present senders (a liar that never lets an identity reach
        # `sender_window` keeps a small stage under 3 voters, review RC s23: the pooled Tukey fence, whose breakdown
        # is 25% of the traffic, let a 1-in-3 liar shrink to c 0.001): the pooled median fence (50%)
        median = self.config.fence == "median" or (
            self.config.fence == "senders" and len(self._present(track)) >= SENDERS)
        fence = median_fence if median else tukey_fence
        return fence(list(track.windows[name]), k, self._floor(track, name))

    def _floor(self, track: _Track, name: str) -> float:
        """The spread floor of a distance's fences: one feature's resolution for ``sign``, else `min_spread`."""
        return 1.0 / track.ref.mean.shape[0] if name == "sign" else self.config.min_spread

    def _strike(self, verdict: Verdict, blame_upstream: bool = True, own: bool = False, lasting: bool = True,
                upstream_only: bool = False, shrunk_input: bool = False, explained: bool = False) -> Verdict:
        """Count the verdict in the strike histories of the sender and (`blame_upstream`) the workers upstream
        of it; a flag is held against all of them, or against the sender alone when it is its `own` (`lasting`:
        also counted among its last `own_window` microbatches);
        `upstream_only`: no flag on the tensor, evidence about the sender's input, shared by the sender and the
        upstream workers, or held against the upstream workers alone when this verifier saw that input arrive
        shrunk (`shrunk_input`); `explained`: a flag its input explains (`_large_as_its_input`), held against nobody."""
        mb = verdict.microbatch
        source = (verdict.link, verdict.direction)  # which track's flag a strike is (see `_forgive`)
        if verdict.direction == FORWARD:
            self._paths.setdefault(mb, {})[verdict.link] = verdict.worker
        # everyone upstream of the sender handled this microbatch: a flag may be explained by what flowed into
        # the sender (it is then held against them too), and a clean tensor counts in their histories as well,
        # so that a verifier several links downstream does not see only their flagged microbatches
        handlers = {verdict.worker}
        if blame_upstream:
            bound = verdict.link if verdict.direction == BACKWARD else verdict.link - 1
            handlers |= {w for link, w in self._paths.get(mb, {}).items() if link <= bound}
        blames = (verdict.flagged or upstream_only) and not explained
        if upstream_only and shrunk_input:
            # the input the verifier delivered was shrunk: an honest stage behind a LayerNorm corrects that much
            # (measured: 37.5% `adaptive`, an honest stage-2 relay fed by three shrinking attackers collected a share
            # of each and was banned), so it is evidence about the upstream workers only
            suspects = handlers - {verdict.worker}
        elif upstream_only:
            # the sender shares it: one sender that keeps its outputs just above align_floor convicts itself
            # first, which explains the shared strikes away from the honest workers upstream (no framing)
            suspects = handlers
        else:
            suspects = handlers if verdict.flagged and not own else {verdict.worker}
        convicted = []
        for worker in [verdict.worker, *sorted(handlers - {verdict.worker})]:
            if worker in self._convicted:
                continue
            others = suspects - {worker} if blames else set()
            # not a suspect (a clean entry upstream of the sender's own flag), or explained by a worker convicted just now
            flagged = blames and worker in suspects and not others & self._convicted
            history = self._history.setdefault(
                worker, deque(maxlen=max(self.config.strike_window, self.config.own_window)))
            entry = next((e for e in history if e[0] == mb), None)  # one strike per microbatch at most
            disowned = flagged and own and lasting and worker == verdict.worker
            if entry is None:
                history.append([mb, flagged, others if flagged else set(), disowned, {source} if flagged else set()])
            elif flagged:
                entry[1] = True
                entry[2] |= others
                entry[3] = entry[3] or disowned
                entry[4].add(source)
                if entry not in list(history)[-self.config.strike_window:]:
                    # a late flag (a gradient) on a microbatch older than the strike window counts as a new
                    # entry, as in a history only that long: else a relay that holds more than strike_window
                    # microbatches in flight could send a bad gradient on each and never reach 3 in 8
                    history.remove(entry)
                    history.append(entry)
            entries = list(history)
            if (sum(e[1] for e in entries[-self.config.strike_window:]) >= self.config.strikes
                    or sum(e[3] for e in entries[-self.config.own_window:]) >= self.config.strikes):
                self._convict(worker)
                convicted.append(worker)
        if not self.config.detect_only:
            self._banned.update(convicted)
        blamed = tuple(sorted(suspects)) if blames else ()
        if not (convicted or blamed):
            return verdict
        bans = () if self.config.detect_only else tuple(convicted)
        return dataclasses.replace(verdict, bans=bans, convicted=tuple(convicted), suspects=blamed)

    def _convict(self, worker: str) -> None:
        """`worker` reached the strike rule; strikes it shared with others are explained by it and taken off them."""
        self._convicted.add(worker)
        for history in self._history.values():
            for entry in history:
                if worker in entry[2]:
                    entry[1], entry[2], entry[4] = False, set(), set()
