"""SENTINEL statistics: distances, fences, EMA, warm-up, votes, strikes and substitution."""

import math
import random
import statistics
from collections import deque

import numpy as np
import pytest
import torch

from phalanx.algorithms.sentinel.statistics import (
    BACKWARD,
    FORWARD,
    Sentinel,
    SentinelConfig,
    Summary,
    Verdict,
    _Track,
    align,
    bind_sketch,
    binding,
    distances,
    ema,
    median_fence,
    projections,
    sender_fence,
    summarize,
    tukey_fence,
    vote,
)
from phalanx.core.errors import ConfigError


def _honest(gen: torch.Generator, center: torch.Tensor, shape=(4, 8, 16)) -> torch.Tensor:
    return center + 0.5 * torch.randn(shape, generator=gen)


def _center(features: int = 16) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, features) + 0.05  # no feature has a zero mean


def _smallest_accepted(verifier: Sentinel, link: int, tensor: torch.Tensor, microbatch) -> float:
    """The white-box shrink: the smallest scale of `tensor` that the verifier's fences on `link` accept (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(10):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if verifier.would_accept(link, FORWARD, mid * tensor, microbatch) else (mid, hi)
    return hi


def _warm(verifier: Sentinel, link: int, count: int, gen: torch.Generator, direction: str = FORWARD) -> None:
    check = verifier.check_forward if direction == FORWARD else verifier.check_backward
    for i in range(count):
        check(link, f"w{i % 3}", ("warm", link, direction, i), _honest(gen, _center()))


def test_distances_against_direct_computation():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, 6, generator=gen)
    proj = projections(0, 1, FORWARD, 6, 3)
    assert torch.allclose(proj.norm(dim=0), torch.ones(3))
    ref = Summary(torch.randn(6, generator=gen), torch.randn(4, 3, generator=gen))
    got = distances(summarize(x, proj, 4), ref)
    rows = x.reshape(-1, 6).numpy().astype(np.float64)
    mean = rows.mean(axis=0)
    r = ref.mean.numpy().astype(np.float64)
    assert got["l1"] == pytest.approx(np.abs(mean - r).mean(), rel=1e-5)
    assert got["l2"] == pytest.approx(np.linalg.norm(mean - r) / np.linalg.norm(r), rel=1e-5)
    assert got["sign"] == pytest.approx(np.mean(np.sign(mean) != np.sign(r)))
    projected = rows @ proj.numpy().astype(np.float64)  # [35, 3]
    levels = (np.arange(4) + 0.5) / 4
    q = np.quantile(projected, levels, axis=0)  # numpy's linear interpolation, as torch.quantile
    assert got["swd"] == pytest.approx(np.abs(q - ref.quantiles.numpy()).mean(), rel=1e-4)
    assert got["scale"] == pytest.approx(math.log(np.abs(q).mean() / ref.quantiles.abs().mean().item()), rel=1e-4)


def test_sliced_wasserstein_of_shifted_copy_is_the_projected_shift():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 8, generator=gen)
    shift = torch.randn(8, generator=gen)
    proj = projections(3, 0, BACKWARD, 8, 5)
    a, b = summarize(x, proj, 16), summarize(x + shift, proj, 16)
    # a translation moves every quantile of a projection by <shift, direction>
    assert distances(b, a, ("swd",))["swd"] == pytest.approx((shift @ proj).abs().mean().item(), rel=1e-4)
    assert distances(a, a)["l1"] == 0.0 and distances(a, a)["swd"] == 0.0


def test_sign_distance_counts_zero_as_flip():
    ref = Summary(torch.tensor([1.0, -2.0, 3.0, -4.0]), torch.zeros(1, 1))
    x = Summary(torch.tensor([0.5, 2.0, 0.0, -1.0]), torch.zeros(1, 1))
    assert distances(x, ref, ("sign",))["sign"] == pytest.approx(0.5)


def test_tukey_fence_against_numpy():
    values = [0.3, 1.2, 0.7, 5.0, 0.9, 1.1, 0.4, 0.8, 2.2]
    q1, q3 = np.percentile(values, [25, 75])
    fence = tukey_fence(values, 1.5)
    assert fence.low == pytest.approx(q1 - 1.5 * (q3 - q1)) and fence.high == pytest.approx(q3 + 1.5 * (q3 - q1))
    assert statistics.quantiles(values, n=4, method="inclusive") == pytest.approx([q1, np.median(values), q3])
    floored = tukey_fence([1.0] * 6, 3.0, floor=0.1)
    assert (floored.low, floored.high) == pytest.approx((0.7, 1.3))
    assert fence.contains(q3) and not fence.contains(fence.high + 1e-9)


def test_ema_and_vote_rules():
    old = Summary(torch.tensor([1.0, 2.0]), torch.tensor([[0.0]]))
    new = Summary(torch.tensor([3.0, 0.0]), torch.tensor([[1.0]]))
    mixed = ema(old, new, 0.75)
    assert torch.allclose(mixed.mean, torch.tensor([1.5, 1.5])) and mixed.quantiles.item() == pytest.approx(0.25)
    assert vote(1, 4, "any") and not vote(0, 4, "any")
    assert vote(3, 4, "majority") and not vote(2, 4, "majority")
    assert vote(4, 4, "all") and not vote(3, 4, "all")


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="sentinel.distances"):
        SentinelConfig(distances="l1,cosine")
    with pytest.raises(ConfigError, match="sentinel.vote"):
        SentinelConfig(vote="most")
    with pytest.raises(ConfigError, match="sentinel.beta_h"):
        SentinelConfig(beta_h=1.0)
    with pytest.raises(ConfigError, match="sentinel.strikes"):
        SentinelConfig(strikes=9, strike_window=8)
    with pytest.raises(ConfigError, match="sentinel.own_window"):
        SentinelConfig(own_window=0)
    with pytest.raises(ConfigError, match="sentinel.reversed_align"):
        SentinelConfig(reversed_align=2.0)


def test_inconsistent_settings_are_one_line_config_errors_not_silently_off_rules():
    """Settings that would silently turn a rule off, or make it unable to hold, are refused with what to change."""
    # an own window shorter than the strike window can never ban first: the own rule would be off
    with pytest.raises(ConfigError, match=r"sentinel.own_window=4 must be >= sentinel.strike_window=8 \(set it equal"):
        SentinelConfig(own_window=4, strike_window=8)
    SentinelConfig(own_window=8, strike_window=8)  # equal is the documented way to turn it off
    with pytest.raises(ConfigError, match="sentinel.own_window=6 must be >= sentinel.strike_window=12"):
        SentinelConfig(strikes=3, strike_window=12, own_window=6)
    with pytest.raises(ConfigError, match="sentinel.strike_window=0 must be >= 1"):
        SentinelConfig(strike_window=0)
    with pytest.raises(ConfigError, match="sentinel.window=0"):
        SentinelConfig(window=0)
    with pytest.raises(ConfigError, match="sentinel.strikes=9 must be <= sentinel.strike_window=8"):
        SentinelConfig(strikes=9, strike_window=8, own_window=32)
    # learning fences as wide as the flag fences filter nothing
    with pytest.raises(ConfigError, match="sentinel.learn_k=5.0 must be below sentinel.k=5.0"):
        SentinelConfig(learn_k=5.0)
    SentinelConfig(learn_k=2.0)
    # a tainted microbatch's input is suspect: its bind floor may not be stricter than the ordinary one
    with pytest.raises(ConfigError, match="sentinel.tainted_bind_floor=0.8 must be >= sentinel.bind_floor=0.9"):
        SentinelConfig(tainted_bind_floor=0.8)
    with pytest.raises(ConfigError) as error:
        SentinelConfig(own_window=4)
    assert "\n" not in str(error.value)


def test_warmup_accepts_everything_then_fences_flag():
    config = SentinelConfig(warmup=30, window=30, distances="l1,l2,sign,swd")
    verifier = Sentinel(config)
    gen = torch.Generator().manual_seed(3)
    assert verifier.fences(1, FORWARD) is None
    warm = verifier.check_forward(1, "w0", 0, torch.zeros(4, 8, 16))  # even a zero tensor is trusted in warm-up
    assert not warm.flagged and warm.reason == "warmup"
    _warm(verifier, 1, 40, gen)
    assert verifier.fences(1, FORWARD) is not None
    ok = verifier.check_forward(1, "w1", "a", _honest(gen, _center()))
    bad = verifier.check_forward(1, "w2", "b", -_honest(gen, _center()))
    assert not ok.flagged and ok.reason == "ok"
    assert bad.flagged and bad.reason == "fence" and {"l1", "sign", "swd"} <= set(bad.outside)


def test_flagged_tensor_does_not_update_the_ema():
    verifier = Sentinel(SentinelConfig(warmup=20, window=20))
    gen = torch.Generator().manual_seed(4)
    _warm(verifier, 0, 30, gen)
    before = verifier.reference(0, FORWARD).mean.clone()
    verdict = verifier.check_forward(0, "evil", "x", torch.full((4, 8, 16), 9.0))
    assert verdict.flagged
    assert torch.equal(verifier.reference(0, FORWARD).mean, before)
    honest = _honest(gen, _center())
    assert not verifier.check_forward(0, "w0", "y", honest).flagged
    expected = 0.9 * before + 0.1 * honest.reshape(-1, 16).mean(0)
    assert torch.allclose(verifier.reference(0, FORWARD).mean, expected, atol=1e-6)


def test_malformed_tensors_are_flagged_not_raised():
    verifier = Sentinel(SentinelConfig(warmup=5, strikes=2, strike_window=4))
    gen = torch.Generator().manual_seed(5)
    _warm(verifier, 0, 6, gen)
    assert verifier.check_forward(0, "evil", 1, torch.full((4, 8, 16), math.nan)).reason == "malformed"
    verdict = verifier.check_forward(0, "evil", 2, torch.ones(4, 8, 15))
    assert verdict.flagged and verdict.reason == "malformed" and verdict.bans == ("evil",)
    assert verifier.banned() == {"evil"}
    assert verifier.check_forward(0, "evil", 3, _honest(gen, _center())).reason == "banned"


def test_strike_rule_bans_at_the_threshold_and_counts_a_microbatch_once():
    verifier = Sentinel(SentinelConfig(warmup=20, window=20, strikes=3, strike_window=5))
    gen = torch.Generator().manual_seed(6)
    _warm(verifier, 1, 25, gen)
    _warm(verifier, 0, 25, gen, BACKWARD)
    bad = torch.full((4, 8, 16), 7.0)
    # a stage-1 worker flagged forward (link 1) and backward (link 0) on one microbatch: one strike
    assert verifier.check_forward(1, "evil", 100, bad).flagged
    assert verifier.check_backward(0, "evil", 100, bad).flagged
    assert verifier.banned() == frozenset()
    # honest checks in between keep the flags inside the window of 5 microbatches
    verifier.check_forward(1, "evil", 101, _honest(gen, _center()))
    assert verifier.check_forward(1, "evil", 102, bad).flagged
    assert verifier.banned() == frozenset()
    verdict = verifier.check_forward(1, "evil", 103, bad)
    assert verdict.bans == ("evil",) and verifier.banned() == {"evil"}
    # flags spread wider than the window never ban
    other = Sentinel(SentinelConfig(warmup=20, window=20, strikes=3, strike_window=5))
    _warm(other, 1, 25, gen)
    for i in range(12):
        other.check_forward(1, "slow", 200 + i, bad if i % 3 == 0 else _honest(gen, _center()))
    assert other.banned() == frozenset()


def test_backward_substitution_returns_the_gradient_momentum():
    verifier = Sentinel(SentinelConfig(warmup=20, window=20))
    gen = torch.Generator().manual_seed(7)
    _warm(verifier, 0, 30, gen, BACKWARD)
    honest = _honest(gen, _center())
    ok = verifier.check_backward(0, "w0", "h", honest)
    assert ok.substitute is None and ok.passed_on(honest) is honest
    momentum = verifier.reference(0, BACKWARD).mean.clone()
    bad = torch.full((4, 8, 16), -5.0)
    verdict = verifier.check_backward(0, "evil", "b", bad)
    assert verdict.flagged
    assert verdict.substitute.shape == bad.shape
    assert torch.equal(verdict.passed_on(bad), momentum.expand(4, 8, 16))


def test_forward_flag_taints_the_microbatch():
    verifier = Sentinel(SentinelConfig(warmup=20, window=20))
    gen = torch.Generator().manual_seed(8)
    for link in (0, 1, 2):
        _warm(verifier, link, 25, gen)
        _warm(verifier, link, 25, gen, BACKWARD)
    # "evil" serves stage 1: its activation crosses link 1 forward, its gradient link 0 backward
    assert verifier.check_forward(1, "evil", 7, torch.zeros(4, 8, 16)).flagged
    downstream = verifier.check_forward(2, "s2", 7, torch.zeros(4, 8, 16))
    assert not downstream.flagged and downstream.reason == "tainted"  # not the next stage's fault
    from_next = verifier.check_backward(1, "s2", 7, _honest(gen, _center()))
    assert from_next.reason == "tainted" and from_next.substitute is not None
    own = verifier.check_backward(0, "evil", 7, _honest(gen, _center()))  # looks clean, still replaced
    assert own.reason == "tainted" and not own.flagged and own.substitute is not None
    # a fresh microbatch is judged normally again
    assert verifier.check_forward(2, "s2", 8, _honest(gen, _center())).reason == "ok"


def test_clean_stream_has_no_flags_after_warmup():
    """A few hundred honest tensors from a slowly drifting source: the default config flags none."""
    verifier = Sentinel(SentinelConfig())
    gen = torch.Generator().manual_seed(9)
    flags = 0
    for i in range(400):
        center = _center() * (1 + i / 2000)  # training drift
        fwd = verifier.check_forward(1, f"w{i % 4}", i, _honest(gen, center))
        bwd = verifier.check_backward(1, f"w{(i + 1) % 4}", i, 0.01 * _honest(gen, center))
        flags += fwd.flagged + bwd.flagged
    assert flags <= 4  # false-positive rate under 0.5% of 800 checks
    assert verifier.banned() == frozenset()


def test_odd_gradients_are_held_against_the_upstream_forward_sender_too():
    """An attacker whose activations pass (delay, adaptive) is caught through the gradients after it."""
    verifier = Sentinel(SentinelConfig(warmup=20, window=20, strikes=3, strike_window=8))
    gen = torch.Generator().manual_seed(10)
    for i in range(25):  # each gradient after its activation (a gradient judged first is not learned)
        verifier.check_forward(1, f"w{i % 3}", ("warm", i), _honest(gen, _center()))
        verifier.check_backward(1, f"w{i % 3}", ("warm", i), _honest(gen, _center()))
    odd = torch.full((4, 8, 16), 6.0)
    for i in range(3):
        downstream = f"s2r{i}"  # a different honest next-stage worker each time
        assert not verifier.check_forward(1, "sneaky", i, _honest(gen, _center())).flagged
        verdict = verifier.check_backward(1, downstream, i, odd)
        assert verdict.flagged and verdict.substitute is not None
    assert verifier.banned() == {"sneaky"}
    assert verdict.bans == ("sneaky",)


def test_bind_separates_an_output_of_this_microbatch_from_a_replayed_one():
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(16, 16, generator=gen) / 4
    inp, other = torch.randn(4, 64, 16, generator=gen), torch.randn(4, 64, 16, generator=gen)  # 256 tokens
    out = inp + torch.tanh(inp @ weight)  # a residual block of this microbatch
    stale = other + torch.tanh(other @ weight)  # the same block's output for another microbatch
    proj = projections(0, -1, "bind", 16, 8)
    sketch = lambda t: bind_sketch(t, proj)  # noqa: E731
    assert binding(sketch(inp), sketch(out)) < 0.3 < 0.8 < binding(sketch(inp), sketch(stale))
    assert binding(sketch(inp), sketch(-3 * out)) == pytest.approx(binding(sketch(inp), sketch(out)), abs=1e-5)
    assert binding(sketch(inp), sketch(inp[:2])) is None  # not comparable
    # in the verifier: the input recorded for the microbatch binds the stage's output to it
    verifier = Sentinel(SentinelConfig(warmup=5, window=8, distances="bind", bind_projections=8))
    assert verifier.binds
    for i in range(12):
        x = torch.randn(4, 64, 16, generator=gen)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        assert not verifier.check_forward(1, "w", i, x + torch.tanh(x @ weight)).flagged
    verifier.record_input("late", 1, FORWARD, verifier.sketch(inp))
    verdict = verifier.check_forward(1, "w", "late", stale)
    assert verdict.flagged and verdict.outside == ("bind",)


def test_reject_flags_the_sender_alone_and_substitutes_backward():
    verifier = Sentinel(SentinelConfig(warmup=5, strikes=2, strike_window=4))
    gen = torch.Generator().manual_seed(9)
    _warm(verifier, 1, 8, gen)
    verifier.check_forward(1, "up", "m", _honest(gen, _center()))
    verdict = verifier.reject(2, FORWARD, "forger", "m", "forged_hop", _honest(gen, _center()))
    assert verdict.flagged and verdict.reason == "forged_hop" and verdict.suspects == ("forger",)
    assert verifier.taint_of("m") == (2, "forger")
    back = verifier.reject(0, BACKWARD, "forger", "n", "unsigned", torch.ones(4, 8, 16))
    assert back.substitute is not None and back.bans == ("forger",) and verifier.banned() == {"forger"}


def test_learn_k_keeps_edge_riding_tensors_out_of_the_baseline():
    gen = torch.Generator().manual_seed(10)
    verifiers = {k: Sentinel(SentinelConfig(warmup=20, window=20, learn_k=k, distances="l2")) for k in (0.0, 0.5)}
    for verifier in verifiers.values():
        _warm(verifier, 0, 30, torch.Generator().manual_seed(10))
    edge = _honest(gen, _center()) * 1.3  # passes the k=5 fence, outside the k=0.5 one
    for k, verifier in verifiers.items():
        before = verifier.reference(0, FORWARD).mean.clone()
        assert not verifier.check_forward(0, "w", "edge", edge).flagged
        assert torch.equal(verifier.reference(0, FORWARD).mean, before) == (k > 0)


def test_a_second_replayer_on_a_microbatch_tainted_upstream_is_still_judged_on_bind():
    """Both links' attackers on one microbatch: the first one's flag taints it, and the second one's replayed
    output is still flagged on ``bind`` (against it alone), while an honest stage's output computed from the
    tampered input binds to it and passes."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(16, 16, generator=gen) / 4
    block = lambda t: t + torch.tanh(t @ weight)  # noqa: E731
    verifier = Sentinel(SentinelConfig(warmup=5, window=8, distances="bind", bind_projections=8))
    for i in range(12):
        for link in (1, 2):
            x = torch.randn(4, 64, 16, generator=gen)
            verifier.record_input(i, link, FORWARD, verifier.sketch(x))
            verifier.check_forward(link, "w", i, block(x))
    for mb, replayed in (("replayed", True), ("honest", False), ("tighter than usual", False)):
        inp, other, earlier = (torch.randn(4, 64, 16, generator=gen) for _ in range(3))
        verifier.record_input(mb, 1, FORWARD, verifier.sketch(inp))
        stale = block(other)  # the first attacker's replay: tampered input of stage 2
        assert verifier.check_forward(1, "first", mb, stale).flagged and verifier.taint_of(mb) == (1, "first")
        verifier.record_input(mb, 2, FORWARD, verifier.sketch(stale))
        out = {"replayed": block(earlier), "honest": block(stale), "tighter than usual": stale}[mb]
        verdict = verifier.check_forward(2, "second", mb, out)
        assert verdict.flagged == replayed, mb
        assert verdict.suspects == (("second",) if replayed else ())
        assert verdict.reason == ("fence" if replayed else "tainted")


