"""Worker processes for bench/allreduce.py: one all-reduce peer per OS process.

A worker runs `1 + rounds` all-reduce rounds (round 0 is the warm-up) in
lock-step with the parent, through one `multiprocessing.Barrier` whose
parties are the swarm's peers plus the parent:

    start-up, prepare round 0        -> wait (ready)
    for each round:                  -> wait (start: the timer starts at the release)
        all-reduce                   -> the timer stops when the result is in hand
                                     -> wait (end: every peer holds its result)
        check the result, prepare the next round's input and expected mean
                                     -> wait (checked)
    report the figures               -> wait (finished)

so the parent can run the rounds of two swarms alternately, and nothing but
the timed all-reduce runs on the machine while a swarm's round is timed.
At the end the worker puts one dict on the results queue: per-round seconds
and correctness figures. Heavy imports (torch, hivemind, phalanx) happen
inside the worker functions, so the parent that imports this module stays
light.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import traceback
from typing import Any

JOIN_TIMEOUT = 120.0  # seconds for a swarm to assemble
STEP_TIMEOUT = 120.0  # generous per-round limits, so that no peer is ever dropped for being slow
POLL_SECONDS = 0.002  # how often a hivemind worker looks at its step's stage (to time matchmaking)
RTOL = ATOL = 1e-5


class Round:
    """One peer's input vector for a round and the exact mean of all peers' inputs."""

    def __init__(self, seed: int, round_index: int, peer: int, n: int, dim: int) -> None:
        import torch

        self.index = round_index
        total = torch.zeros(dim, dtype=torch.float64)
        for p in range(n):  # one input at a time, to keep the memory of 8 workers low
            x = self._input(seed, round_index, p, n, dim)
            total += x
            if p == peer:
                self.vector = x
        self.expected = total.div_(n)

    @staticmethod
    def _input(seed: int, round_index: int, peer: int, n: int, dim: int):
        import torch

        generator = torch.Generator().manual_seed(seed * 1_000_003 + round_index * n + peer)
        return torch.randn(dim, generator=generator, dtype=torch.float32)

    def check(self, result) -> tuple[float, bool]:
        """(max abs error, allclose) of a result against the exact mean; torch.allclose's rule, in place."""
        import torch

        error = result.to(torch.float64).sub_(self.expected).abs_()
        bound = self.expected.abs().mul_(RTOL).add_(ATOL)
        return float(error.max()), bool(error.le(bound).all())


def _use_fork() -> None:
    """Let hivemind start its DHT and averager processes by fork, its default on Linux.

    A process started by the "spawn" method inherits spawn as its default, and
    DecentralizedAverager cannot be pickled for spawn.
    """
    multiprocessing.set_start_method("fork", force=True)


def _report_failure(results, index: int, system: str, sync) -> None:
    results.put({"system": system, "index": index, "error": traceback.format_exc(), "pid": os.getpid()})
    try:
        sync.abort()  # free the others (and the parent) from the barrier: the run is lost anyway
    except Exception:
        pass


# --- phalanx: ButterflyAllReduce over HivemindTransport --------------------------------------------


def phalanx_worker(index: int, settings: dict[str, Any], initial_peers: list[str], sync, results) -> None:
    _use_fork()
    try:
        asyncio.run(_phalanx_worker(index, settings, initial_peers, sync, results))
    except BaseException:
        _report_failure(results, index, "phalanx", sync)


