"""Tests for the Byzantine attack policies in phalanx.algorithms.robust.attacks."""

import statistics
from collections.abc import Callable

import pytest
import torch

from phalanx.algorithms.robust import attacks as atk

D = 257
Relabel = Callable[[torch.Tensor], torch.Tensor]
Recompute = Callable[[Relabel], torch.Tensor]


def _view(
    step: int = 3,
    *,
    peer_index: int = 9,
    seed: int = 11,
    dtype: torch.dtype = torch.float32,
    honest: bool = True,
    recompute_gradient: Recompute | None = None,
) -> atk.AttackView:
    """A view for peer ``peer_index`` of 16 (7 Byzantine) with 9 honest gradients that depend only on ``step``."""
    generator = torch.Generator().manual_seed(step * 1000 + peer_index)
    own = torch.randn(D, generator=generator).to(dtype)
    honest_gradients = torch.randn(9, D, generator=torch.Generator().manual_seed(step)).add(0.5).to(dtype)
    return atk.AttackView(
        step=step,
        own_gradient=own,
        n=16,
        f=7,
        seed=seed,
        peer_index=peer_index,
        honest_gradients=honest_gradients if honest else None,
        recompute_gradient=recompute_gradient,
    )


def _relabel_recorder(calls: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> Recompute:
    """A recompute_gradient stand-in that records the relabelled classes 0..9."""

    def recompute(relabel: Relabel) -> torch.Tensor:
        calls.append(relabel(torch.arange(10)))
        return torch.full((D,), 7.0, dtype=dtype)

    return recompute


@pytest.mark.parametrize("name", sorted(atk.ATTACKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_attack_keeps_shape_dtype_and_is_deterministic(name: str, dtype: torch.dtype) -> None:
    def run() -> torch.Tensor:
        attack = atk.make_attack(name, atk.AttackSchedule())
        return attack(_view(dtype=dtype, recompute_gradient=_relabel_recorder([], dtype)))

    first, second = run(), run()
    assert first.shape == (D,)
    assert first.dtype == dtype
    assert torch.equal(first, second)
    assert torch.isfinite(first).all()


def test_inactive_steps_return_the_own_gradient_unchanged() -> None:
    schedule = atk.AttackSchedule(start_step=10, every=3)
    assert [step for step in range(20) if schedule.is_active(step)] == [10, 13, 16, 19]
    attack = atk.SignFlip(schedule=schedule)
    view = _view(step=11)
    assert attack(view) is view.own_gradient
    assert not torch.equal(attack(_view(step=13)), _view(step=13).own_gradient)
    with pytest.raises(ValueError, match="every >= 1"):
        atk.AttackSchedule(every=0)


def test_scaling_attacks_match_their_formulas() -> None:
    view = _view()
    assert torch.equal(atk.SignFlip()(view), -1000.0 * view.own_gradient)
    assert torch.equal(atk.Reversed(c=3.0)(view), -3.0 * view.own_gradient)
    assert torch.equal(atk.Constant(value=-2.5)(view), torch.full((D,), -2.5))
    honest = view.honest_gradients
    assert honest is not None
    assert torch.equal(atk.InnerProductManipulation()(view), -0.1 * honest.mean(dim=0))
    assert torch.equal(atk.InnerProductManipulation(epsilon=0.6)(view), -0.6 * honest.mean(dim=0))
    assert torch.equal(atk.Mimic(target=4)(view), honest[4])


def test_alie_is_mean_minus_z_std() -> None:
    view = _view()
    honest = view.honest_gradients
    assert honest is not None
    # n = 16, f = 7: s = floor(16/2 + 1) - 7 = 2, z = Phi^-1(14/16).
    z = statistics.NormalDist().inv_cdf(14 / 16)
    assert atk.alie_z(16, 7) == z
    assert torch.equal(atk.ALIE()(view), honest.mean(dim=0) - z * honest.std(dim=0))
    assert torch.equal(atk.ALIE(z=2.0)(view), honest.mean(dim=0) - 2.0 * honest.std(dim=0))
    with pytest.raises(ValueError, match="pass z explicitly"):
        atk.alie_z(4, 3)


def test_random_direction_is_shared_by_colluders_and_fixed_per_run() -> None:
    first = atk.RandomDirection()(_view(step=3, peer_index=9))
    other_peer = atk.RandomDirection()(_view(step=50, peer_index=12))
    other_run = atk.RandomDirection()(_view(step=3, seed=12))
    assert torch.equal(first, other_peer)
    assert not torch.allclose(first, other_run)
    assert float(torch.linalg.vector_norm(first)) == pytest.approx(1000.0, rel=1e-5)
    assert float(torch.linalg.vector_norm(atk.RandomDirection(scale=2.0)(_view()))) == pytest.approx(2.0, rel=1e-5)


def test_gaussian_noise_is_fresh_per_peer_and_step() -> None:
    attack = atk.GaussianNoise(std=3.0)
    sample = attack(_view(step=3, peer_index=9))
    assert not torch.equal(sample, attack(_view(step=3, peer_index=10)))
    assert not torch.equal(sample, attack(_view(step=4, peer_index=9)))
    big = attack(atk.AttackView(step=0, own_gradient=torch.zeros(100_000), n=16, f=7, seed=0, peer_index=0))
    assert float(big.mean()) == pytest.approx(0.0, abs=0.05)
    assert float(big.std()) == pytest.approx(3.0, rel=0.02)


def test_label_flip_recomputes_with_reversed_labels() -> None:
    calls: list[torch.Tensor] = []
    out = atk.LabelFlip()(_view(recompute_gradient=_relabel_recorder(calls)))
    assert torch.equal(out, torch.full((D,), 7.0))
    assert torch.equal(calls[0], torch.arange(9, -1, -1))
    with pytest.raises(ValueError, match="recompute_gradient"):
        atk.LabelFlip()(_view())


def test_delayed_gradient_replays_old_gradients() -> None:
    attack = atk.DelayedGradient(delay=3, schedule=atk.AttackSchedule(start_step=2))
    seen = {}
    for step in range(10):
        view = _view(step=step)
        seen[step] = view.own_gradient.clone()
        sent = attack(view)
        if step < 2:
            assert sent is view.own_gradient
        else:
            assert torch.equal(sent, seen[max(step - 3, 0)])
    assert len(attack._history) == 4


def test_delayed_gradient_handles_skipped_steps() -> None:
    attack = atk.DelayedGradient(delay=5)
    grads = {step: _view(step=step).own_gradient for step in (0, 4, 9, 20)}
    sent = {step: attack(_view(step=step)) for step in grads}
    assert torch.equal(sent[9], grads[4])
    assert torch.equal(sent[20], grads[9])


@pytest.mark.parametrize("perturbation", ["std", "unit_vector", "sign"])
def test_min_max_meets_its_constraint_tightly(perturbation: str) -> None:
    view = _view(dtype=torch.float64)
    honest = view.honest_gradients
    assert honest is not None
    sent = atk.MinMax(perturbation=perturbation)(view)
    bound = float(torch.cdist(honest, honest).max())
    reach = float(torch.cdist(sent[None], honest).max())
    assert reach <= bound
    assert reach >= bound * (1 - 1e-5)
    assert not torch.allclose(sent, honest.mean(dim=0))


@pytest.mark.parametrize("perturbation", ["std", "unit_vector", "sign"])
def test_min_sum_meets_its_constraint_tightly(perturbation: str) -> None:
    view = _view(dtype=torch.float64)
    honest = view.honest_gradients
    assert honest is not None
    sent = atk.MinSum(perturbation=perturbation)(view)
    bound = float((torch.cdist(honest, honest) ** 2).sum(dim=1).max())
    total = float((torch.cdist(sent[None], honest) ** 2).sum())
    assert total <= bound
    assert total >= bound * (1 - 1e-5)


def test_min_max_direction_follows_minus_std() -> None:
    view = _view(dtype=torch.float64)
    honest = view.honest_gradients
    assert honest is not None
    shift = atk.MinMax()(view) - honest.mean(dim=0)
    direction = -honest.std(dim=0)
    cosine = float(shift.dot(direction) / (shift.norm() * direction.norm()))
    assert cosine == pytest.approx(1.0, abs=1e-9)


def test_omniscient_attacks_need_honest_gradients() -> None:
    omniscient = sorted(name for name, kind in atk.ATTACKS.items() if kind.omniscient)
    assert omniscient == ["alie", "ipm", "mimic", "min_max", "min_sum"]
    for name in omniscient:
        with pytest.raises(ValueError, match="honest_gradients"):
            atk.make_attack(name, atk.AttackSchedule())(_view(honest=False))


def test_make_attack_validates_names_and_parameters() -> None:
    attack = atk.make_attack("sign_flip", atk.AttackSchedule(start_step=5), scale=2.0)
    assert isinstance(attack, atk.SignFlip) and attack.scale == 2.0 and attack.schedule.start_step == 5
    with pytest.raises(ValueError, match="unknown attack 'nope'.*'alie'"):
        atk.make_attack("nope", atk.AttackSchedule())
    with pytest.raises(ValueError, match="bad parameters for attack 'alie'"):
        atk.make_attack("alie", atk.AttackSchedule(), epsilon=1.0)
    with pytest.raises(ValueError, match="unknown perturbation 'nope'"):
        atk.make_attack("min_max", atk.AttackSchedule(), perturbation="nope")