def test_median_fence_is_tukeys_on_symmetric_data_and_stays_bounded_where_tukeys_drifts():
    values = [float(v) for v in range(1, 10)]
    assert median_fence(values, 5.0) == tukey_fence(values, 5.0)  # 5 -+ 22 both
    floored = median_fence([1.0] * 6, 3.0, floor=0.1)
    assert floored.low == pytest.approx(0.65) and floored.high == pytest.approx(1.35)
    # 3 of every 8 accepted values put on the current upper fence (an attacker riding its edge)
    rng = random.Random(0)
    highs = {}
    for fence in (tukey_fence, median_fence):
        window = deque([rng.gauss(0, 1) for _ in range(64)], maxlen=64)
        for i in range(800):
            window.append(fence(list(window), 5.0).high if i % 8 < 3 else rng.gauss(0, 1))
        highs[fence] = fence(list(window), 5.0).high
    assert highs[tukey_fence] > 1e6 and highs[median_fence] < 30  # honest fence: about 7.4


def test_align_sees_the_sign_that_bind_does_not_and_ignores_scale():
    gen = torch.Generator().manual_seed(12)
    weight = torch.randn(16, 16, generator=gen) / 4
    inp = torch.randn(4, 64, 16, generator=gen)
    out = inp + torch.tanh(inp @ weight)
    proj = projections(0, -1, "bind", 16, 8)
    a, b = bind_sketch(inp, proj), bind_sketch(out, proj)
    assert 0.5 < align(a, b) <= 1.0
    assert align(a, bind_sketch(-0.5 * out, proj)) == pytest.approx(-align(a, b), rel=1e-4)
    assert align(a, bind_sketch(3 * out, proj)) == pytest.approx(align(a, b), rel=1e-4)
    assert binding(a, bind_sketch(-0.5 * out, proj)) == pytest.approx(binding(a, b), abs=1e-5)
    assert align(a, b[:10]) is None and align(torch.zeros_like(a), b) is None
    # in the verifier, a negated output is flagged on align alone
    verifier = Sentinel(SentinelConfig(warmup=5, window=8, distances="bind,align", bind_projections=8))
    for i in range(12):
        x = torch.randn(4, 64, 16, generator=gen)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        assert not verifier.check_forward(1, "w", i, x + torch.tanh(x @ weight)).flagged
    verifier.record_input("negated", 1, FORWARD, verifier.sketch(inp))
    verdict = verifier.check_forward(1, "w", "negated", -out)
    assert verdict.flagged and verdict.outside == ("align",)


def test_scale_flags_a_shrunk_tensor_that_sign_accepts_and_a_grown_one_only_forward():
    """A shrunk tensor keeps its signs (``sign`` accepts it); ``scale`` is log c for a tensor scaled by c and flags
    it. A grown tensor is flagged forward, not backward (honest gradients grow with the loss)."""
    gen = torch.Generator().manual_seed(15)
    x = _honest(gen, _center())
    proj = projections(0, 1, FORWARD, 16, 4)
    assert distances(summarize(0.3 * x, proj, 8), summarize(x, proj, 8), ("scale",))["scale"] == pytest.approx(math.log(0.3))
    verifier = Sentinel(SentinelConfig(warmup=20, window=16, distances="sign,scale"))
    for i in range(30):
        verifier.check_forward(1, f"w{i % 3}", i, _honest(gen, _center()))
        verifier.check_backward(1, f"w{i % 3}", i, _honest(gen, _center()))
    for direction, check in ((FORWARD, verifier.check_forward), (BACKWARD, verifier.check_backward)):
        assert not check(1, "a", (direction, "honest"), _honest(gen, _center())).flagged
        shrunk = check(1, "b", (direction, "shrunk"), 0.3 * _honest(gen, _center()))
        assert shrunk.flagged and shrunk.outside == ("scale",)
        grown = check(1, "c", (direction, "grown"), 3 * _honest(gen, _center()))
        assert grown.flagged == (direction == FORWARD) and dict(grown.distances)["scale"] > 1


def test_on_a_tainted_microbatch_only_outputs_with_no_relation_to_their_input_count():
    """The stricter floor of the tainted case: with `tainted_bind_floor` at 1 nothing there can be flagged."""
    gen = torch.Generator().manual_seed(13)
    verifier = Sentinel(SentinelConfig(warmup=5, window=8, distances="bind", bind_projections=8, tainted_bind_floor=1.0))
    weight = torch.randn(16, 16, generator=gen) / 4
    for i in range(12):
        for link in (1, 2):
            x = torch.randn(4, 64, 16, generator=gen)
            verifier.record_input(i, link, FORWARD, verifier.sketch(x))
            verifier.check_forward(link, "w", i, x + torch.tanh(x @ weight))
    inp, other, earlier = (torch.randn(4, 64, 16, generator=gen) for _ in range(3))
    verifier.record_input("m", 1, FORWARD, verifier.sketch(inp))
    assert verifier.check_forward(1, "first", "m", other).flagged
    verifier.record_input("m", 2, FORWARD, verifier.sketch(other))
    verdict = verifier.check_forward(2, "second", "m", earlier)
    assert not verdict.flagged and verdict.reason == "tainted" and dict(verdict.distances)["bind"] > 0.9


def test_the_white_box_attacker_cannot_reverse_a_tensor_once_align_is_measured_nor_shrink_it_once_scale_is():
    """The adaptive attacker (largest step towards -x the verifier accepts) against a residual stage: the sign-blind
    distances accept the full negation; with ``align`` whatever it gets accepted still points along x, but may be
    shrunk to about 0.4 of it; with ``scale`` as well, no further than about 0.7 (at first: see the test after
    next)."""
    from phalanx.algorithms.sentinel.attacks import LinkView, make_link_attack

    gen = torch.Generator().manual_seed(14)
    weight = torch.randn(16, 16, generator=gen) / 4
    sent = {}
    for distances in ("sign,swd,bind", "sign,swd,bind,align", "sign,swd,bind,align,scale"):
        verifier = Sentinel(SentinelConfig(warmup=16, window=16, distances=distances, bind_projections=8))
        attack = make_link_attack("adaptive", steps=10)
        scales = []
        for i in range(40):
            x = torch.randn(4, 32, 16, generator=gen)  # per-feature means near zero, as a gradient's: sign is noise
            out = x + torch.tanh(x @ weight)
            verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
            if i >= 24 and i % 4 == 0:  # one tensor in four from the attacker
                probe = lambda t, i=i: verifier.would_accept(1, FORWARD, t, i)  # noqa: E731
                honest, out = out, attack.relay(LinkView("gradient", i, i, out, probe)).tensor
                scales.append(float((out * honest).sum() / (honest * honest).sum()))
            verifier.check_forward(1, "w", i, out)
        sent[distances] = min(scales)
    assert sent["sign,swd,bind"] < -0.5 and 0 < sent["sign,swd,bind,align"] < 0.6
    assert sent["sign,swd,bind,align,scale"] > 0.65


