"""Link attacks: each transform, targets, schedule, fraction and determinism."""

import pytest
import torch

from phalanx.algorithms.sentinel.attacks import (
    ACTIVATION,
    AGGREGATION,
    GRADIENT,
    LinkView,
    make_link_attack,
)
from phalanx.core.errors import ConfigError


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(seed)) + 0.3


def _send(attack, x, step=5, kind=ACTIVATION, mb=1, probe=None):
    return attack.relay(LinkView(kind, step, mb, x, probe))


def test_simple_transforms():
    x = _x()
    assert torch.equal(_send(make_link_attack("zeros"), x).tensor, torch.zeros_like(x))
    assert torch.equal(_send(make_link_attack("zeros", value=2.5), x).tensor, torch.full_like(x, 2.5))
    assert torch.allclose(_send(make_link_attack("scaling"), x).tensor, -x)
    assert torch.allclose(_send(make_link_attack("scaling", factor=3.0), x).tensor, 3 * x)
    flipped = _send(make_link_attack("sign_flip"), x).tensor
    assert torch.equal(torch.sign(flipped), -torch.sign(x))
    assert torch.allclose(flipped.abs(), x.abs().mean().expand_as(x))
    assert torch.allclose(_send(make_link_attack("bias", bias=2.0), x).tensor, x + 2 * x.abs().mean())
    rand = _send(make_link_attack("random", std=3.0), x).tensor
    assert rand.shape == x.shape and abs(rand.std().item() - 3.0) < 0.3


def test_invisible_noise_matches_statistics_and_replaces_a_portion():
    x = _x() * 2
    out = _send(make_link_attack("invisible_noise", portion=0.5), x).tensor
    kept = (out == x).float().mean().item()
    assert 0.4 < kept < 0.6
    full = _send(make_link_attack("invisible_noise", portion=1.0), x).tensor
    assert (full == x).float().mean().item() < 0.01
    assert full.mean().item() == pytest.approx(x.mean().item(), abs=0.25)
    assert full.std().item() == pytest.approx(x.std().item(), rel=0.15)


def test_delay_sends_the_tensor_of_n_steps_ago():
    attack = make_link_attack("delay", delay=3, start_step=4)
    sent = [_send(attack, _x(step), step=step) for step in range(8)]
    assert not any(s.tampered for s in sent[:4])
    assert sent[4].tampered and torch.equal(sent[4].tensor, _x(1))
    assert torch.equal(sent[7].tensor, _x(4))
    # gradients keep their own history
    assert not _send(attack, _x(9), step=8, kind=GRADIENT).tampered  # nothing 3 steps old yet


def test_target_start_fraction_and_determinism():
    x = _x()
    grads_only = make_link_attack("zeros", target="gradients", start_step=2)
    assert not _send(grads_only, x, step=5, kind=ACTIVATION).tampered
    assert _send(grads_only, x, step=5, kind=GRADIENT).tampered
    assert not _send(grads_only, x, step=1, kind=GRADIENT).tampered
    half = make_link_attack("zeros", fraction=0.5, seed=3, worker="r1")
    hits = [_send(half, x, mb=mb).tampered for mb in range(400)]
    assert 150 < sum(hits) < 250
    again = make_link_attack("zeros", fraction=0.5, seed=3, worker="r1")
    assert hits == [_send(again, x, mb=mb).tampered for mb in range(400)]
    r1, r2 = make_link_attack("random", seed=1, worker="a"), make_link_attack("random", seed=1, worker="a")
    assert torch.equal(_send(r1, x).tensor, _send(r2, x).tensor)
    assert not torch.equal(_send(r1, x, mb=2).tensor, _send(r1, x, mb=3).tensor)


def test_mixed_uses_several_attacks():
    attack = make_link_attack("mixed", attacks="zeros,scaling", seed=2)
    x = _x()
    outs = [_send(attack, x, mb=mb).tensor for mb in range(20)]
    zeros = sum(torch.equal(o, torch.zeros_like(x)) for o in outs)
    negs = sum(torch.allclose(o, -x) for o in outs)
    assert zeros + negs == 20 and zeros > 0 and negs > 0


