"""`phalanx bench btard` (BTARD's Figure 3): its cells, the trusted-server baselines and the added attacks."""

import csv
import dataclasses

import pytest
import torch

from phalanx.algorithms.robust.attacks import AttackSchedule, DelayedGradient
from phalanx.benchmarks.btard import BTARDBenchConfig, cell_config, full, run_bench
from phalanx.core.errors import ConfigError
from phalanx.runs.config import override
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runtime.dp.peer import DataParallelPeer, TrainConfig
from phalanx.runtime.rounds.butterfly import AllReduceConfig
from phalanx.training.task import make_task
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation


def test_figure3_columns_and_cells():
    config = override(full(), ["defenses=btard_1,server_geomed,no_defense", "validators=1,2"])
    assert config.columns() == [("btard_1_v1", "btard_1", 1), ("btard_1_v2", "btard_1", 2), ("server_geomed", "server_geomed", 1), ("no_defense", "no_defense", 1)]
    assert (config.steps, config.seeds) == (150, 3)
    delayed = cell_config(config, "delayed_gradient", "btard_1", 1, 2)
    assert delayed.byzantine.params == {"delay": config.attack_start} and delayed.seed == 2 and delayed.btard.validators == 1
    server = cell_config(config, "ipm_0.1", "server_geomed", 1, 0)
    assert not server.btard.enabled and server.allreduce.topology == "server" and server.allreduce.reducer == "geometric_median"
    assert server.byzantine.params == {"epsilon": 0.1} and server.byzantine.count == 7
    with pytest.raises(ConfigError, match="validators"):
        BTARDBenchConfig(validators="1,two")
    with pytest.raises(ConfigError, match="topology"):
        override(cell_config(config, "none", "btard_1", 1, 0), ["allreduce.topology=server"])


def test_ipm_01_breaks_the_trusted_geometric_median_but_not_centered_clip(tmp_path):
    # Xie et al. 2020: IPM with epsilon = 0.1 defeats the median-type rules; every
    # gradient stays within tau = 1 of the others, so CenteredClip stays the mean.
    config = BTARDBenchConfig(peers=8, byzantine=3, steps=20, attack_start=0, eval_every=20, attacks="ipm_0.1",
                              defenses="server_cclip_1,server_geomed", jobs=1)
    rows = run_bench(config, tmp_path)
    accuracy = {r["defense"]: r["accuracy"] for r in rows}
    assert accuracy["server_geomed"] < 0.4  # 0.26 measured; 0.79 without the attack
    assert accuracy["server_cclip_1"] > 0.55  # 0.64 measured
    assert "| ipm_0.1 | " in (tmp_path / "table.md").read_text()
    with open(tmp_path / "results.csv") as f:
        assert [r["defense"] for r in csv.DictReader(f)] == ["server_cclip_1", "server_geomed"]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # A finished cell is read back, not rerun; read_only tabulates finished cells and runs nothing.
    assert run_bench(config, tmp_path) == rows
    partial = run_bench(dataclasses.replace(config, attacks="ipm_0.1,alie", read_only=True), tmp_path)
    assert partial[:2] == rows and [r["note"] for r in partial[2:]] == ["not run", "not run"]
    assert "| alie | not run | not run |" in (tmp_path / "table.md").read_text()


@dataclasses.dataclass(kw_only=True)
class RecordedDelay(DelayedGradient):
    """DelayedGradient that also writes down the own gradient of every step."""

    own: dict = dataclasses.field(default_factory=dict)

    def observe(self, view):
        self.own[view.step] = view.own_gradient.clone()
        super().observe(view)


def test_delayed_gradient_peer_sends_its_gradient_from_k_steps_ago():
    task, steps, delay, start = make_task("digits-mlp"), 6, 2, 3
    identities = [peer_identity(0, i) for i in range(3)]
    attack = RecordedDelay(delay=delay, schedule=AttackSchedule(start_step=start))
    received: list[torch.Tensor] = []  # what the trusted server reduced, one stack per step

    def record(stack: torch.Tensor) -> torch.Tensor:
        received.append(stack.clone())
        return stack.mean(dim=0)

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        peers = [
            DataParallelPeer(network.add_peer(identity), task, TrainConfig(), 0, allreduce=AllReduceConfig(topology="server"),
                             reducer=record if i == 0 else None, attack=attack if i == 2 else None, server=identities[0].peer_id)
            for i, identity in enumerate(identities)
        ]
        for run in [network.spawn(identity.peer_id, lambda peer=peer: peer.run(steps)) for identity, peer in zip(identities, peers)]:
            await run

    run_simulation(main)
    group = sorted(identity.peer_id for identity in identities)
    row = 1 + [p for p in group if p != identities[0].peer_id].index(identities[2].peer_id)  # row 0: the server's own
    assert len(received) == steps
    for step in range(steps):
        sent = received[step][row]
        replayed = step - delay if step >= start else step
        assert torch.allclose(sent, attack.own[replayed]), step
        if replayed != step:
            assert not torch.allclose(sent, attack.own[step])