def test_an_output_reversed_against_its_own_input_is_held_against_its_sender_alone():
    """37.5% malicious, `budget`: an honest stage-1 relay forwarded to several stage-2 attackers, and each reversed
    output was also held against it, so it reached the strike rule (3 shares) before any attacker (at most 2 each):
    an honest relay banned. A tensor reversed against the input its stage was given is the sender's own doing;
    a flag on a distance that the input can explain (here ``scale``, the input grown) is still shared with the
    upstream sender."""
    gen = torch.Generator().manual_seed(16)
    weight = torch.randn(16, 16, generator=gen) / 4
    block = lambda t: t + torch.tanh(t @ weight)  # noqa: E731
    verifier = Sentinel(SentinelConfig(warmup=5, window=8, distances="align,scale", bind_projections=8, strikes=3,
                                       strike_window=8))

    def hop(mb, sender, link, inp, out):
        verifier.record_input(mb, link, FORWARD, verifier.sketch(inp))
        return verifier.check_forward(link, sender, mb, out)

    for i in range(12):
        x = torch.randn(2, 32, 16, generator=gen)
        hop(i, f"s1r{i % 4}", 1, x, block(x))
        hop(i, f"s2r{i % 4}", 2, block(x), block(block(x)))
    reversed_ = []
    for mb, attacker in (("m0", "a"), ("m1", "a"), ("m2", "b")):
        x = torch.randn(2, 32, 16, generator=gen)
        assert not hop(mb, "up", 1, x, block(x)).flagged
        reversed_.append(hop(mb, attacker, 2, block(x), -block(block(x))))
    assert verifier.convicted() == frozenset() and verifier.banned() == frozenset()
    assert all(v.flagged and "align" in v.outside and v.suspects == (v.worker,) for v in reversed_)
    grown_in = 5 * block(torch.randn(2, 32, 16, generator=gen))  # delivered from "up2" (as if it passed link 1)
    verifier.record_input("m3", 2, FORWARD, verifier.sketch(grown_in))
    grown = verifier.check_forward(2, "c", "m3", block(grown_in), upstream={1: "up2"})  # aligned, too large
    assert grown.flagged and grown.outside == ("scale",) and grown.suspects == ("c", "up2")


def test_where_the_output_does_not_follow_the_input_a_low_align_is_not_the_senders_own():
    """At the head the output does not follow the input (its align sits near 0), so an input crafted upstream could
    push an honest head's align below its fence; held against the head alone, that would frame it (review of
    session 18). There the flag stays shared with the upstream sender, as any flag the input may explain."""
    gen = torch.Generator().manual_seed(18)
    verifier = Sentinel(SentinelConfig(warmup=5, window=8, distances="align,scale", bind_projections=8, strikes=3,
                                       strike_window=8))
    unrelated = lambda t: torch.randn(t.shape, generator=gen)  # noqa: E731

    def hop(mb, sender, link, inp, out):
        verifier.record_input(mb, link, FORWARD, verifier.sketch(inp))
        return verifier.check_forward(link, sender, mb, out)

    for i in range(12):
        x = torch.randn(2, 32, 16, generator=gen)
        hop(i, f"s1r{i % 4}", 1, x, x + 0.1 * torch.randn(x.shape, generator=gen))
        hop(i, f"head{i % 4}", 2, x, unrelated(x))
    x = torch.randn(2, 32, 16, generator=gen)
    assert not hop("m0", "up", 1, x, x + 0.1 * torch.randn(x.shape, generator=gen)).flagged
    low = hop("m0", "head0", 2, x, -x)
    assert low.flagged and "align" in low.outside and low.suspects == ("head0", "up")


def test_outputs_reversed_against_their_input_are_remembered_longer_than_other_flags():
    """The `budget` attacker reverses 2 of every 8 of its outputs, just under the strike rule (3 in 8). A reversed
    output is evidence no input explains, so such flags count over `own_window` (32) microbatches: the third one bans
    it. Other flags spread the same way (here a grown tensor, ``scale``) still need 3 in 8."""
    gen = torch.Generator().manual_seed(17)
    weight = torch.randn(16, 16, generator=gen) / 4
    block = lambda t: t + torch.tanh(t @ weight)  # noqa: E731
    banned = {}
    for own_window in (8, 32):
        verifier = Sentinel(SentinelConfig(warmup=5, window=8, distances="align,scale", bind_projections=8,
                                           strikes=3, strike_window=8, own_window=own_window))
        for i in range(12):
            x = torch.randn(2, 32, 16, generator=gen)
            verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
            verifier.check_forward(1, f"w{i % 4}", i, block(x))
        for i in range(10):
            for worker, lie in (("budget", lambda y: -y), ("grower", lambda y: 5 * y)):
                x = torch.randn(2, 32, 16, generator=gen)
                verifier.record_input((worker, i), 1, FORWARD, verifier.sketch(x))
                out = lie(block(x)) if i % 8 in (0, 1) else block(x)
                verdict = verifier.check_forward(1, worker, (worker, i), out)
                assert verdict.flagged == (i % 8 in (0, 1)) or verdict.reason == "banned"
        banned[own_window] = verifier.banned()
    assert banned == {8: frozenset(), 32: frozenset({"budget"})}


def test_a_late_flag_on_a_microbatch_older_than_the_strike_window_still_counts():
    """A gradient's flag arrives after the worker's later forwards. The history keeps `own_window` (32) entries; a
    flag on an entry beyond the last `strike_window` (8) must still count toward 3 in 8, as it did when the history
    was 8 long (review of session 18: 12 clean forwards, then 3 flagged gradients of microbatches 0-2, convicted
    nobody)."""
    verifier = Sentinel(SentinelConfig(strikes=3, strike_window=8, own_window=32))
    for mb in range(12):
        verifier._strike(Verdict(1, FORWARD, "w", mb, False, "ok"))
    for mb in range(3):
        verdict = verifier._strike(Verdict(1, BACKWARD, "w", mb, True, "fence"))
    assert verdict.convicted == ("w",) and verifier.banned() == frozenset({"w"})



def test_a_gradient_computed_from_the_verifiers_own_substitute_is_not_judged_against_honest_traffic():
    """100-step delay run (session 19): each false forward flag of an honest relay drew a second false flag on its
    gradient. The verifier after it had sent it the gradient momentum (a per-feature mean, about 18x smaller than a
    gradient) and the gradient it computed from that was judged against honest traffic: `scale` log -2.6..-3.2, 5 of
    the run's 14 false flags. It is still replaced, not judged. Where the gradient it got was not replaced (the
    data node's, trusted), it is still judged: a shrunk one is flagged."""
    gen = torch.Generator().manual_seed(19)
    verifier = Sentinel(SentinelConfig(warmup=20, window=16, distances="sign,swd,scale"))
    for i in range(30):
        for link in (1, 0):
            verifier.check_backward(link, f"w{i % 3}", i, _honest(gen, _center()))
    for mb, replaced in (("replaced", True), ("from the data node", False)):
        verifier.mark_tainted(mb, 1, "r")  # r's activation was flagged on link 1
        if replaced:
            after = verifier.check_backward(1, "next", mb, _honest(gen, _center()))
            assert after.reason == "tainted" and after.substitute is not None
        small = 0.05 * _honest(gen, _center())  # what r computes from the momentum (or an attacker's shrunk gradient)
        verdict = verifier.check_backward(0, "r", mb, small)
        assert verdict.substitute is not None  # replaced either way
        assert verdict.flagged == (not replaced), mb
        assert verdict.reason == ("tainted" if replaced else "fence")


def test_a_low_but_positive_align_is_evidence_about_the_input_not_a_flag_on_the_tensor():
    """Recorded in the clean 125-iteration run (session 19): the honest `align` of stage 2's gradients (link 1) sat
    at 0.92-0.95 through the warm-up, so its fence was the IQR floor's, 0.685; then single microbatches on which the
    stage added a large correction (gradients 2-2.7x larger) scored 0.50-0.66: 3 false flags. A residual stage's
    output is its input plus a correction, so a positive cosine, however low, is a large correction: what an honest
    stage does now and then, and often when fed a shrunk input (a white-box attacker upstream). Below its fence and
    above `align_floor` (0) it is no flag on the tensor but evidence against the workers upstream of its sender:
    three such microbatches after one upstream worker from three senders convict it; one sender that does it three
    times convicts itself, which explains the strikes away from the worker upstream (no framing). A reversed output is a flag,
    the sender's own. (`align_floor=1`: the old rule, a flag on the tensor held against sender and upstream.)"""
    for floor in (0.0, 1.0):
        gen = torch.Generator().manual_seed(20)
        verifier = Sentinel(SentinelConfig(warmup=16, window=16, distances="align", bind_projections=8, align_floor=floor))

        def gradient(mb, sender: str, upstream: str, correction: float, sign: float = 1.0):
            out_grad = torch.randn(4, 32, 16, generator=gen)  # what stage 2 was given
            verifier.record_input(mb, 2, BACKWARD, verifier.sketch(out_grad))
            sent = sign * (out_grad + correction * torch.randn(4, 32, 16, generator=gen))
            return verifier.check_backward(1, sender, mb, sent, upstream={1: upstream})

        for i in range(24):
            assert not gradient(i, f"w{i % 4}", f"u{i % 4}", 0.35).flagged  # align about 0.94
        large = [gradient(("large", j), f"w{j}", "u", 1.7) for j in range(3)]  # three senders after upstream u
        assert all(0.3 < dict(v.distances)["align"] < 0.65 for v in large)
        if floor == 0.0:
            assert not any(v.flagged for v in large) and [v.suspects for v in large] == [("u", f"w{j}") for j in range(3)]
        else:
            assert all(v.flagged for v in large) and large[0].suspects == ("u", "w0")
        assert verifier.convicted() == {"u"}
        if floor == 0.0:  # one sender that does it three times after the same honest upstream is convicted, not it
            framing = [gradient(("frame", j), "byz", "u2", 1.7) for j in range(3)]
            assert not any(v.flagged for v in framing) and verifier.convicted() == {"u", "byz"}
        reversed_ = gradient("reversed", "x", "v", 0.35, sign=-1.0)
        assert reversed_.flagged and reversed_.outside == ("align",) and reversed_.suspects == ("x",)


def _stage_stream(gen: torch.Generator, center: torch.Tensor) -> torch.Tensor:
    return center + 0.5 * torch.randn(4, 8, center.shape[0], generator=gen)


def test_a_move_of_the_whole_stage_is_relearned_not_four_convictions_and_a_liar_in_it_is_still_caught():
    """Recorded (25% seed 2, `adaptive`): at iteration 41 the link-1 verifier flagged all four stage-1 relays on
    `sign` (0.125-0.22) with `scale` +0.27..+0.36 and banned them all (three honest): stage 1 had nobody left.
    Replayed here: four replicas of a stage share its parameters; their outputs move together (10 of 64 features
    change sign, the scale grows 1.35x). That is a change of the model: nobody is convicted, the fences relearn
    (the stage's later tensors pass) and later odd tensors convict as before. A replica that sends zeros during
    the move does not move with its stage and is convicted. Without the rule, replicas of the stage are convicted."""
    for liar in (False, True):
        gen = torch.Generator().manual_seed(41)
        verifier = Sentinel(SentinelConfig(warmup=40, window=48, distances="sign,swd,scale"))
        center = torch.linspace(-1.0, 1.0, 64) + 0.01
        for i in range(48):
            verifier.check_forward(1, f"r{i % 4}", i, _stage_stream(gen, center))
        moved = 1.35 * center * torch.where(torch.arange(64) % 6 == 0, -1.0, 1.0)  # sign 10/64 = 0.156
        verdicts = []
        for i in range(48, 80):
            sender = f"r{i % 4}"
            tensor = torch.zeros(4, 8, 64) if liar and sender == "r3" else _stage_stream(gen, moved)
            verdicts.append(verifier.check_forward(1, sender, i, tensor))
        assert any(v.flagged for v in verdicts[:4])  # the move is outside the fences at first
        if not liar:
            assert verifier.convicted() == frozenset() and verifier.banned() == frozenset()
            assert any(v.reason == "drift" for v in verdicts)
            assert not any(v.flagged for v in verdicts[-8:])  # relearned: the moved stage passes
            for i in range(80, 86):  # an odd tensor after the move still convicts its sender
                verifier.check_forward(1, "r0" if i % 2 else "r1", i, _stage_stream(gen, moved))
                verifier.check_forward(1, "r2", 1000 + i, -_stage_stream(gen, moved))
            assert verifier.banned() == {"r2"}
        else:
            assert verifier.banned() == {"r3"}
            assert all(v.flagged for v in verdicts if v.worker == "r3")


def _stage2_after_warm_up():
    """A link-2 verifier warmed up on four stage-2 senders fed by four stage-1 senders in turn, the honest centre of
    their outputs, and an odd output (a scaled centre with every sixth coordinate reversed)."""
    gen = torch.Generator().manual_seed(42)
    verifier = Sentinel(SentinelConfig(warmup=40, window=48, distances="sign,swd,scale"))
    center = torch.linspace(-1.0, 1.0, 64) + 0.01
    for i in range(48):
        verifier.check_forward(2, f"s2r{i % 4}", i, _stage_stream(gen, center), upstream={1: f"s1r{(i // 4) % 4}"})
    return gen, verifier, center, 1.35 * center * torch.where(torch.arange(64) % 6 == 0, -1.0, 1.0)


def test_flags_confined_to_a_minority_upstream_are_no_stage_drift():
    """The adversary that knows the drift rule sits upstream: it feeds honest stage-2 replicas inputs that pass the
    link-1 fences but make their outputs odd at link 2, so that most of stage 2 is flagged and the rule would
    excuse everyone (itself included). The flags then fall only on microbatches through that one of the four
    stage-1 senders: no drift, the strike rule convicts it, and the honest stage-2 replicas keep no strike."""
    gen, verifier, center, odd = _stage2_after_warm_up()
    verdicts = [verifier.check_forward(2, f"s2r{i % 4}", i, _stage_stream(gen, odd), upstream={1: "s1r0"})
                for i in range(48, 52)]
    assert all(v.flagged and v.reason == "fence" for v in verdicts[:3])
    assert verifier.banned() == {"s1r0"}


