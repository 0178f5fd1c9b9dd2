"""Aspis presets: plain functions returning an AspisRunConfig (listed by `phalanx presets`)."""

from __future__ import annotations

from collections.abc import Callable

from ...runtime.aspis.roles import AspisConfig
from ...runtime.dp.peer import TrainConfig
from .config import AspisAttackConfig, AspisRunConfig


def aspis_digits() -> AspisRunConfig:
    """Aspis, digits MLP: 1 coordinator + 15 workers, 455 files (r=3); 2 Byzantines run ATT-2 with ALIE."""
    return AspisRunConfig(
        preset="aspis-digits",
        peers=16,
        steps=100,
        aspis=AspisConfig(scheme="aspis", r=3, q=2, samples_per_file=3),
        attack=AspisAttackConfig(orchestration="att2", distortion="alie"),
        train=TrainConfig(task="digits-mlp", lr=0.1, eval_every=10),
    )


def aspis_plus_digits() -> AspisRunConfig:
    """Aspis+, digits MLP: 15 workers on the 2-(15,3,1) design; ATT-3 (q=2, T_b=50) with ALIE, T_d=15."""
    return AspisRunConfig(
        preset="aspis-plus-digits",
        peers=16,
        steps=100,
        aspis=AspisConfig(scheme="aspis+", q=2, window=15, samples_per_file=8),
        attack=AspisAttackConfig(orchestration="att3", distortion="alie", redraw_every=50),
        train=TrainConfig(task="digits-mlp", lr=0.1, eval_every=10),
    )


ASPIS_PRESETS: dict[str, Callable[[], AspisRunConfig]] = {"aspis-digits": aspis_digits, "aspis-plus-digits": aspis_plus_digits}
