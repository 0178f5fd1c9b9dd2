"""Butterfly all-reduce on the simulator: exact results, pluggable reduction, silent peers."""

import torch

from phalanx.algorithms.robust.aggregators import coordinate_median, geometric_median
from phalanx.runs.dp.swarm import peer_identity
from phalanx.runtime.rounds.butterfly import (
    AllReduceConfig,
    ButterflyAllReduce,
    TrustedServerAllReduce,
    part_bounds,
)
from phalanx.transport.sim import SimConfig, SimNetwork, run_simulation


def test_part_bounds_cover_the_vector_evenly():
    bounds = part_bounds(10, 4)
    assert bounds == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert part_bounds(3, 5)[-1] == (3, 3)


def _allreduce(n: int, dim: int, reducer=None, crashed: tuple[int, ...] = (), loss: float = 0.0, timeout: float = 5.0, server: int | None = None):
    identities = [peer_identity(7, i) for i in range(n)]
    vectors = [torch.randn(dim, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    results = {}

    async def main():
        network = SimNetwork(SimConfig(seed=1, loss=loss))
        transports = [network.add_peer(identity) for identity in identities]
        kwargs = {"reducer": reducer} if reducer else {}
        if server is None:
            reducers = [ButterflyAllReduce(t, dim, config=AllReduceConfig(timeout=timeout), **kwargs) for t in transports]
        else:
            reducers = [TrustedServerAllReduce(t, dim, identities[server].peer_id, config=AllReduceConfig(timeout=timeout), **kwargs) for t in transports]
        group = sorted(t.peer_id for t in transports)
        for i in crashed:
            network.crash(identities[i].peer_id)

        def factory(i):
            async def run():
                results[i] = await reducers[i](0, vectors[i], group)

            return run

        tasks = [network.spawn(identities[i].peer_id, factory(i)) for i in range(n) if i not in crashed]
        for task in tasks:
            await task
        return network.stats()

    stats = run_simulation(main)
    assert len(results) == n - len(crashed)
    assert (stats["messages_lost"] > 0) == (loss > 0)
    return identities, vectors, results


def test_every_peer_gets_the_mean():
    _, vectors, results = _allreduce(5, 23)
    expected = torch.stack(vectors).mean(0)
    for result in results.values():
        assert torch.allclose(result.vector, expected, atol=1e-6)
        assert result.dropped_senders == () and result.missing_parts == ()


def test_reducer_is_pluggable_per_partition():
    _, vectors, results = _allreduce(5, 23, reducer=coordinate_median)
    expected = coordinate_median(torch.stack(vectors))  # coordinate-wise, so partitioning does not change it
    assert all(torch.allclose(r.vector, expected) for r in results.values())
    assert not torch.allclose(expected, torch.stack(vectors).mean(0))


def test_trusted_server_reduces_whole_vectors():
    # The geometric median is not coordinate-wise: a server that reduced partitions would miss it.
    _, vectors, results = _allreduce(5, 23, reducer=geometric_median, server=2, loss=0.2)
    expected = geometric_median(torch.stack(vectors))
    partitioned = torch.cat([geometric_median(torch.stack(vectors)[:, a:b]) for a, b in part_bounds(23, 5)])
    assert not torch.allclose(expected, partitioned, atol=1e-4)
    for result in results.values():
        assert torch.allclose(result.vector, expected, atol=1e-5)
        assert result.dropped_senders == () and result.missing_parts == ()


def test_lost_messages_are_pulled_again():
    _, vectors, results = _allreduce(6, 40, loss=0.2)
    expected = torch.stack(vectors).mean(0)
    assert all(torch.allclose(r.vector, expected, atol=1e-6) for r in results.values())


def test_silent_peer_is_dropped_from_the_step():
    identities, vectors, results = _allreduce(5, 23, crashed=(2,), timeout=1.0)
    silent = identities[2].peer_id
    group = sorted(i.peer_id for i in identities)
    lo, hi = part_bounds(23, 5)[group.index(silent)]
    alive = torch.stack([v for i, v in enumerate(vectors) if i != 2]).mean(0)
    for result in results.values():
        assert result.dropped_senders == (silent,) and result.missing_parts == (silent,)
        keep = torch.ones(23, dtype=torch.bool)
        keep[lo:hi] = False
        assert torch.allclose(result.vector[keep], alive[keep], atol=1e-6)
        assert torch.equal(result.vector[lo:hi], torch.zeros(hi - lo))  # the silent reducer's slice