def test_a_resent_tensor_is_judged_once():
    """Recorded (issue 18's churn run, seed 1): stage 2 stalled and every stage-1 relay resent its outputs to one
    receiver after another, up to 24 times each, so the link's warm-up (200 tensors) held a dozen microbatches of
    one model version and the first step after it flagged and convicted all four stage-1 replicas (iteration 4,
    `swd`). A resend of the same tensor of the same microbatch gets the first verdict back and is not learned
    again; a different tensor for the same microbatch (no input recorded here) is judged again, not learned."""
    gen = torch.Generator().manual_seed(43)
    verifier = Sentinel(SentinelConfig(warmup=40, window=32))
    center = _center()
    for i in range(12):
        first = _honest(gen, center)
        for _ in range(10):
            verdict = verifier.check_forward(1, f"r{i % 4}", i, first)
            assert verdict.reason == "warmup"
    assert verifier.fences(1, FORWARD) is None  # 12 tensors, not 120: still warming up
    for i in range(12, 50):
        verifier.check_forward(1, f"r{i % 4}", i, _honest(gen, center))
    bad = torch.full((4, 8, 16), 7.0)
    once = verifier.check_forward(1, "r1", 60, bad)
    again = verifier.check_forward(1, "r1", 60, bad.clone())
    assert once.flagged and again.flagged and again.bans == ()
    assert verifier.check_forward(1, "r1", 60, -bad).flagged  # another tensor: judged again
    assert verifier.banned() == frozenset()  # one microbatch, one strike


def test_a_constant_output_against_a_varied_input_is_its_senders_own():
    """Recorded (37.5% seed 1, `zeros`): an honest stage-1 relay fed two stage-2 attackers within an iteration; their
    all-zero outputs were flagged (`sign, swd, scale`) and shared with it, three shares, and it was banned with them.
    On an all-zero sketch ``align`` and ``bind`` are undefined, so the reversed-output rule did not apply. No input
    makes a stage answer a constant: the flag is the sender's alone. A constant input (a substitute) excuses it."""
    gen, block, verifier, hop = _residual_setup(44)
    zeros = []
    for mb, attacker in (("m0", "a"), ("m1", "b"), ("m2", "a")):
        x = torch.randn(2, 32, 16, generator=gen)
        assert not hop(mb, "up", 1, x, block(x)).flagged
        zeros.append(hop(mb, attacker, 2, block(x), torch.zeros(2, 32, 16)))
    assert all(v.flagged and v.suspects == (v.worker,) for v in zeros)
    assert verifier.convicted() == frozenset()  # "up" holds no share; a has 2 strikes, b 1
    assert hop("m3", "a", 2, block(torch.randn(2, 32, 16, generator=gen)), torch.zeros(2, 32, 16)).bans == ("a",)
    constant_in = torch.ones(2, 32, 16)  # a stage fed a constant (the verifier's substitute) may answer one
    x = torch.randn(2, 32, 16, generator=gen)
    assert not hop("m4", "up2", 1, x, block(x)).flagged
    excused = hop("m4", "c", 2, constant_in, torch.zeros(2, 32, 16))
    assert excused.flagged and excused.suspects == ("c", "up2")


def test_a_large_correction_after_an_input_seen_shrunk_is_evidence_about_the_upstream_alone():
    """Recorded (37.5% seed 0, `adaptive`, after cb3ba64 made the sender share a large correction): an honest stage-2
    relay's gradients showed large corrections (align 0.67, 0.40, 0.32, 0.18) on four microbatches whose inputs came
    from three different stage-1 attackers, accepted at link 1 while shrunk (`scale` -0.21..-1.85); each attacker
    collected one or two shares, the honest relay four, and it was banned. The verifier saw those inputs arrive
    shrunk, so the correction is explained by them: the upstream workers alone. On inputs of normal scale the
    sender still shares it (the reviewer's framing sender is still convicted)."""
    gen = torch.Generator().manual_seed(45)
    verifier = Sentinel(SentinelConfig(warmup=16, window=16, distances="align,scale", bind_projections=8))

    def microbatch(mb, upstream: str, scale: float, sender: str, correction: float):
        verifier.check_forward(1, upstream, mb, scale * torch.randn(4, 32, 16, generator=gen))
        out_grad = torch.randn(4, 32, 16, generator=gen)
        verifier.record_input(mb, 2, BACKWARD, verifier.sketch(out_grad))
        return verifier.check_backward(1, sender, mb, out_grad + correction * torch.randn(4, 32, 16, generator=gen))

    for i in range(24):  # honest inputs of any scale in [0.15, 1] (a wide `scale` fence), align about 0.94
        microbatch(i, f"u{i % 4}", 0.15 + 0.85 * (i * 7 % 24) / 23, f"w{i % 4}", 0.35)
    shrunk = [microbatch(("s", j), attacker, 0.2, "honest", 1.7) for j, attacker in enumerate("abac")]
    assert not any(v.flagged for v in shrunk) and [v.suspects for v in shrunk] == [(a,) for a in "abac"]
    assert "honest" not in verifier.convicted()
    framing = [microbatch(("f", j), "u0", 1.0, "byz", 1.7) for j in range(3)]
    assert [v.suspects for v in framing[:2]] == [("byz", "u0")] * 2 and verifier.convicted() == {"byz"}


def _warm_stage(verifier: Sentinel, replicas: int, count: int, gen: torch.Generator, center: torch.Tensor) -> int:
    for i in range(count):
        verifier.check_forward(1, f"r{i % replicas}", i, _stage_stream(gen, center))
    return count


def test_changed_resends_neither_flood_the_drift_rule_nor_teach_the_baseline():
    """Review of session 20 (r1): two liars of five replicas resent one microbatch many times, each copy changed by
    1e-6 (judged as new, one drift-window entry each), so the window's live senders shrank to them and one honest
    replica; their sign-flipped tensors then passed as drift, the EMA turned to the attack, and the three honest
    replicas were banned. Now a resend is never remembered or learned again (one entry per sender and microbatch,
    and the stage size is the most senders the window ever held): the liars are banned, the EMA stays honest."""
    gen = torch.Generator().manual_seed(7)
    verifier = Sentinel(SentinelConfig(warmup=40, window=48, distances="sign,swd,scale"))
    center = torch.linspace(-1.0, 1.0, 64) + 0.01
    mb = _warm_stage(verifier, 5, 60, gen, center)
    for rnd in range(6):
        for liar in ("r3", "r4"):
            base = _stage_stream(gen, -center)
            for k in range(24):
                verifier.check_forward(1, liar, ("flood", liar, rnd), base + 1e-6 * k)
        verifier.check_forward(1, f"r{rnd % 3}", mb, _stage_stream(gen, center))
        for liar in ("r3", "r4"):
            verifier.check_forward(1, liar, mb + 1, _stage_stream(gen, -center))
            mb += 2
    assert verifier.banned() == {"r3", "r4"}
    assert torch.nn.functional.cosine_similarity(verifier.reference(1, FORWARD).mean, center, dim=0) > 0.9


def test_fresh_microbatches_cannot_shrink_the_stage_the_drift_rule_counts():
    """The flood of r1 with microbatches that pass instead of resends: two liars of five replicas fill the drift
    window with 45 clean tensors, so it holds one honest replica (whose latest tensor was an outlier) besides them;
    counted from the window alone the stage is three, and two flagged others (the other liar and the outlier) make
    a "move". The stage size is the most senders the window ever held (five): the liars' tampered tensors are
    flagged, not excused."""
    gen = torch.Generator().manual_seed(8)
    verifier = Sentinel(SentinelConfig(warmup=40, window=48, distances="sign,swd,scale"))
    center = torch.linspace(-1.0, 1.0, 64) + 0.01
    bad = center * torch.where(torch.arange(64) % 6 == 0, -1.0, 1.0)
    mb = _warm_stage(verifier, 5, 60, gen, center)
    assert verifier.check_forward(1, "r0", mb, 1.6 * _stage_stream(gen, center)).flagged
    for k in range(45):
        assert not verifier.check_forward(1, ("r3", "r4")[k % 2], ("fresh", k), _stage_stream(gen, center)).flagged
    tampered = [verifier.check_forward(1, liar, mb + 1 + i, _stage_stream(gen, bad))
                for i, liar in enumerate(("r4", "r3"))]
    assert [v.reason for v in tampered] == ["fence", "fence"]


@pytest.mark.parametrize("replicas, liars", [(3, ("r2",)), (5, ("r3", "r4"))])
def test_one_honest_false_flag_does_not_make_a_minority_a_move_of_the_stage(replicas, liars):
    """Review of session 20 (r2): the liars counted themselves toward "more than half of the stage is flagged", so one
    honest outlier in the window (one tensor at 1.6x) was all they needed (3 replicas with 1 liar, 5 with 2): their
    tampered tensors (10 of 64 features flipped) were learned as drift and nobody was banned. Now the judged sender
    never counts for itself and each other sender counts by its latest tensor: the liars are banned."""
    gen = torch.Generator().manual_seed(3)
    verifier = Sentinel(SentinelConfig(warmup=40, window=48, distances="sign,swd,scale"))
    center = torch.linspace(-1.0, 1.0, 64) + 0.01
    bad = center * torch.where(torch.arange(64) % 6 == 0, -1.0, 1.0)
    mb = _warm_stage(verifier, replicas, 60, gen, center)
    verdicts = []
    for i in range(6 * replicas):
        sender = f"r{i % replicas}"
        tensor = _stage_stream(gen, bad) if sender in liars else (1.6 if i == 0 else 1.0) * _stage_stream(gen, center)
        verdicts.append(verifier.check_forward(1, sender, mb + i, tensor))
    assert not any(v.reason == "drift" for v in verdicts)
    assert verifier.banned() == set(liars)


def test_a_liar_in_the_stage_cannot_spread_its_flags_over_honest_upstream_senders_to_fake_a_move():
    """Review of session 20 (r3): the upstream framer s1r0 makes two honest stage-2 replicas' outputs odd, and the
    stage-2 liar s2r3 tampers microbatches that came through the three honest stage-1 senders, so the flagged
    microbatches' upstream senders were a majority of stage 1: drift fired and s2r3's strikes were forgiven. Now an
    upstream sender counts as hit only when it carried flagged microbatches of at least half of the stage's
    distinct senders (two here): only s1r0 is; both liars are banned, the honest replicas are not."""
    gen, verifier, center, odd = _stage2_after_warm_up()
    mb, verdicts = 48, []
    for rnd in range(4):
        for sender, tensor, up in (("s2r0", odd, "s1r0"), ("s2r1", odd, "s1r0"),
                                   ("s2r3", odd, f"s1r{1 + rnd % 3}"), ("s2r2", center, f"s1r{1 + rnd % 3}")):
            verdicts.append(verifier.check_forward(2, sender, mb, _stage_stream(gen, tensor), upstream={1: up}))
            mb += 1
    assert not any(v.reason == "drift" for v in verdicts)
    assert verifier.banned() == {"s1r0", "s2r3"}


