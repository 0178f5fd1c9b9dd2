"""Data-parallel presets: plain functions returning a RunConfig (listed by `phalanx presets`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ...runtime.dp.peer import TrainConfig
from ...runtime.rounds.btard_state import BTARDConfig
from ...runtime.rounds.butterfly import AllReduceConfig
from ..config import NetworkConfig
from .config import ByzantineConfig, FaultsConfig, RunConfig


def digits_dp() -> RunConfig:
    """Digits MLP, 16 simulated peers, butterfly all-reduce (mean), SGD with momentum."""
    return RunConfig(preset="digits-dp", peers=16, steps=150, train=TrainConfig(task="digits-mlp", lr=0.05))


def digits_cnn_dp() -> RunConfig:
    """Digits CNN, 16 peers, Adam."""
    return RunConfig(
        preset="digits-cnn-dp", peers=16, steps=150, train=TrainConfig(task="digits-cnn", optimizer="adam", lr=0.003)
    )


def digits_dp_crash() -> RunConfig:
    """Digits MLP, 16 peers; 3 crash after step 40 and the rest train on."""
    return replace(digits_dp(), preset="digits-dp-crash", faults=FaultsConfig(crash=3, crash_after_step=40))


def digits_dp_churn() -> RunConfig:
    """Digits MLP, 16 peers; each leaves with 5% per step and comes back (state catch-up) with 20% per step."""
    return replace(digits_dp(), preset="digits-dp-churn", faults=FaultsConfig(leave_rate=0.05, join_rate=0.2))


def digits_dp_lossy() -> RunConfig:
    """Digits MLP, 16 peers over links that lose 5% of messages."""
    return replace(digits_dp(), preset="digits-dp-lossy", network=NetworkConfig(loss=0.05))


def digits_dp_hetero() -> RunConfig:
    """Digits MLP, 16 peers with log-normally spread compute speeds and 50 ms links."""
    return replace(
        digits_dp(), preset="digits-dp-hetero", network=NetworkConfig(latency=0.05, bandwidth=12.5e6, flops_spread=0.5)
    )


def mprng_demo() -> RunConfig:
    """Digits MLP, 8 peers running MPRNG after every step; 2 lie in MPRNG and get banned."""
    return replace(
        digits_dp(),
        preset="mprng-demo",
        peers=8,
        steps=30,
        mprng_every=1,
        byzantine=ByzantineConfig(count=2, mprng="withhold"),
    )


def chars_gpt_dp() -> RunConfig:
    """Character-level GPT on the default corpus, 4 peers, Adam."""
    return RunConfig(
        preset="chars-gpt-dp",
        peers=4,
        steps=100,
        train=TrainConfig(task="chars-gpt", optimizer="adam", lr=0.003, batch_size=16, eval_every=20),
        network=NetworkConfig(flops=200e9),
    )


def btard_digits() -> RunConfig:
    """Digits MLP, 16 peers (7 Byzantine, honest unless byzantine.attack is set), BTARD: CenteredClip tau=1, 2 validators."""
    return replace(
        digits_dp(),
        preset="btard-digits",
        allreduce=AllReduceConfig(reducer="centered_clip", tau=1.0),
        btard=BTARDConfig(enabled=True, validators=2),
        byzantine=ByzantineConfig(count=7, attack="none", start_step=10),
    )


DP_PRESETS: dict[str, Callable[[], RunConfig]] = {
    "digits-dp": digits_dp,
    "digits-cnn-dp": digits_cnn_dp,
    "digits-dp-crash": digits_dp_crash,
    "digits-dp-churn": digits_dp_churn,
    "digits-dp-lossy": digits_dp_lossy,
    "digits-dp-hetero": digits_dp_hetero,
    "mprng-demo": mprng_demo,
    "chars-gpt-dp": chars_gpt_dp,
    "btard-digits": btard_digits,
}