def test_adaptive_stays_just_inside_the_probe():
    x = _x()
    # a verifier that accepts tensors within distance 1.0 of x: the attack goes to about 0.9 of it
    probe = lambda t: (t - x).norm().item() <= 1.0  # noqa: E731
    out = _send(make_link_attack("adaptive", margin=0.9, steps=12), x, probe=probe)
    assert out.tampered and probe(out.tensor)
    assert 0.85 <= (out.tensor - x).norm().item() <= 0.9
    assert torch.allclose(_send(make_link_attack("adaptive"), x).tensor, -x)  # no verifier: full harm


def test_bad_parameters_are_config_errors():
    with pytest.raises(ConfigError, match="unknown link attack"):
        make_link_attack("teleport")
    with pytest.raises(ConfigError, match="target"):
        make_link_attack("zeros", target="optimizer")
    with pytest.raises(ConfigError, match="mixed"):
        make_link_attack("mixed", attacks="zeros,mixed")
    with pytest.raises(ConfigError, match="delay"):
        make_link_attack("delay", delay=0)


def test_mimic_sends_its_ema_plus_shuffled_honest_deviations():
    attack = make_link_attack("mimic", start_step=3, beta=0.5)
    first, second, third = _x(1), _x(2), _x(3)
    assert not _send(attack, first, step=1).tampered and not _send(attack, second, step=2).tampered
    out = _send(attack, third, step=3)
    means = [t.reshape(-1, 16).mean(dim=0) for t in (first, second, third)]
    ema = 0.25 * means[0] + 0.25 * means[1] + 0.5 * means[2]
    assert out.tampered and torch.allclose(out.tensor.reshape(-1, 16).mean(dim=0), ema, atol=1e-5)
    # per feature, the same deviations as the honest tensor, but not at the same tokens
    sent = out.tensor.reshape(-1, 16) - ema
    honest = third.reshape(-1, 16) - means[2]
    assert torch.allclose(sent.sort(dim=0).values, honest.sort(dim=0).values, atol=1e-5)
    assert not torch.allclose(sent, honest)


def test_framing_tampers_like_its_base_and_picks_one_victim():
    attack = make_link_attack("framing", base="zeros", seed=1, worker="w")
    assert torch.equal(_send(attack, _x()).tensor, torch.zeros_like(_x()))
    peers = ["c", "a", "b"]
    assert attack.victim(peers) == attack.victim(list(reversed(peers))) in peers
    with pytest.raises(ConfigError, match="framing base"):
        make_link_attack("framing", base="framing")


def test_aggregation_target_lies_only_in_the_all_reduce():
    x = _x()
    links = make_link_attack("scaling", target="both", factor=-30.0)
    stage = make_link_attack("scaling", target="aggregation", factor=-30.0)
    assert not links.relay(LinkView(AGGREGATION, 5, ("aggregate", 5), x)).tampered  # both: the two links only
    assert links.relay(LinkView(GRADIENT, 5, 1, x)).tampered
    assert not stage.relay(LinkView(ACTIVATION, 5, 1, x)).tampered
    assert torch.equal(stage.relay(LinkView(AGGREGATION, 5, ("aggregate", 5), x)).tensor, -30.0 * x)


def test_budget_steps_outside_the_fences_only_as_often_as_the_strike_rule_allows():
    attack = make_link_attack("budget", spend=2, strike_window=8, steps=12)
    x = _x()
    probe = lambda t: (t - x).norm().item() <= 1.0  # noqa: E731
    full = []
    for mb in range(16):
        for kind in ("activation", "gradient"):  # one strike per microbatch: its gradient is free once spent
            out = attack.relay(LinkView(kind, 5, mb, x, probe))
            assert out.tampered
            full.append(torch.allclose(out.tensor, -x))
            assert full[-1] or probe(out.tensor)
    spent = full[::2]
    assert full[1::2] == spent  # the gradient follows its microbatch's activation
    assert spent[:2] == [True, True] and sum(spent) == 4  # 2 in every window of 8 microbatches, never more
    assert all(sum(spent[i:i + 8]) <= 2 for i in range(len(spent)))