def _residual_setup(seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(16, 16, generator=gen) / 4
    block = lambda t: t + torch.tanh(t @ weight)  # noqa: E731
    verifier = Sentinel(SentinelConfig(warmup=16, window=16, bind_projections=8))

    def hop(mb, sender, link, inp, out, upstream=None):
        verifier.record_input(mb, link, FORWARD, verifier.sketch(inp))
        return verifier.check_forward(link, sender, mb, out, upstream=upstream)

    for i in range(20):
        x = torch.randn(2, 32, 16, generator=gen)
        hop(i, f"s1r{i % 4}", 1, x, block(x))
        hop(i, f"s2r{i % 4}", 2, block(x), block(block(x)))
    return gen, block, verifier, hop


@pytest.mark.parametrize("shrink", ["zeros + 1e-5 noise", "zeros + 1e-3 noise", "1e-5 * input", "1e-3 * input"])
def test_an_output_shrunk_to_almost_nothing_is_its_senders_own(shrink):
    """Review of session 20 (r4): the constant rule fired only at a spread 1e-6 of the input's, so zeros plus 1e-5
    noise, or 1e-3 times the input, were flagged on `swd, scale` and shared with the honest stage-1 relay that fed
    the two stage-2 liars, which was banned in their place. An honest residual stage keeps its input's spread
    (1.0-1.25 at initialisation); an output at 1e-2 of it or below is the sender's own."""
    gen, block, verifier, hop = _residual_setup(44)
    make = {"zeros + 1e-5 noise": lambda x: 1e-5 * torch.randn(x.shape, generator=gen),
            "zeros + 1e-3 noise": lambda x: 1e-3 * torch.randn(x.shape, generator=gen),
            "1e-5 * input": lambda x: 1e-5 * x, "1e-3 * input": lambda x: 1e-3 * x}[shrink]
    verdicts = []
    for mb, liar in (("m0", "a"), ("m1", "b"), ("m2", "a"), ("m3", "b")):
        x = torch.randn(2, 32, 16, generator=gen)
        hop(mb, "up", 1, x, block(x))
        verdicts.append(hop(mb, liar, 2, block(x), make(block(x))))
    assert all(v.flagged and v.suspects == (v.worker,) for v in verdicts)
    assert "up" not in verifier.convicted()


def test_an_upstream_liar_cannot_frame_the_honest_head_with_inputs_that_differ_only_in_scale():
    """Review of session 20 (r5b): the head is a LayerNorm then a linear map, and a LayerNorm ignores scale, so the
    stage before it sent tokens a[b,t] * v (one direction, varied scales) once in four microbatches: the input
    varies, the logits are the same for every token (spread 1e-11 of the input's at a ~ 1e4). The liar's tensor was
    flagged (tainting the microbatch) and the constant-output rule then gave the honest head a strike of its own
    each time: banned at the third. Now (1) on a tainted microbatch there is no such rule, and ``bind`` is not
    measured on an output with no token structure left (the CKA of its rounding noise with the input is near 0,
    bind 0.98); (2) on an untainted one (an input that passed, a ~ 1) the rule applies only where the output follows
    the input, which the head's does not (align fence low -0.2): the head's flags stay shared, 2 in 8, no ban."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 48, generator=gen) / 6

    def head(t):  # LayerNorm, then the vocabulary projection
        return ((t - t.mean(-1, keepdim=True)) / (t.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()) @ weight

    direction = torch.randn(32, generator=gen)
    verifier = Sentinel(SentinelConfig(warmup=16, window=16))
    last = 3
    for i in range(20):
        x = torch.randn(4, 32, 32, generator=gen)
        verifier.check_forward(last - 1, f"u{i % 3}", i, x)
        verifier.record_input(i, last, FORWARD, verifier.sketch(x))
        verifier.check_forward(last, f"h{i % 2}", i, head(x))
    for tainted, scale in ((True, 1e4), (False, 1.0)):
        framed = []
        for j in range(16):
            crafted = j % 4 == 0
            x = (scale * (1 + torch.rand(4, 32, 1, generator=gen)) * direction if crafted
                 else torch.randn(4, 32, 32, generator=gen))
            mb = (tainted, j)
            if tainted:  # the liar's tensor is judged (and flagged); else it passed and is only delivered
                assert verifier.check_forward(last - 1, "liar", mb, x).flagged == crafted
            verifier.record_input(mb, last, FORWARD, verifier.sketch(x))
            verdict = verifier.check_forward(last, "h0", mb, head(x))
            if crafted:
                framed.append(verdict)
        assert not tainted or not any(v.flagged for v in framed)
        assert "h0" not in verifier.convicted()


def test_a_changed_resend_of_a_microbatch_on_the_same_input_is_equivocation():
    """Review of session 20: a different tensor for a microbatch already judged was judged as new, so a sender could
    probe the fences with variants of one microbatch (and fill the drift window). An honest stage computes one output
    per input: with the same input delivered, a changed resend is flagged against its sender alone
    ("equivocation"), not learned. With another input delivered meanwhile (its upstream resent), it is judged
    again, not learned."""
    gen, block, verifier, hop = _residual_setup(46)
    x = torch.randn(2, 32, 16, generator=gen)
    first = hop("m", "s2r0", 2, block(x), block(block(x)))
    assert not first.flagged
    probe = verifier.check_forward(2, "s2r0", "m", block(block(x)) * 1.01)
    assert probe.flagged and probe.reason == "equivocation" and probe.suspects == ("s2r0",)
    accepted = verifier.fences(2, FORWARD)
    x2 = torch.randn(2, 32, 16, generator=gen)
    again = hop("m", "s2r0", 2, block(x2), block(block(x2)))  # another input: judged, not learned
    assert not again.flagged and again.reason == "ok" and verifier.fences(2, FORWARD) == accepted


def test_a_move_forgives_this_tracks_strikes_only():
    """Review of session 20: deleting the forgiving left every test passing, and it wiped a worker's whole strike entry
    of a microbatch, so under `data_node` placement (one verifier sees every link) a move seen forward also erased
    a lie on that microbatch's gradient. Here r0 sends a zero gradient on the first microbatch of a move, r1 only
    moves; both then send two zero outputs. r1's strike of the move is taken back (two strikes: kept), r0's gradient
    lie is not (three: banned)."""
    gen = torch.Generator().manual_seed(41)
    verifier = Sentinel(SentinelConfig(warmup=40, window=48, distances="sign,swd,scale"))
    center = torch.linspace(-1.0, 1.0, 64) + 0.01
    for i in range(48):
        verifier.check_forward(1, f"r{i % 4}", i, _stage_stream(gen, center))
        verifier.check_backward(0, f"r{i % 4}", i, 0.1 * _stage_stream(gen, center))
    moved = 1.35 * center * torch.where(torch.arange(64) % 6 == 0, -1.0, 1.0)
    assert verifier.check_forward(1, "r0", 48, _stage_stream(gen, moved)).flagged
    assert verifier.check_backward(0, "r0", 48, torch.zeros(4, 8, 64)).flagged
    verdicts = [verifier.check_forward(1, f"r{i % 4}", i, _stage_stream(gen, moved)) for i in range(49, 64)]
    assert verdicts[0].flagged and any(v.reason == "drift" for v in verdicts)
    for worker, base in (("r0", 100), ("r1", 200)):
        for mb in (base, base + 1):
            assert verifier.check_forward(1, worker, mb, torch.zeros(4, 8, 64)).flagged
    assert verifier.banned() == {"r0"}


def _prenorm_setup(seed: int):
    """A link-1 and a link-2 verifier's view of two pre-norm residual stages (x + tanh(LayerNorm(x) W)), warmed up
    on four honest replicas per stage, and a `hop` that delivers a stage's input and judges its output."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(16, 16, generator=gen) / 2
    norm = lambda t: (t - t.mean(-1, keepdim=True)) / t.std(-1, keepdim=True)  # noqa: E731
    block = lambda t: t + torch.tanh(norm(t) @ weight)  # noqa: E731
    verifier = Sentinel(SentinelConfig(warmup=24, window=24, bind_projections=8))

    def hop(mb, sender, link, inp, out, upstream=None):
        verifier.record_input(mb, link, FORWARD, verifier.sketch(inp))
        return verifier.check_forward(link, sender, mb, out, upstream=upstream)

    for i in range(30):
        x = torch.randn(2, 32, 16, generator=gen)
        hop(i, f"s1r{i % 4}", 1, x, block(x))
        hop(i, f"s2r{i % 4}", 2, block(x), block(block(x)), upstream={1: f"s1r{i % 4}"})
    return gen, block, verifier, hop


def test_a_bias_the_sender_added_to_a_usual_input_is_its_own_flag():
    """Recorded (37.5% seed 1, `bias`): the honest stage-1 relay 9a2ad0 fed two stage-2 attackers, whose outputs
    (x + mean|x|) were flagged on `sign, swd` and shared with it: three shares within two iterations, banned before
    either attacker. A pre-norm stage's correction (output mean minus input mean) ignores a shift of its whole
    input, so a correction above its fence on a usual input is the stage's own: held against the sender alone."""
    gen, block, verifier, hop = _prenorm_setup(46)
    biased = []
    for mb, liar in (("m0", "a"), ("m1", "b"), ("m2", "a"), ("m3", "b")):
        x = torch.randn(2, 32, 16, generator=gen)
        assert not hop(mb, "up", 1, x, block(x)).flagged
        out = block(block(x))
        biased.append(hop(mb, liar, 2, block(x), out + out.abs().mean(), upstream={1: "up"}))
    assert all(v.flagged and v.suspects == (v.worker,) for v in biased)
    assert verifier.convicted() == frozenset()  # a and b have 2 strikes each, "up" none
    x = torch.randn(2, 32, 16, generator=gen)
    hop("m4", "up", 1, x, block(x))
    out = block(block(x))
    assert hop("m4", "a", 2, block(x), out + out.abs().mean(), upstream={1: "up"}).bans == ("a",)


def test_an_honest_stage_fed_an_odd_input_keeps_sharing_its_flags_with_the_upstream_sender():
    """The adversary that knows the rule above sits upstream: it wants an honest stage's flags to be that stage's
    alone (no share for itself, no way for its conviction to clear the honest stage). (1) A shift of every feature
    of the input passes through a pre-norm stage and leaves its correction as it was: the output is flagged but
    the flag stays shared. (2) A per-feature shift (one LayerNorm does not undo) moves the honest correction too,
    but the input's mean is then far from the stage's usual input, so the rule does not apply. (3) Shrunk about
    its own mean (x 0.25; the white-box attacker's move): the mean is usual and the honest correction leaves its
    fence while ``align`` stays inside, but the input's spread is far from usual: the rule does not apply. Each
    time the liar, which fed three honest replicas, collects a share of each one's flag and is convicted, which
    clears them. Without the input guards each flag in (2) and (3) is the replica's alone and the liar is never
    struck; in (1), when the correction is taken as the output mean alone and the guards are off."""
    for shift in ("uniform", "per-feature", "shrunk"):
        gen, block, verifier, hop = _prenorm_setup(47)
        offset = {"uniform": torch.full((16,), 1.5), "per-feature": 1.5 * torch.linspace(-1.0, 1.0, 16)}.get(shift, 0.0)
        framed = []
        for j in range(3):
            x = block(torch.randn(2, 32, 16, generator=gen)) + offset  # the liar's
            if shift == "shrunk":  # about its own mean, which stays as usual
                x = x.mean((0, 1)) + 0.25 * (x - x.mean((0, 1)))
            framed.append(hop(("f", j), f"h{j}", 2, x, block(x), upstream={1: "liar"}))
        assert all(v.flagged and v.suspects == (v.worker, "liar") for v in framed), shift
        assert verifier.convicted() == {"liar"}


def _white_box_shrinks(fence: str, gain: bool, sender_of=lambda i: f"r{i % 8}") -> list[float]:
    """The scale c of each tensor the white-box `adaptive` attacker sent on a residual toy stage (16 features), where
    senders r0-r2 of `sender_of` (microbatch -> sender name) lie from microbatch 40 on."""
    from phalanx.algorithms.sentinel.attacks import LinkView, make_link_attack

    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(16, 16, generator=gen) / 4
    verifier = Sentinel(SentinelConfig(warmup=32, window=32, bind_projections=8, gain=gain, fence=fence,
                                       sender_window=4))
    attack = make_link_attack("adaptive", steps=8)
    scales = []
    for i in range(224):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        out = x + torch.tanh(x @ weight)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        if i >= 40 and sender_of(i) in ("r0", "r1", "r2"):
            probe = lambda t, i=i: verifier.would_accept(1, FORWARD, t, i)  # noqa: E731
            honest, out = out, attack.relay(LinkView("activation", i, i, out, probe)).tensor
            scales.append(float((out * honest).sum() / (honest * honest).sum()))
        assert not verifier.check_forward(1, sender_of(i), i, out).flagged
    return scales


def test_the_white_box_attackers_accepted_shrink_stays_bounded_when_three_of_eight_senders_ride_the_fence():
    """Session 19, 37.5% `adaptive`: the attackers' accepted scale c fell from 0.7 to 0.11 within 12 attacked
    iterations: ``scale`` compares a tensor with the link's EMA, which learns the accepted shrunk tensors, and 3 of 8
    senders hold more than the 25% of the window a pooled Tukey fence withstands, so the fence dropped each time the
    window turned over: the damage grew with the run (here: c at the bisection's floor, 0.107, by the end). The
    per-sender fence (session 22, the default) takes each quartile per sender and the median across senders, which
    3 of 8 senders cannot move: c stays near its first accepted values. The gain option (output spread over input
    spread, under a median fence) bounds it too."""
    lowest = {(fence, gain): min(_white_box_shrinks(fence, gain)[-12:])
              for fence, gain in (("tukey", False), ("senders", False), ("tukey", True))}
    assert lowest[("tukey", False)] < 0.2
    assert lowest[("senders", False)] > 0.6 and lowest[("tukey", True)] > 0.6


def test_the_per_sender_fence_holds_the_shrink_when_the_liars_carry_more_of_the_traffic():
    """The adversary that knows the per-sender fence takes more of the traffic (a faster relay is routed more
    microbatches): 3 of 8 senders carry 45% of the tensors. A pooled median fence (breakdown: 50% of the window's
    values, but the liars' values also drag the EMA it is measured against) falls to the bisection's floor; the
    per-sender fence gives each sender one vote whatever it carries, and ``scale`` is taken against the senders'
    median magnitude, not the EMA: c stays near its first accepted values. (Against the EMA, with the per-sender
    fence: c fell to 0.28-0.5, the EMA dragged down and the honest values, looking grown, carrying the fence.)"""
    def carried(i: int) -> str:  # 9 of every 20 microbatches to the liars r0-r2, the rest to five honest senders
        j = i % 20
        return f"r{j % 3 if j < 9 else 3 + (i // 20 + j) % 5}"

    pooled, senders = (_white_box_shrinks(fence, False, carried) for fence in ("median", "senders"))
    assert min(pooled[-12:]) < 0.2
    assert min(senders) > 0.5 and min(senders[-12:]) > 0.6


def test_honest_relays_that_churn_do_not_hand_the_liars_the_per_sender_fence():
    """Review RC (session 22), MED 2: while 2 of the 5 honest relays kept taking fresh identities (rejoins, replaced
    relays), the 3 liars held half of the votes and the accepted shrink fell to 0.01. An identity votes once it has
    `sender_window` accepted tensors (finding 0, below), so honest relays that last that long between identities
    (here 8 tensors, `sender_window` 4) keep the vote; faster churn does not (not claimed)."""
    def churning(i: int) -> str:  # relays r6 and r7 take a fresh identity every 64 microbatches (8 tensors each)
        return f"r{i % 8}-{i // 64}" if i % 8 >= 6 and i >= 40 else f"r{i % 8}"

    assert min(_white_box_shrinks("senders", False, churning)[-12:]) > 0.6


@pytest.mark.parametrize("per_identity", [1, 4])
def test_liars_cycling_identities_neither_take_the_vote_nor_frame_the_honest_senders(per_identity):
    """Review RC (session 22), finding 0 (the reviewer's test): one vote per identity from its first accepted value
    let 3 liars that took a fresh identity every lie (or every 4) hold most of the votes of a 64-tensor window; the
    fence sat on their values, narrow, and all five honest senders were banned. An identity now votes only after
    `sender_window` accepted tensors, so cycling gains a liar no votes."""
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(16, 16, generator=gen) / 4
    verifier = Sentinel(SentinelConfig(warmup=32, window=64, bind_projections=8, fence="senders"))
    lies, shrinks = {}, []
    for i in range(320):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        out = x + torch.tanh(x @ weight)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        slot, sender = i % 8, f"r{i % 8}"
        if slot < 3 and i >= 40:
            lies[slot] = lies.get(slot, 0) + 1
            sender = f"r{slot}-{(lies[slot] - 1) // per_identity}"  # a fresh identity every per_identity lies
            hi = _smallest_accepted(verifier, 1, out, i)
            out = hi * out
            shrinks.append(hi)
        verifier.check_forward(1, sender, i, out)
    assert not {f"r{s}" for s in range(3, 8)} & verifier.banned()
    assert min(shrinks[-12:]) > 0.5


def _patient_liars(i: int, counts: dict) -> str:
    """Review RC (session 22, `cycling_patient.py`): slots r0-r2 (3/8 of the traffic) lie from microbatch 40; each
    builds 3 identities of `sender_window` (8) accepted lies each, then spreads its lies round-robin over them, so
    that all 9 stay live and vote against 5 honest senders."""
    slot = i % 8
    if slot >= 3 or i < 40:
        return f"r{slot}"
    counts[slot] = counts.get(slot, 0) + 1
    n = counts[slot] - 1
    return f"r{slot}-{n // 8}" if n < 24 else f"r{slot}-{n % 3}"


def _churning_honest(i: int, counts: dict) -> str:
    """Review RC (session 22, MED 2, `churn.py`): honest slots r6 and r7 take a fresh identity every 24 microbatches
    (3 tensors each: fewer than `sender_window`) from microbatch 40 on, the liars r0-r2 keep theirs."""
    slot = i % 8
    return f"r{slot}-{i // 24}" if slot >= 6 and i >= 40 else f"r{slot}"


def test_without_bind_and_align_a_white_box_copy_of_the_senders_median_meets_the_lower_fence():
    """Review RC (session 23), LOW 3: token rows solved so that the tensor's summary is the senders' median (it carries
    nothing of the input) sit at 0 on every distance to the reference. With ``bind``/``align`` they are caught
    (`test_a_copy_of_the_reference_is_still_caught_against_the_senders_median`); without them (an ablation variant)
    only the magnitudes' lower fence sees it, so there it stays against the median too (fails without: 0 of 6)."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(16, 16, generator=gen) / 4
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=32, window=32, distances="sign,swd,scale"))
    for i in range(80):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        verifier.check_forward(1, f"r{i % 4}", i, x + torch.tanh(x @ weight))
    track = verifier._tracks[(1, FORWARD)]
    assert track.against_median
    flagged = []
    for j in range(6):
        reference = verifier._reference(track)
        rows = torch.linalg.lstsq(track.proj.T, reference.quantiles.T).solution.T  # one row per quantile level
        copy = rows.repeat_interleave(4, dim=0).reshape(4, 32, 16)
        flagged.append(verifier.check_forward(1, "copy", ("copy", j), copy).flagged)
    assert all(flagged) and "copy" in verifier.banned()


@pytest.mark.parametrize("sender_of", [_patient_liars, _churning_honest])
def test_the_weighted_vote_gives_identities_no_weight_of_their_own(sender_of):
    """`sender_vote="weighted"`: a sender weighs its tensors in the window (capped at `sender_window`), not one vote
    per identity. With one vote per identity (the default) the patient liars' 9 identities outvote the 5 honest
    senders (all five banned, c at the bisection's floor) and churning honest relays lose their votes (c 0.002):
    both fail with `sender_vote="identity"`."""
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(16, 16, generator=gen) / 4
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=32, window=64, bind_projections=8, sender_vote="weighted"))
    counts, shrinks = {}, []
    for i in range(296):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        out = x + torch.tanh(x @ weight)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        sender = sender_of(i, counts)
        if i % 8 < 3 and i >= 40:
            hi = _smallest_accepted(verifier, 1, out, i)
            out = hi * out
            shrinks.append(hi)
        verifier.check_forward(1, sender, i, out)
    assert not {w for w in verifier.banned() if int(w[1]) >= 3}
    assert min(shrinks[-12:]) > 0.5


def _small_stage_shrinks(verifier: Sentinel, identity) -> list[float]:
    """A stage of 3 relays on the residual toy stage: from microbatch 40 relay r0 sends the smallest scale c of its
    output that `verifier` accepts (bisected), its n-th lie under the identity `identity(n)`. The accepted c of each lie."""
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(16, 16, generator=gen) / 4
    lies, shrinks = 0, []
    for i in range(200):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        out = x + torch.tanh(x @ weight)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        sender = f"r{i % 3}"
        if i % 3 == 0 and i >= 40:
            sender, lies = identity(lies), lies + 1
            hi = _smallest_accepted(verifier, 1, out, i)
            out = hi * out
            shrinks.append(hi)
        verifier.check_forward(1, sender, i, out)
    return shrinks


def test_the_weighted_vote_caps_a_sender_at_its_share_of_a_small_stage():
    """Review RC (session 23), HIGH 1: in a stage of 3 relays one liar spreads its third of the traffic over 3
    identities (round robin, each under `sender_window` tensors in the window). Capped at `sender_window` (8) each
    honest relay (about 21 tensors of the 64-tensor window) weighs 1, and the liar's identities 2.6 together: both
    honest relays were banned (c 0.001). Capped at the stage's fair share, ceil(64 / `stage_relays`), the liar weighs
    its traffic (fails with `stage_relays=0`)."""
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=32, window=64, bind_projections=8, sender_vote="weighted",
                                       stage_relays=3))
    shrinks = _small_stage_shrinks(verifier, lambda lie: f"r0-{lie % 3}")
    assert not {"r1", "r2"} & verifier.banned()
    assert min(shrinks[-12:]) > 0.5


def test_a_liar_that_keeps_a_small_stage_under_three_voters_meets_the_median_fence():
    """Review RC (session 23), on the identity vote: in a stage of 3 relays a liar that takes a fresh identity every 7
    lies never votes, so the stage has 2 voters and fell back to the pooled Tukey fence, whose quartiles a third of the
    traffic moves: the white-box shrink reached c 0.001 (the session-21 drift). With 3 or more live senders the
    fallback is now the pooled median fence (breakdown 50%); fails with the Tukey fallback."""
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=32, window=64, bind_projections=8))
    shrinks = _small_stage_shrinks(verifier, lambda lie: f"r0-{lie // 7}")
    assert len(verifier._voters_of(verifier._tracks[(1, FORWARD)])) == 2
    assert not {"r1", "r2"} & verifier.banned()
    assert min(shrinks[-12:]) > 0.5


def test_three_of_eight_senders_cannot_grow_an_accepted_mean_shift_through_the_reference():
    """Review RC (session 22), HIGH 1: the distances were taken against the link's EMA, which learns every accepted
    tensor, so 3 of 8 senders that add the largest accepted shift along one feature direction (their scale held
    level) dragged it; honest tensors then lay further from it, the fences widened, and the accepted shift grew
    7-fold (simulator: +5.8% in 15 iterations, the stage-1 liars never flagged). Against the median of the live
    senders' latest summaries it stays near its first accepted values. (The reviewer's test, bisections trimmed.)"""
    gen, rng = torch.Generator().manual_seed(21), random.Random(5)
    weight = torch.randn(16, 16, generator=gen) / 4
    u = torch.randn(16, generator=gen)
    u = u / u.norm()
    verifier = Sentinel(SentinelConfig(warmup=32, window=32, bind_projections=8, sender_window=4, fence="senders"))

    def lie(out: torch.Tensor, mb: int, b: float) -> torch.Tensor:  # a * out + b * u, its scale held at 0
        track = verifier._tracks[(1, FORWARD)]
        lo, hi = 0.0, 1.5
        for _ in range(6):
            mid = (lo + hi) / 2
            t = mid * out + b * u
            low = verifier._distances(track, 1, FORWARD, mb, t, summarize(t, track.proj, 32))["scale"] < 0
            lo, hi = (mid, hi) if low else (lo, mid)
        return lo * out + b * u

    shifts = []
    for i in range(160):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        out = x + torch.tanh(x @ weight)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        liar = rng.random() < 0.375
        sender = f"r{rng.randrange(3)}" if liar else f"r{3 + rng.randrange(5)}"
        if i >= 40 and liar:
            lo, hi = 0.0, 32.0
            for _ in range(7):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if verifier.would_accept(1, FORWARD, lie(out, i, mid), i) else (lo, mid)
            honest, out = out, lie(out, i, lo)
            shifts.append(float((out.mean(dim=(0, 1)) - honest.mean(dim=(0, 1))).norm()))
        verifier.check_forward(1, sender, i, out)
    assert max(shifts[-10:]) < 2 * sorted(shifts[:5])[2]


def test_a_sender_fence_is_not_moved_by_a_minority_of_senders_whatever_traffic_they_carry():
    """`sender_fence`: each quartile and the IQR are medians across senders. 3 of 8 senders that put 60% of the
    values on the current lower fence, spread wide (to inflate their own IQR), drag a pooled median fence without
    bound (above its 50% breakdown); the sender fence stays where the honest senders put it."""
    values = [[float(v) for v in range(1, 10)]] * 3
    fence, spread = sender_fence(values, 5.0), 4.0 * 9 / (9 - 4 / 3)  # Q1 3, Q3 7, IQR 4 corrected for 9 values
    assert fence.low == pytest.approx(3 - 5 * spread) and fence.high == pytest.approx(7 + 5 * spread)
    # honest senders alike: as wide as the pooled fence over as many values (uncorrected, 8 values each: 17% narrower,
    # and an honest head relay was banned on the false flags)
    rng = random.Random(2)
    widths = {"senders": 0.0, "pooled": 0.0}
    for _ in range(300):
        rows = [[rng.gauss(0, 1) for _ in range(8)] for _ in range(8)]
        for kind, f in (("senders", sender_fence(rows, 5.0)), ("pooled", tukey_fence(sum(rows, []), 5.0))):
            widths[kind] += f.high - f.low
    assert 0.95 < widths["senders"] / widths["pooled"] < 1.05
    rng = random.Random(1)
    lows = {}
    for kind in ("pooled", "senders"):
        honest = [deque([rng.gauss(0, 1) for _ in range(8)], maxlen=8) for _ in range(5)]
        liars = [deque([rng.gauss(0, 1) for _ in range(8)], maxlen=8) for _ in range(3)]
        pooled = deque([v for d in honest + liars for v in d], maxlen=64)
        for i in range(800):
            fence = median_fence(list(pooled), 5.0) if kind == "pooled" else sender_fence(
                [list(d) for d in honest + liars], 5.0)
            if i % 5 < 3:  # the liars carry 3 of every 5 values: the low edge, or far below it
                value = fence.low if i % 2 else fence.low - abs(fence.low)
                liars[i % 3].append(value)
            else:
                value = rng.gauss(0, 1)
                honest[i % 5].append(value)
            pooled.append(value)
        lows[kind] = (median_fence(list(pooled), 5.0) if kind == "pooled" else sender_fence(
            [list(d) for d in honest + liars], 5.0)).low
    assert lows["pooled"] < -1e6 and lows["senders"] > -15  # honest fence: about -7.4


def _null_directions(verifier: Sentinel, features: int = 16) -> torch.Tensor:
    """Unit vectors orthogonal to every bind direction (a mean along them does not move the bind sketch)."""
    _, _, vh = torch.linalg.svd(verifier._projection(features).T)
    return vh[verifier.config.bind_projections:]


@pytest.mark.parametrize("hidden", ["null-space bias", "noise under the align fence"])
def test_a_liar_cannot_hide_its_added_mean_from_the_rule(hidden):
    """Review RC (session 21), the recorded case of the rule above with the bias hidden from it. (1) HIGH 1: the
    mean was kept on the bind directions alone, so a bias in their null space (half the features on the GPT)
    did not move the correction; now the full per-feature mean is recorded. (2) HIGH 2: the rule stood down when
    the output's ``align`` fell below its fence, which the sender controls: noise of the output's size opted it
    out; now only the input decides. Before either fix every flag was shared and the honest "up" convicted."""
    gen, block, verifier, hop = _prenorm_setup(46)
    verdicts = []
    for mb, liar in (("m0", "a"), ("m1", "b"), ("m2", "a")):
        x = torch.randn(2, 32, 16, generator=gen)
        assert not hop(mb, "up", 1, x, block(x)).flagged
        out = block(block(x))
        if hidden == "null-space bias":
            out = out + 4.0 * _null_directions(verifier)[1]
        else:
            out = out + out.abs().mean() + torch.randn(out.shape, generator=gen) * out.std()
        verdicts.append(hop(mb, liar, 2, block(x), out, upstream={1: "up"}))
    assert all(v.flagged and v.suspects == (v.worker,) for v in verdicts)
    assert "up" not in verifier.convicted()


def test_an_upstream_shift_the_bind_directions_cannot_see_is_not_the_honest_stages_own():
    """Review RC (session 21), MED 3: a stage-1 liar shifts its activations' mean along a null direction of the
    bind directions, inside link 1's fences most of the time; an honest pre-norm stage does not undo a per-feature
    shift, so its outputs are flagged at link 2. With the input's mean on the bind directions alone the gate saw
    a usual input and made each flag the honest replica's own (measured: all three replicas convicted, never the
    liar); on the full mean the input is odd, the flags are shared and the liar is convicted."""
    gen, block, verifier, hop = _prenorm_setup(47)
    shift = 3.2 * _null_directions(verifier)[1]
    for j in range(12):
        x = torch.randn(2, 32, 16, generator=gen)
        hop(("f", j), "liar", 1, x, block(x) + shift)
        down = hop(("f", j), f"h{j % 3}", 2, block(x) + shift, block(block(x) + shift), upstream={1: "liar"})
        assert down.suspects != (down.worker,)
    assert verifier.convicted() == {"liar"}


def test_a_gradient_flag_is_not_made_the_senders_own_by_the_mean_rule():
    """Review RC (session 21), LOW 6: the rule above is argued on activations (a pre-norm stage ignores a shift of
    its input), and a backward flag's shares belong to the forward upstream, whose input its gate does not see;
    so a biased gradient's flag stays shared with the upstream sender, as before the rule (on hC: the sender's)."""
    gen = torch.Generator().manual_seed(46)
    weight = torch.randn(16, 16, generator=gen) / 2
    block = lambda t: t + torch.tanh(t @ weight)  # noqa: E731
    verifier = Sentinel(SentinelConfig(warmup=24, window=24, bind_projections=8))

    def hop(mb, sender, gradient, upstream):
        verifier.record_input(mb, 2, BACKWARD, verifier.sketch(gradient))
        out = block(gradient)
        return verifier.check_backward(1, sender, mb, out if upstream[1] != "up" else out + out.abs().mean(),
                                       upstream=upstream)

    for i in range(30):
        hop(i, f"s2r{i % 4}", torch.randn(2, 32, 16, generator=gen), {1: f"s1r{i % 4}", 2: f"s2r{i % 4}"})
    verdicts = [hop(mb, "a", torch.randn(2, 32, 16, generator=gen), {1: "up", 2: "a"}) for mb in ("m0", "m1")]
    assert all(v.flagged and v.suspects == ("a", "up") for v in verdicts)


def test_a_gradient_grown_by_an_input_seen_shrunk_is_evidence_about_the_upstream_alone():
    """Recorded (37.5% seed 0, `adaptive`, per-sender fences): stage-2 attackers' activations were accepted at link 2
    shrunk (``scale`` -0.51, -0.47), the honest head answered through its LayerNorm with input gradients about 1/c as
    large, flagged on ``swd`` (``scale`` +0.59, +0.63), and shared with the head relay, three in four iterations: it
    was banned before the attackers. The verifier saw the input arrive shrunk, so such a flag goes to the workers
    upstream alone; a gradient grown on a usual input, or grown far beyond what the input's shrink explains, is
    still shared with its sender."""
    gen = torch.Generator().manual_seed(48)
    weight, loss_grad = torch.randn(16, 16, generator=gen) / 4, torch.randn(4, 32, 16, generator=gen)
    verifier = Sentinel(SentinelConfig(warmup=24, window=24, distances="sign,swd,scale"))

    def head_gradient(x: torch.Tensor, grow: float = 1.0) -> torch.Tensor:  # an honest head: LayerNorm, then a map
        x = x.clone().requires_grad_(True)
        out_grad = loss_grad + 0.2 * torch.randn(4, 32, 16, generator=gen)
        (torch.nn.functional.layer_norm(x, (16,)) @ weight * out_grad).sum().backward()
        return grow * x.grad

    def microbatch(mb, upstream: str, head: str, shrink: bool = False, grow: float = 1.0) -> Verdict:
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        if shrink:  # the white-box attacker: the smallest scale link 2's fences accept
            hi = _smallest_accepted(verifier, 2, x, mb)
            x = hi * x
        assert not verifier.check_forward(2, upstream, mb, x).flagged
        return verifier.check_backward(2, head, mb, head_gradient(x, grow))

    for i in range(40):
        assert not microbatch(i, f"u{i % 4}", f"h{i % 4}").flagged
    grown = [microbatch(("s", j), attacker, "h0", shrink=True) for j, attacker in enumerate("ababa")]
    assert all(v.flagged for v in grown) and [v.suspects for v in grown] == [(a,) for a in "ababa"]
    assert "h0" not in verifier.convicted() and verifier.convicted() == {"a"}
    # the sender keeps its share where the input was usual, or where it grew far more than the input shrank
    usual = microbatch("usual", "u1", "h1", grow=2.0)
    beyond = microbatch("beyond", "b", "h2", shrink=True, grow=3.0)
    assert usual.flagged and usual.suspects == ("h1", "u1")
    assert beyond.flagged and "h2" in beyond.suspects


def _replicas_of_one_version(verifier: Sentinel, senders_of, count: int, step: float = 0.0, grow: float = 1.0,
                             start: int = 0, version=lambda n: n, noise: float = 0.01, probe: bool = False
                             ) -> list[Verdict]:
    """Honest replicas whose tensors of one model version nearly coincide (what a small model on fixed data sends):
    tensor n is (grow ** n) * (a fixed sample + version(n) * step along one direction) plus `noise`; senders_of(n)
    names its sender; `probe`: a white-box `would_accept` before each check."""
    drift = torch.randn(16, generator=torch.Generator().manual_seed(5))
    sample = _center() + torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2 + start)
    verdicts = []
    for n in range(start, start + count):
        tensor = (grow ** n) * (sample + version(n) * step * drift + noise * torch.randn(2, 8, 16, generator=gen))
        if probe:
            verifier.would_accept(1, FORWARD, tensor, n)
        verdicts.append(verifier.check_forward(1, senders_of(n), n, tensor))
    return verdicts


def test_an_honest_tensor_close_to_the_senders_median_is_not_flagged_as_a_copy():
    """Session-22 merge: under `fence="senders"` the off-path tests banned an honest relay. Honest replicas' tensors of
    one model version nearly coincide, so against the senders' median (two of three senders' last summaries from the
    current version) an honest tensor sat at log ``swd`` -6 while the fence, made of distances to the lagging EMA,
    was -4.8. The magnitudes' lower fence is for copies of the EMA; against the median it is off (fails with it on:
    r2 banned). The default distances (``bind``/``align`` among them, unmeasured here: no input is recorded)."""
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=12, window=32))
    # three senders, two microbatches each per version, the version moving between them
    verdicts = _replicas_of_one_version(verifier, lambda n: f"r{n % 3}", 120, step=0.3, version=lambda n: n // 6,
                                        noise=1e-3)
    assert verifier._tracks[(1, FORWARD)].against_median
    assert not [v for v in verdicts if v.flagged] and not verifier.banned()


@pytest.mark.parametrize("probe", [False, True])
def test_the_windows_are_measured_again_when_the_reference_changes_kind(probe):
    """The windows hold distances to one reference: when the senders' median takes over from the EMA (a third sender
    reaches `sender_window` tensors) they are measured again against it from the summaries they came from. Here the
    stage grows 10% per tensor, so the EMA lags (``scale`` +0.68) where the median does not (+0.32); with the windows
    left as they were, the first tensors against the median fell outside fences made of distances to the EMA and all
    three honest senders were banned (fails with `_remeasure` a no-op). With a white-box probe before each check
    (review RC, session 23, LOW 4), the probe must not cache fences of the windows not yet measured again (2 honest
    flags when `fences` did not settle the reference first)."""
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=12, window=32))
    two_then_three = lambda n: f"r{n % 2}" if n < 60 else f"r{n % 3}"  # noqa: E731
    verdicts = _replicas_of_one_version(verifier, two_then_three, 60, grow=1.1, probe=probe)
    assert not verifier._tracks[(1, FORWARD)].against_median
    verdicts += _replicas_of_one_version(verifier, two_then_three, 40, grow=1.1, start=60, probe=probe)
    assert verifier._tracks[(1, FORWARD)].against_median
    assert not [v for v in verdicts if v.flagged] and not verifier.banned()


def test_a_copy_of_the_reference_is_still_caught_against_the_senders_median():
    """With the magnitudes' lower fence off against the senders' median, what it caught (a tensor implausibly close to
    the reference) is caught by the tensor's relation to its own input: a constant output equal to the reference's
    mean is shrunk to nothing, an honest output of another microbatch (close to the reference, unrelated to this
    input) fails ``bind``; each liar is banned, no honest sender is flagged."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(16, 16, generator=gen) / 4
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=32, window=32, bind_projections=8))
    stage = lambda x: x + torch.tanh(x @ weight)  # noqa: E731

    def hop(mb, sender, out=None):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        verifier.record_input(mb, 1, FORWARD, verifier.sketch(x))
        return verifier.check_forward(1, sender, mb, stage(x) if out is None else out(x))

    honest = [hop(i, f"r{i % 4}") for i in range(60)]
    track = verifier._tracks[(1, FORWARD)]
    assert track.against_median and not any(v.flagged for v in honest)
    other = stage(_center() + torch.randn(4, 32, 16, generator=gen))
    reference = verifier._reference(track).mean
    for j in range(3):
        assert hop(("constant", j), "c", lambda x: reference.expand(4, 32, 16).clone()).flagged
        assert hop(("replay", j), "p", lambda x: other).flagged
        assert not hop(("honest", j), f"r{j}").flagged
    assert verifier.banned() == {"c", "p"}


