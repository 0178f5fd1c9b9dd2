"""BTARD: reducer config, secure round, verifications, bans, attacks, admission."""

import dataclasses

import pytest
import torch

from phalanx.algorithms.attacks import Attack
from phalanx.algorithms.reducers import make_reducer
from phalanx.config import override
from phalanx.core.errors import ConfigError
from phalanx.experiments.swarm import peer_identity
from phalanx.presets import get_preset
from phalanx.runtime.butterfly import AllReduceConfig
from phalanx.runtime.dp_peer import DataParallelPeer, TrainConfig
from phalanx.training.task import make_task
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation


def test_reducer_config_names_rules_and_rejects_unknown():
    config = override(get_preset("digits-dp"), ["allreduce.reducer=centered_clip", "allreduce.tau=10"])
    reduce = config.allreduce.build_reducer()
    xs = torch.tensor([[0.0, 0.0], [1.0, 0.0], [100.0, 0.0]])
    assert reduce(xs)[0].item() == pytest.approx(make_reducer("centered_clip", tau=10.0)(xs)[0].item())
    assert reduce(xs)[0].item() < 20  # clipped, unlike the mean (33.7)
    assert make_reducer("centered_clip", tau=float("inf"))(xs)[0].item() == pytest.approx(101 / 3)
    assert make_reducer("trimmed_mean", f=5)(xs)[0].item() == 1.0  # trim clamped to what 3 rows allow
    with pytest.raises(ConfigError, match="allreduce.reducer"):
        override(get_preset("digits-dp"), ["allreduce.reducer=average"])
    with pytest.raises(ConfigError, match="allreduce.tau"):
        AllReduceConfig(tau=0.0)


@dataclasses.dataclass(kw_only=True)
class Truncate(Attack):
    """A peer that sends a gradient 7 entries short, so its last part has the wrong length."""

    def forge(self, view):
        return view.own_gradient[:-7]


def test_short_vector_from_the_last_partition_owner_is_evidence_not_a_crash():
    identities = [peer_identity(0, i) for i in range(4)]
    last = max(range(4), key=lambda i: identities[i].peer_id)
    task = make_task("digits-mlp")
    peers = []

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        for i, identity in enumerate(identities):
            attack = Truncate() if i == last else None
            peers.append(DataParallelPeer(network.add_peer(identity), task, TrainConfig(), 0, attack=attack))
        tasks = [network.spawn(identities[i].peer_id, lambda i=i: peers[i].run(3)) for i in range(4)]
        for t in tasks:
            await t

    run_simulation(main)
    assert all(p.step == 3 for p in peers)  # this stack of unequal rows used to crash the run
    assert all(torch.isfinite(p).all() for peer in peers for p in peer.model.parameters())
    # The short part is the villain's own partition: nobody else receives it, so there is no evidence.
    assert [e for peer in peers for e in peer.transport.evidence] == []