async def _phalanx_worker(index: int, settings: dict[str, Any], initial_peers: list[str], sync, results) -> None:
    import torch

    from phalanx.core.identity import Identity
    from phalanx.runtime.rounds.butterfly import (
        AllReduceConfig,
        ButterflyAllReduce,
        mean_reducer,
    )
    from phalanx.transport.p2p import HivemindTransport

    torch.set_num_threads(1)
    n, dim, rounds, seed = settings["peers"], settings["dim"], settings["rounds"], settings["seed"]
    loop = asyncio.get_running_loop()

    async def wait() -> None:
        # Block in a thread: the event loop keeps serving streams (a slower peer's pulls) meanwhile.
        await loop.run_in_executor(None, sync.wait)

    identity = Identity.from_seed(f"bench-allreduce/{settings['run_id']}/{index}".encode())
    transport = HivemindTransport(identity, run_id=settings["run_id"], initial_peers=initial_peers)
    config = AllReduceConfig(timeout=STEP_TIMEOUT, pull_after=settings["pull_after"])
    allreduce = ButterflyAllReduce(transport, dim, mean_reducer, config)
    await transport.start()
    try:
        if index == 0:
            results.put({"system": "phalanx", "index": 0, "maddrs": transport.visible_maddrs()})
        group = await transport.wait_for_members(n, JOIN_TIMEOUT)
        if len(group) != n:
            raise RuntimeError(f"expected {n} members, the view holds {len(group)}: {group}")
        record: dict[str, list] = {"seconds": [], "errors": [], "all_close": [], "incomplete": []}
        current = Round(seed, 0, index, n, dim)
        await wait()  # ready
        for round_index in range(1 + rounds):
            await wait()  # start
            start = time.perf_counter()
            result = await allreduce(round_index, current.vector, group)
            record["seconds"].append(time.perf_counter() - start)
            await wait()  # end
            error, close = current.check(result.vector)
            record["errors"].append(error)
            record["all_close"].append(close)
            record["incomplete"].append(len(result.dropped_senders) + len(result.missing_parts))
            if round_index < rounds:
                current = Round(seed, round_index + 1, index, n, dim)
            await wait()  # checked
        results.put({"system": "phalanx", "index": index, "evidence": len(transport.evidence), **record})
        await wait()  # finished: shut down only once no swarm is timing a round any more
    finally:
        await transport.stop()


# --- hivemind: DecentralizedAverager ----------------------------------------------------------------


def hivemind_worker(index: int, settings: dict[str, Any], initial_peers: list[str], sync, results) -> None:
    _use_fork()
    try:
        _hivemind_worker(index, settings, initial_peers, sync, results)
    except BaseException:
        _report_failure(results, index, "hivemind", sync)


def _hivemind_worker(index: int, settings: dict[str, Any], initial_peers: list[str], sync, results) -> None:
    import torch
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage
    from hivemind.compression import NoCompression

    torch.set_num_threads(1)
    n, dim, rounds, seed = settings["peers"], settings["dim"], settings["rounds"], settings["seed"]
    dht = DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    averager = None
    try:
        if index == 0:
            results.put({"system": "hivemind", "index": 0, "maddrs": [str(a) for a in dht.get_visible_maddrs()]})
        averager = DecentralizedAverager(
            averaged_tensors=[torch.zeros(dim, dtype=torch.float32)],
            dht=dht,
            start=True,
            prefix="bench_" + settings["run_id"].replace("-", "_"),
            target_group_size=n,
            min_group_size=n,
            min_matchmaking_time=settings["min_matchmaking_time"],
            request_timeout=settings["request_timeout"],
            compression=NoCompression(),
        )
        record: dict[str, list] = {
            "seconds": [],
            "allreduce_start": [],
            "allreduce_end": [],
            "errors": [],
            "all_close": [],
            "incomplete": [],
        }
        current = Round(seed, 0, index, n, dim)
        with averager.get_tensors() as tensors:
            tensors[0].copy_(current.vector)
        sync.wait()  # ready
        for round_index in range(1 + rounds):
            sync.wait()  # start
            start = time.perf_counter()
            control = averager.step(timeout=STEP_TIMEOUT, allow_retries=True, wait=False)
            began = None
            while not control.done():
                if began is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                    began = time.perf_counter()
                time.sleep(POLL_SECONDS)
            control.result()  # raises if the step failed
            end = time.perf_counter()
            record["seconds"].append(end - start)
            record["allreduce_start"].append(end if began is None else began)  # None: done between two polls
            record["allreduce_end"].append(end)
            sync.wait()  # end
            with averager.get_tensors() as tensors:
                error, close = current.check(tensors[0])
                record["errors"].append(error)
                record["all_close"].append(close)
                record["incomplete"].append(0)
                if round_index < rounds:
                    current = Round(seed, round_index + 1, index, n, dim)
                    tensors[0].copy_(current.vector)
            sync.wait()  # checked
        results.put({"system": "hivemind", "index": index, **record})
        sync.wait()  # finished: shut down only once no swarm is timing a round any more
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