def test_a_gradient_as_large_as_its_outlier_input_is_no_strike_and_a_liar_on_a_usual_input_still_is():
    """Recorded (issue 18, `all` seed 2): microbatches 313, 318 and 319 were the largest tensors of every link, and
    stage 2's gradients of them on link 1 were flagged on ``swd`` alone while the gradient delivered to that stage
    spread 0.24-0.27 (log) above the usual inputs, beyond their fence: three shares, the honest relay 5 banned (relay 6
    in session 22, another routing). A tensor that is only as large as its outlier input is flagged (and replaced)
    but held against nobody. A sender that moves a usual input's gradient on ``swd`` (a shift that leaves its
    ``scale`` as usual: only the input check convicts it), or grows an outlier's by far more than the input grew
    (only the ``scale`` bound), is still held to it and convicted."""

    def run(size: float, gain: float = 1.0, shift: float = 0.0) -> tuple[list[Verdict], frozenset[str]]:
        gen = torch.Generator().manual_seed(49)
        weight = torch.randn(16, 16, generator=gen) / 2
        verifier = Sentinel(SentinelConfig(warmup=24, window=24, bind_projections=8))

        def hop(mb, sender: str, size: float = 1.0, gain: float = 1.0, shift: float = 0.0) -> Verdict:
            gradient = size * math.exp(0.03 * torch.randn((), generator=gen).item()) * torch.randn(
                4, 64, 16, generator=gen)
            verifier.record_input(mb, 2, BACKWARD, verifier.sketch(gradient))
            out = gain * (gradient + torch.tanh(gradient @ weight)) + shift * torch.linspace(-1.0, 1.0, 16)
            return verifier.check_backward(1, sender, mb, out, upstream={1: "up", 2: sender})

        for i in range(30):
            hop(i, f"s2r{i % 4}")
        return [hop(("odd", j), "r", size, gain, shift) for j in range(3)], verifier.convicted()

    honest, convicted = run(size=1.6)
    assert all(v.flagged and v.outside == ("swd",) and v.suspects == () for v in honest)
    assert convicted == frozenset()
    for lie in ({"size": 1.0, "shift": 0.6}, {"size": 1.6, "gain": 1.8}):
        lies, convicted = run(**lie)
        assert all(v.flagged and v.outside == ("swd",) and "r" in v.suspects for v in lies), lie
        assert convicted == {"r"}, lie


