"""BTARD's recomputation of a member's gradient: once per (member, step) on each peer, whoever asks for it."""

from collections import Counter

import torch

from phalanx.algorithms.btard.attacks import ProtocolPolicy
from phalanx.algorithms.btard.bans import BanLedger
from phalanx.core.identity import Identity
from phalanx.core.rng import torch_stream
from phalanx.runtime.rounds import btard_verify
from phalanx.runtime.rounds.btard import BTARDConfig, SecureRound
from phalanx.runtime.rounds.btard_state import RecomputeCache
from phalanx.runtime.rounds.butterfly import AllReduceConfig
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation

DIM = 64


def _gradient(peer: str, step: int) -> torch.Tensor:
    return torch.randn(DIM, generator=torch_stream(0, "recompute-cache", peer, step))


class WithholdMeta(ProtocolPolicy):
    """Computes its gradient honestly and broadcasts metadata that names no partition."""

    def report(self, step, norms, s):
        return {}, {}


def test_a_validator_recomputes_its_target_once_when_the_target_also_withholds_its_metadata(monkeypatch):
    # 4 peers, 2 steps; X withholds its metadata and is validator V's target in both steps. V recomputes X's
    # gradient to validate it, and again to fill in X's missing metadata for the sum check (`_fill_missing_meta`):
    # twice per step before the cache, once with it. The others recompute X's only to fill in its metadata.
    identities = [Identity.from_seed(f"recompute/{i}".encode()) for i in range(4)]
    ids = sorted(i.peer_id for i in identities)
    validator, target = ids[0], ids[3]
    calls: Counter[tuple[str, str, int]] = Counter()  # (asking peer, member, step) -> recomputations
    monkeypatch.setattr(btard_verify, "validator_pairs", lambda r, trusted, drawn, m: [(validator, target)])

    def counting(me: str):
        def recompute(peer: str, step: int) -> torch.Tensor:
            calls[(me, peer, step)] += 1
            return _gradient(peer, step)

        return recompute

    async def main():
        network = SimNetwork(SimConfig(seed=0))
        transports = {i.peer_id: network.add_peer(i) for i in identities}
        rounds = {
            me: SecureRound(
                tr, DIM, AllReduceConfig(reducer="centered_clip", tau=1.0, timeout=5.0),
                BTARDConfig(enabled=True, validators=1, timeout=1.0, bans=False), BanLedger(), counting(me),
                WithholdMeta() if me == target else None,
            )
            for me, tr in transports.items()
        }

        def peer_main(me: str):
            async def run():
                for step in range(2):
                    await rounds[me](step, _gradient(me, step), ids)
                await rounds[me].settle()

            return run

        for task in [network.spawn(me, peer_main(me)) for me in ids]:
            await task

    run_simulation(main)
    assert {(me, peer, step) for me, peer, step in calls} == {(me, target, step) for me in ids for step in range(2)}
    assert set(calls.values()) == {1}


def test_the_cache_holds_the_newest_steps_only():
    computed: list[tuple[str, int]] = []

    def compute(peer: str, step: int) -> torch.Tensor:
        computed.append((peer, step))
        return torch.full((2,), float(step))

    cache = RecomputeCache(compute, steps=2)
    assert cache("a", 0) is cache("a", 0)
    cache("b", 1)
    cache("a", 2)  # step 0 is now older than the two newest steps: dropped
    assert sorted(cache.held()) == [("a", 2), ("b", 1)]
    cache("a", 0)  # asked again after it was dropped: computed again, and not kept
    assert sorted(cache.held()) == [("a", 2), ("b", 1)]
    assert computed == [("a", 0), ("b", 1), ("a", 2), ("a", 0)]


def test_the_cache_holds_at_most_per_step_gradients_of_a_step():
    computed: list[tuple[str, int]] = []

    def compute(peer: str, step: int) -> torch.Tensor:
        computed.append((peer, step))
        return torch.zeros(2)

    cache = RecomputeCache(compute, steps=2, per_step=2)
    for peer in "abcd":  # a slanderer accused every member: each verdict recomputes one
        cache(peer, 5)
    assert sorted(cache.held()) == [("a", 5), ("b", 5)]
    cache("d", 5)  # not held: computed again
    assert computed == [("a", 5), ("b", 5), ("c", 5), ("d", 5), ("d", 5)]