def _burst_stage(verifier: Sentinel, route, jumps: list[float], noise_seed: int = 0) -> list[Verdict]:
    """Honest replicas of one stage whose tensors of one model version nearly coincide (a fixed sample times the
    model's magnitude, plus 1e-3 noise), 4 microbatches per iteration, the magnitude growing by exp(jumps[it]) per
    iteration (early training); `route(it)` names the sender of each microbatch of iteration `it`."""
    sample = _center() + torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(noise_seed)
    verdicts, level = [], 0.0
    for it, jump in enumerate(jumps):
        level += jump
        for m, sender in enumerate(route(it)):
            tensor = math.exp(level) * (sample + 1e-3 * torch.randn(4, 8, 16, generator=gen))
            verdicts.append(verifier.check_forward(1, sender, (it, m), tensor))
    return verdicts


@pytest.mark.parametrize("noise_seed", [0, 1])
def test_a_relay_banned_by_another_defence_does_not_keep_a_vote_on_the_link(noise_seed):
    """The session-23 merge (hivemind secure-pipeline test, link 2 forward, `fence="senders"`): BTARD banned stage 2's
    all-reduce liar, which this verifier is not told, so its identity stayed in the window; with 8 tensors of the
    warm-up it was a third voter on a link where 2 relays still sent. The senders' median reference then sat on the
    older of the two sending relays' latest versions while one relay sent a burst of one version, their windows held
    near-identical values (the trace: four of 0.254-0.256), and an honest relay was banned on ``scale`` alone when
    the model moved (values 0.34-0.42 here, 0.36-0.45 there). A sender is gone once the relays that sent after it
    have each sent `sender_window` tensors since (`_present`): then the link has 2 voters, the EMA reference and the
    pooled fence. Fails without `_present` (r0 banned, 5 honest flags on ``scale``)."""
    warm_up = [["r0", "r1", "r1", "r2"], ["r1", "r1", "r0", "r2"], ["r0", "r2", "r1", "r1"], ["r1", "r1", "r0", "r2"],
               ["r0", "r2", "r0", "r2"]]  # r1 carries 8 of the 20 warm-up tensors, then is banned elsewhere
    bursts = [["r2"] * 4, ["r0", "r0", "r2", "r2"], ["r0"] * 4]
    route = lambda it: warm_up[it] if it < 5 else bursts[it % 3]  # noqa: E731
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=20, window=64))
    verdicts = _burst_stage(verifier, route, [0.16, 0.24, 0.29, 0.09, 0.23, 0.21, 0.2, 0.03, 0.01, 0.12, 0.22, 0.08],
                            noise_seed)
    assert not [v for v in verdicts if v.flagged] and not verifier.banned()
    assert set(verifier._voters_of(verifier._tracks[(1, FORWARD)])) == {"r0", "r2"}


def test_quiet_identities_do_not_keep_each_other_present_and_a_minority_cannot_take_an_honest_relay_out():
    """`_present` against the liar that shapes it. (1) Two liar identities that go quiet (banned by another defence on
    purpose) are both gone once the two relays still sending have `sender_window` tensors each since and 3 of the
    quiet ones' usual gaps have passed: judged from the most recent sender back, the later quiet one does not keep the
    earlier present. (2) In a stage of 8 relays, 3 liars sending `sender_window` tensors each (and one honest relay
    doing so) since an honest relay's last tensor do not take it out: that needs more than half of those that sent
    after it, so 2 honest relays among them."""
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=5, window=64))
    track = verifier._tracks.setdefault((1, FORWARD), _Track(verifier._names, 64, 1, FORWARD))
    track.accepted_from.extend(["l1", "h1", "l2", "h2"] * 5 + ["h1", "h2"] * 13)
    track.accepted = len(track.accepted_from)
    assert verifier._present(track) == {"h1", "h2", "l1", "l2"}  # l2: 27 tensors since its last, 3 usual gaps 27.6
    track.accepted_from.extend(["h1", "h2"])
    track.accepted += 2
    assert verifier._present(track) == {"h1", "h2"}
    eight = Sentinel(SentinelConfig(fence="senders", warmup=5, window=64))
    track = eight._tracks.setdefault((1, FORWARD), _Track(eight._names, 160, 1, FORWARD))
    relays = ["l0", "l1", "l2", "h3", "h4", "h5", "h6", "h7"]
    track.accepted_from.extend(relays[::-1] * 4 + ["l0", "l1", "l2", "h3"] * 18 + ["h4", "h5", "h6"])
    track.accepted = len(track.accepted_from)
    assert eight._present(track) == set(relays)  # h7 quiet for 82 tensors, more than 3 of its usual gaps
    track.accepted_from.extend(["h4"] * 6)
    track.accepted += 6
    assert eight._present(track) == set(relays) - {"h7"}


def test_a_slow_honest_relay_of_a_small_stage_keeps_its_vote():
    """Review RS (session 24), HIGH 1: a 3-relay stage where the white-box shrinker r0 and the honest r1 carry 45% of
    the traffic each and the honest r2 10% (routing follows measured throughput). r2 was gone whenever the other two
    had sent `sender_window` tensors each since its last one; the stage then had 2 present senders, the pooled Tukey
    fence and the EMA reference, and the shrink fell (c 0.39 here within 160 microbatches, 0.001 in the reviewer's
    longer runs). A sender is gone only after `GONE_GAPS` of its own usual gaps (fails without: c 0.39)."""
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(16, 16, generator=gen) / 4
    routing = random.Random(1)
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=32, window=64, bind_projections=8))
    shrinks = []
    for i in range(160):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        out = x + torch.tanh(x @ weight)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        sender = f"r{i % 3}" if i < 40 else routing.choices(["r0", "r1", "r2"], (0.45, 0.45, 0.10))[0]
        if sender == "r0" and i >= 40:
            hi = _smallest_accepted(verifier, 1, out, i)
            out = hi * out
            shrinks.append(hi)
        verifier.check_forward(1, sender, i, out)
    assert not {"r1", "r2"} & verifier.banned()
    assert min(shrinks) > 0.5

def test_an_upstream_that_grows_its_outputs_within_its_fences_is_still_held_to_the_outlier_inputs_it_made():
    """`_large_as_its_input` against the adversary that knows it (session 24): a stage-1 relay U grows each of its
    outputs as far as link 1's fences accept (white-box bisection: 1.2-1.4x); the stage-2 relays are honest, and their
    outputs of U's microbatches, as large as their inputs, are flagged on link 2 (``swd``) with inputs beyond the
    usual spread. Held against nobody (the rule as landed), they were the only evidence against U (its own tensors
    pass): 15 of 23 such flags over 10 toy seeds went unstruck and U was never banned (3 of 10 without the rule).
    Forward, what the stage was given came from the upstream senders, so such a flag is now theirs alone (the honest
    stage-2 sender is not struck), and U is banned (fails with the flag held against nobody)."""
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(16, 16, generator=gen) / 4, torch.randn(16, 16, generator=gen) / 4
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=48, window=64, bind_projections=8))
    explained = []
    for i in range(90):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        verifier.record_input(i, 1, FORWARD, verifier.sketch(x))
        out, sender = x + torch.tanh(x @ w1), ("U", "h1a", "h1b", "h1c")[i % 4]
        sender = "h1a" if sender in verifier.banned() else sender  # routing avoids a banned relay
        if sender == "U" and i >= 60:
            lo, hi = 1.0, 4.0
            for _ in range(12):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if verifier.would_accept(1, FORWARD, mid * out, i) else (lo, mid)
            out = lo * out
        assert not verifier.check_forward(1, sender, i, out).flagged
        verifier.record_input(i, 2, FORWARD, verifier.sketch(out))
        verdict = verifier.check_forward(2, f"h2{i // 4 % 4}", i, out + torch.tanh(out @ w2), upstream={1: sender})
        if verdict.flagged and verdict.outside == ("swd",):
            explained.append(verdict)
    assert explained and all(v.suspects == ("U",) for v in explained)
    assert verifier.banned() == {"U"}


def test_a_gradient_judged_before_its_activation_is_not_learned():
    """Hivemind secure-pipeline test (session 24, 2 of 7 runs): off the path the copies race, and a stage-2 gradient
    of the zeros attacker's activation reached the link-1 verifier before that activation, at ``scale`` +4.1 (the
    upper side of a gradient's ``scale`` does not flag). Learned, it dragged the EMA: every honest gradient after it
    sat at ``scale`` -2.8 (2 stage-2 relays sending: the EMA was the reference), flagged and shared with the honest
    stage-1 relay, which was banned. A gradient whose
    activation over the same link this verifier has not judged is judged but not learned (fails without: the honest
    gradients after it flagged)."""
    sample = _center() + torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    pattern = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    verifier = Sentinel(SentinelConfig(warmup=24, window=32))

    def wobble() -> float:  # honest magnitudes move a little from one microbatch to the next
        return math.exp(0.05 * torch.randn((), generator=gen).item())

    def microbatch(i: int, early: float = 0.0) -> Verdict:
        sender, receiver = f"s1r{i % 4}", f"s2r{i % 2}"  # 2 stage-2 relays: under 3 voters, the EMA is the reference
        if early:
            verdict = verifier.check_backward(1, receiver, i, early * pattern, upstream={1: sender})
        verifier.check_forward(1, sender, i, wobble() * sample)
        return verdict if early else verifier.check_backward(1, receiver, i, wobble() * pattern, upstream={1: sender})

    for i in range(40):
        assert not microbatch(i).flagged
    assert not microbatch(40, early=60.0).flagged  # inside its fences: only its learning was the harm
    assert not [i for i in range(41, 60) if microbatch(i).flagged]


def _gradients_before_activations(shield: str | None, lie: float) -> tuple[Sentinel, list[Verdict]]:
    """Link 1 of a pipeline, off the path (copies race): 4 stage-1 relays send activations, 4 stage-2 relays send
    the gradients back, each after its activation, for 40 microbatches. Then on 3 microbatches through stage-2
    relay "s2r0" the gradient is judged first: `lie` x a pattern unlike the honest gradients (an honest relay's
    gradient of a zeroed input, or a liar's), with no upstream named (off the path a gradient's upstream is who
    this verifier saw forward). Its activation comes after: zeros from "s1r3" (`shield` None: the link attacker), or
    from `shield` an honest-looking activation, or nothing but a `no_copy` reject (`lie` < 0: the copy withheld)."""
    sample = _center() + torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    pattern = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2))
    odd = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(3)
    verifier = Sentinel(SentinelConfig(warmup=24, window=32))

    def wobble() -> float:
        return math.exp(0.05 * torch.randn((), generator=gen).item())

    for i in range(40):
        verifier.check_forward(1, f"s1r{i % 4}", i, wobble() * sample)
        verifier.check_backward(1, f"s2r{i % 4}", i, wobble() * pattern)
    verdicts = []
    for i in range(40, 43):
        verdicts.append(verifier.check_backward(1, "s2r0", i, abs(lie) * odd))
        if shield is None:
            verdicts.append(verifier.check_forward(1, "s1r3", i, torch.zeros(4, 8, 16)))
        elif lie > 0:
            verdicts.append(verifier.check_forward(1, shield, i, wobble() * sample))
        else:
            verdicts.append(verifier.reject(1, FORWARD, shield, i, "no_copy", torch.zeros(1, 1)))
    return verifier, verdicts


def test_a_gradient_judged_before_its_tainted_activation_strikes_nobody():
    """The launch (session 24, repeat 2): the link-2 verifier judged honest relay 8's gradients of three microbatches
    before their activations, which the zeros attacker had sent: flagged (`swd` alone, computed from the zeroed
    input), held against relay 8 alone (the activation's sender not known yet), and relay 8 was banned. The strikes
    of a gradient judged before its activation wait for that activation's verdict: its taint explains them (fails
    without: "s2r0" banned)."""
    verifier, verdicts = _gradients_before_activations(None, 1.0)
    assert all(v.flagged for v in verdicts[0::2]) and all(v.flagged for v in verdicts[1::2])
    assert "s2r0" not in verifier.banned()
    assert verifier.banned() == {"s1r3"}


def test_a_sender_that_delays_its_activation_does_not_shield_a_gradient_liar():
    """The adversary that knows the rule: stage-1 relay "s1r1" sends its activations after its colluder "s2r0"'s
    lying gradients (x8 of an odd pattern) were judged. Sent at all and clean, they settle the held strikes: the liar is
    banned at its third, on the activation's verdict. Withheld (the receiver's receipt, then `no_copy`): the
    microbatch is tainted, the gradients strike nobody, and the shield takes a strike for each: banned at the third
    (so a liar is shielded on at most 2 microbatches of 8 per identity it burns, and its lies are flagged all along)."""
    verifier, verdicts = _gradients_before_activations("s1r1", 8.0)
    assert all(v.flagged for v in verdicts[0::2]) and not any(v.flagged for v in verdicts[1::2])
    assert verifier.banned() == {"s2r0"} and verdicts[-1].bans == ("s2r0",)
    # each activation's verdict carries the gradient strike it settled, for the verifier's log (review RS s25 5)
    assert all([(g.worker, g.suspects) for g in v.settled] == [("s2r0", ("s1r1", "s2r0"))] for v in verdicts[1::2])
    verifier, verdicts = _gradients_before_activations("s1r1", -8.0)
    assert all(v.flagged for v in verdicts)
    assert verifier.banned() == {"s1r1"}


_BURSTS = {  # review RS s24 HIGH 2 (`docs/notes/repro/s24/burst_random.py`, "all three live"): trial -> (jumps, routes)
    44: ([0.123, 0.163, 0.259, 0.053, 0.068, 0.009, 0.035, 0.003, 0.047, 0.154, 0.297, 0.208, 0.114, 0.122],
         ["r1" * 4, "r1r1r2r0", "r0r2r0r1", "r0" * 4, "r1" * 4, "r1r0r1r1", "r0" * 4, "r2r0r0r0", "r2" * 4]),
    45: ([0.082, 0.146, 0.025, 0.102, 0.022, 0.003, 0.085, 0.035, 0.093, 0.223, 0.011, 0.187, 0.041, 0.239],
         ["r0" * 4, "r2" * 4, "r2r1r0r2", "r0r0r1r1", "r2r1r0r1", "r1r1r1r2", "r2" * 4, "r2" * 4, "r2" * 4]),
    49: ([0.02, 0.124, 0.033, 0.226, 0.153, 0.015, 0.013, 0.221, 0.046, 0.22, 0.189, 0.151, 0.257, 0.181],
         ["r1" * 4, "r2r0r0r1", "r1" * 4, "r1" * 4, "r2" * 4, "r2" * 4, "r2r2r0r2", "r0" * 4, "r2" * 4]),
}


@pytest.mark.parametrize("trial", sorted(_BURSTS))
def test_honest_relays_of_a_small_stage_sending_in_bursts_while_the_model_moves_are_not_banned(trial):
    """Review RS s24 HIGH 2: 3 honest relays, each iteration's 4 microbatches often one relay's burst of one model
    version, the model's log magnitude growing by up to 0.3 per iteration. Each sender's last 8 values are nearly
    one version (its IQR at the floor) while the senders lie apart by the model's move, so the per-sender fence was
    narrower than the senders' own spread and an honest relay was banned on ``scale`` (3 of 60 trials). The fence's
    spread is never below the MAD of the senders' medians (fails without: a relay banned)."""
    warm_up = [["r0", "r1", "r1", "r2"], ["r1", "r1", "r0", "r2"], ["r0", "r2", "r1", "r1"], ["r1", "r1", "r0", "r2"],
               ["r0", "r2", "r0", "r2"]]
    jumps, bursts = _BURSTS[trial]
    route = lambda it: warm_up[it] if it < 5 else [bursts[it - 5][i:i + 2] for i in range(0, 8, 2)]  # noqa: E731
    verifier = Sentinel(SentinelConfig(fence="senders", warmup=20, window=64))
    _burst_stage(verifier, route, jumps, trial)
    assert not verifier.banned()


def test_a_held_gradient_grown_by_an_input_accepted_shrunk_is_still_evidence_about_the_upstream_alone():
    """Review RS s25 1: as `test_a_gradient_grown_by_an_input_seen_shrunk_is_evidence_about_the_upstream_alone`,
    but each of the honest head's gradients is judged before the shrunk activation it was computed from (off the
    path a shrinking sender can arrange it). Its strikes are held, and who they go to is decided when they are
    counted, once the activation's ``scale`` is known: the upstream alone (fails with the blame decided at judging
    time: the head h0, holding a share of every attacker's microbatch, banned)."""
    gen = torch.Generator().manual_seed(48)
    weight, loss_grad = torch.randn(16, 16, generator=gen) / 4, torch.randn(4, 32, 16, generator=gen)
    verifier = Sentinel(SentinelConfig(warmup=24, window=24, distances="sign,swd,scale"))

    def head_gradient(x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        out_grad = loss_grad + 0.2 * torch.randn(4, 32, 16, generator=gen)
        (torch.nn.functional.layer_norm(x, (16,)) @ weight * out_grad).sum().backward()
        return x.grad

    for i in range(40):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        verifier.check_forward(2, f"u{i % 4}", i, x)
        verifier.check_backward(2, f"h{i % 4}", i, head_gradient(x))
    for j, attacker in enumerate("ababa"):
        x = _center() + torch.randn(4, 32, 16, generator=gen)
        x = _smallest_accepted(verifier, 2, x, ("s", j)) * x
        assert verifier.check_backward(2, "h0", ("s", j), head_gradient(x)).flagged
        assert not verifier.check_forward(2, attacker, ("s", j), x).flagged
    assert verifier.convicted() == {"a"}
