"""Aspis / Aspis+ roles: a trusted coordinator and K workers over the transport.

Each iteration the coordinator draws the batch from the public seed, splits it
into files, assigns them (the Aspis subset assignment, an Aspis+ design under
a fresh permutation, DETOX groups, or one file per worker), and asks every
worker, concurrently and with a timeout, for the gradient sums of its files,
sending the current weights with the request. It then builds the agreement
graph, detects, aggregates (Alg. 2), steps its optimizer and goes on. A worker
that is silent, late or sends anything malformed simply has no copy of its
files: it disagrees there, which is evidence the detection weighs; nothing a
worker sends can crash the coordinator.

A Byzantine worker is the same worker with a `LiePolicy`: it recomputes the
public assignment itself, asks its coalition's `Orchestration` which of its
files to distort, and replaces them with a distortion from
`phalanx.algorithms.robust.attacks` (colluders produce identical vectors per file).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad, vmap

from ...algorithms.aspis.attacks import Orchestration
from ...algorithms.aspis.designs import (
    Assignment,
    design_assignment,
    group_assignment,
    iteration_permutation,
    permuted,
    single_assignment,
    steiner_triple_system,
    subset_assignment,
)
from ...algorithms.aspis.detection import (
    Detection,
    WindowDetector,
    aggregate,
    agreement_matrix,
    detect_clique,
    disagreements,
    file_labels,
    shared_counts,
)
from ...algorithms.robust.aggregators import (
    AGGREGATORS,
    coordinate_median,
    make_aggregator,
    rule_parameters,
)
from ...algorithms.robust.attacks import Attack, AttackView
from ...core.errors import ConfigError, Evidence, PeerTimeout, PhalanxError, RemoteError
from ...core.rng import py_stream
from ...core.serialization import decode, encode
from ...training.data import batch_indices
from ...training.device import resolve_device, to_model
from ...training.task import (
    Task,
    compute_gradient,
    flat_params,
    num_params,
    set_flat_grad,
    set_flat_params,
    train_flops,
)
from ...transport.base import Transport
from ..dp.peer import TrainConfig, make_optimizer

log = logging.getLogger(__name__)

TASK_TOPIC = "aspis.task"
RETRY_SECONDS = 1.0  # pause before asking again a worker whose request failed fast
STOP_TOPIC = "aspis.stop"
SCHEMES = ("aspis", "aspis+", "detox", "none")


@dataclass(frozen=True)
class AspisConfig:
    """The protocol: scheme, redundancy, detection parameters, aggregation rule, timeouts."""

    scheme: str = "aspis"  # aspis | aspis+ (Steiner triple system on K points) | detox | none
    r: int = 3  # copies per file (aspis, detox); aspis+ uses the design's block size 3
    q: int = 2  # Byzantines the detection allows for (degree threshold K - q - 1)
    window: int = 15  # aspis+: detection window T_d
    samples_per_file: int = 1
    aggregator: str = "median"  # robust rule after a majority vote (and for scheme none)
    tolerance: float = 1e-5  # copies agree within this relative l2 distance (Aspis Sec. X-B); 0: exact equality, files computed one by one
    timeout: float = 30.0  # seconds a worker has to answer an iteration
    estimate_files: int = 8  # files the coalition recomputes to estimate ALIE/IPM statistics

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"aspis.scheme={self.scheme!r} is not known; allowed: {', '.join(SCHEMES)}")
        if self.r < 1 or (self.scheme in ("aspis", "detox") and self.r % 2 == 0):
            raise ConfigError(f"aspis.r={self.r} must be an odd number >= 1 (majority votes need r' = (r+1)/2)")
        if self.q < 0 or self.window < 1 or self.samples_per_file < 1 or self.estimate_files < 2:
            raise ConfigError("aspis.q must be >= 0, aspis.window and aspis.samples_per_file >= 1, aspis.estimate_files >= 2")
        if self.aggregator not in AGGREGATORS:
            raise ConfigError(f"aspis.aggregator={self.aggregator!r} is not known; allowed: {', '.join(AGGREGATORS)}")
        if not (0 <= self.tolerance < 1 and math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigError("aspis.tolerance must be in [0, 1) and aspis.timeout a finite number > 0")

    def check_workers(self, workers: int) -> None:
        """Raise ConfigError unless the scheme can run on `workers` workers."""
        if 2 * self.q >= workers:
            raise ConfigError(f"aspis.q={self.q} must be < K/2 = {workers / 2} (K = peers - 1 = {workers} workers)")
        if self.scheme == "aspis" and not self.r <= workers:
            raise ConfigError(f"aspis.r={self.r} must be <= K={workers}")
        if self.scheme == "aspis+" and workers % 6 not in (1, 3):
            raise ConfigError(f"aspis+ needs K = peers - 1 = 1 or 3 mod 6 (a Steiner triple system), got K={workers}; try 7, 9, 13, 15")
        if self.scheme == "detox" and workers % self.r:
            raise ConfigError(f"detox needs K = peers - 1 divisible by aspis.r={self.r}, got K={workers}")
        if self.scheme == "none" and self.aggregator == "bulyan" and workers < 4 * self.q + 3:
            raise ConfigError(f"bulyan needs K >= 4q + 3 = {4 * self.q + 3}; lower aspis.q or use another aspis.aggregator")
        if self.scheme == "none" and self.aggregator in ("krum", "multi_krum") and workers <= 2 * self.q + 2:
            raise ConfigError(f"{self.aggregator} needs K > 2q + 2 = {2 * self.q + 2}; lower aspis.q")


@functools.lru_cache(maxsize=8)
def _base_assignment(scheme: str, workers: int, r: int) -> Assignment:
    if scheme == "aspis":
        return subset_assignment(workers, r)
    if scheme == "aspis+":
        return design_assignment(steiner_triple_system(workers), workers)
    if scheme == "detox":
        return group_assignment(workers, r)
    return single_assignment(workers)


def assignment_at(config: AspisConfig, workers: int, run_seed: int, iteration: int) -> Assignment:
    """The public assignment of `iteration` (Aspis+ permutes the design's points every iteration)."""
    base = _base_assignment(config.scheme, workers, config.r)
    if config.scheme != "aspis+":
        return base
    return permuted(base, iteration_permutation(py_stream(run_seed, "aspis-permutation", iteration), workers))


def file_samples(task: Task, run_seed: int, iteration: int, files: int, per_file: int) -> torch.Tensor:
    """Sample indices [files, per_file] of the iteration's public batch: file i is row i."""
    return batch_indices(run_seed, "aspis-batch", iteration, files * per_file, task.dataset_size).view(files, per_file)


def file_gradients(task: Task, model: torch.nn.Module, samples: torch.Tensor, exact: bool) -> torch.Tensor:
    """Per-file sums of the per-sample loss gradients, [files, d].

    exact: one backward pass per file, bit-identical on CPU whatever other
    files a worker holds. Otherwise one vectorised call over the files
    (torch.func.vmap), whose float rounding depends on the batch (about 1e-7
    relative), so copies must then be compared with a tolerance.
    """
    x, y = to_model(model, *task.examples(samples.reshape(-1)))
    x, y = x.view(*samples.shape, *x.shape[1:]), y.view(*samples.shape, *y.shape[1:])
    count = samples.shape[1]
    if exact:
        return torch.stack([compute_gradient(task, model, xs, ys)[0] * count for xs, ys in zip(x, y)])
    params = {name: p.detach() for name, p in model.named_parameters()}

    def file_loss(p: dict, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return task.loss(lambda inputs: functional_call(model, p, (inputs,)), xs, ys) * count

    grads = vmap(grad(file_loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([grads[name].reshape(samples.shape[0], -1) for name in params], dim=1).cpu()


def robust_rule(name: str, q: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`name` applied to a stack whose row count is known only at call time, with f = q (`rule_parameters`, clamped)."""

    def rule(stack: torch.Tensor) -> torch.Tensor:
        n = stack.shape[0]
        if name == "median" and n > 64:
            # Same value as coordinate_median (mean of the two middles for even n); a sort beats its network here.
            ordered = stack.sort(dim=0).values
            return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        params = {"tau": 1.0} if name == "centered_clip" else rule_parameters(name, n, q)
        try:
            return make_aggregator(name, **params)(stack)
        except ValueError:
            return coordinate_median(stack)  # too few surviving files for the rule's f

    return rule


@dataclass
class LiePolicy:
    """A Byzantine worker's plan: the coalition's orchestration and its distortion."""

    plan: Orchestration
    distortion: Attack


class AspisWorker:
    """Answers the coordinator's requests with the gradient sums of its files."""

    def __init__(
        self,
        transport: Transport,
        task: Task,
        config: AspisConfig,
        run_seed: int,
        coordinator: str,
        index: int,
        workers: int,
        policy: LiePolicy | None = None,
        device: str = "cpu",
    ) -> None:
        self.transport = transport
        self.task = task
        self.config = config
        self.run_seed = run_seed
        self.coordinator = coordinator
        self.index = index
        self.workers = workers
        self.policy = policy
        self.model = task.build_model(run_seed).to(resolve_device(device))
        self.dim = num_params(self.model)
        self.stopped = asyncio.Event()
        self.served = 0

    async def run(self) -> None:
        """Serve until the coordinator says stop."""
        self.transport.add_request_handler(TASK_TOPIC, self._serve)
        self.transport.add_message_handler(STOP_TOPIC, self._on_stop)
        await self.stopped.wait()

    def _on_stop(self, sender: str, payload: bytes) -> None:
        if sender == self.coordinator:
            self.stopped.set()

    async def _serve(self, sender: str, payload: bytes) -> bytes:
        if sender != self.coordinator:
            raise RemoteError(Evidence(sender, "malformed", "only the coordinator assigns Aspis tasks"))
        message = decode(payload, sender, self.transport.limits)
        iteration, files, samples, weights = _parse_task(message, sender, self.dim, self.task.dataset_size)
        set_flat_params(self.model, weights)
        grads = file_gradients(self.task, self.model, samples, self.config.tolerance == 0) if files else torch.zeros(0, self.dim)
        await self.transport.charge_compute(train_flops(self.task, self.model, samples.numel()))
        if self.policy is not None and files:
            grads = self._lie(iteration, files, grads)
        self.served += 1
        return encode({"t": iteration, "files": files, "grads": grads.contiguous()})

    def _lie(self, iteration: int, files: list[int], grads: torch.Tensor) -> torch.Tensor:
        assignment = assignment_at(self.config, self.workers, self.run_seed, iteration)
        targets = self.policy.plan.lies_on(iteration, assignment, self.index)
        if not targets:
            return grads
        honest = None
        if self.policy.distortion.omniscient:
            # Batches are public: the coalition recomputes the same few files to estimate the statistics.
            count = len(assignment.files)
            chosen = py_stream(self.run_seed, "aspis-estimate", iteration).sample(range(count), min(self.config.estimate_files, count))
            rows = file_samples(self.task, self.run_seed, iteration, count, self.config.samples_per_file)
            honest = file_gradients(self.task, self.model, rows[sorted(chosen)], self.config.tolerance == 0)
        out = grads.clone()
        for position, file in enumerate(files):
            if file in targets:
                view = AttackView(
                    step=iteration,
                    own_gradient=grads[position],
                    n=self.workers,
                    f=self.policy.plan.q,
                    seed=self.run_seed,
                    peer_index=self.index,
                    honest_gradients=honest,
                )
                out[position] = self.policy.distortion(view)
        return out


def _parse_task(message: object, sender: str, dim: int, dataset_size: int) -> tuple[int, list[int], torch.Tensor, torch.Tensor]:
    def bad(detail: str) -> RemoteError:
        return RemoteError(Evidence(sender, "malformed", detail))

    if not isinstance(message, dict):
        raise bad("task is not a dict")
    iteration, files, samples, weights = (message.get(k) for k in ("t", "files", "samples", "weights"))
    if type(iteration) is not int or not isinstance(files, list) or not all(type(f) is int for f in files):
        raise bad("task needs an int t and a list of int files")
    if not isinstance(samples, torch.Tensor) or samples.dtype != torch.int64 or samples.dim() != 2 or samples.shape[0] != len(files):
        raise bad("task samples must be int64 [files, per_file]")
    if samples.numel() and (int(samples.min()) < 0 or int(samples.max()) >= dataset_size):
        raise bad("task sample index out of range")
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 or weights.shape != (dim,):
        raise bad(f"task weights must be float32 [{dim}]")
    return iteration, files, samples, weights


IterationRecord = dict


class AspisCoordinator:
    """The trusted parameter server: model, batches, assignment, detection, aggregation, steps."""

    def __init__(
        self,
        transport: Transport,
        task: Task,
        config: AspisConfig,
        train: TrainConfig,
        run_seed: int,
        workers: list[str],
    ) -> None:
        config.check_workers(len(workers))
        self.transport = transport
        self.task = task
        self.config = config
        self.train = train
        self.run_seed = run_seed
        self.workers = workers
        self.model = task.build_model(run_seed).to(resolve_device(train.device))
        self.optimizer = make_optimizer(train, self.model.parameters())
        self.dim = num_params(self.model)
        self.robust = robust_rule(config.aggregator, config.q)
        self.window = WindowDetector(len(workers), config.q, config.window) if config.scheme == "aspis+" else None

    async def run(self, iterations: int, on_iteration: Callable[[IterationRecord], None]) -> None:
        """Train for `iterations` iterations, then tell the workers to stop."""
        try:
            for t in range(iterations):
                on_iteration(await self.iteration(t, evaluate=(t + 1) % self.train.eval_every == 0 or t + 1 == iterations))
        finally:
            await asyncio.gather(*(self.transport.send(w, STOP_TOPIC, b"") for w in self.workers))

    async def iteration(self, t: int, evaluate: bool = False) -> IterationRecord:
        clock = self.transport.clock
        started = clock.now()
        k = len(self.workers)
        assignment = assignment_at(self.config, k, self.run_seed, t)
        samples = file_samples(self.task, self.run_seed, t, len(assignment.files), self.config.samples_per_file)
        weights = flat_params(self.model)
        evidence_before = len(self.transport.evidence)
        replies = await asyncio.gather(
            *(self._ask(w, t, assignment.files_of[j], samples, weights) for j, w in enumerate(self.workers))
        )
        collected = clock.now()
        work_start = time.perf_counter()
        copies = [[replies[w].get(i) for w in file] for i, file in enumerate(assignment.files)]
        labels = [file_labels(c, self.config.tolerance) for c in copies]
        shared = shared_counts(assignment)
        disagree = disagreements(assignment, labels)
        detect_start = time.perf_counter()
        detection = self._detect(t, shared, disagree)
        detect_seconds = time.perf_counter() - detect_start
        result = aggregate(assignment, copies, labels, detection, self.robust, self.config.samples_per_file)
        if result.vector is not None:
            set_flat_grad(self.model, result.vector)
            self.optimizer.step()
        work_seconds = time.perf_counter() - work_start
        with torch.no_grad():
            flat = samples.reshape(-1)
            loss = float(self.task.loss(self.model, *to_model(self.model, *self.task.examples(flat))))
        record: IterationRecord = {
            "step": t,
            "loss": loss,
            "detected": detection.success,
            "flagged": sorted(detection.flagged),
            "max_cliques": detection.max_cliques,
            "files": len(assignment.files),
            "files_used": sum(c is not None for c in result.chosen),
            "chosen": [-1 if c is None else c for c in result.chosen],
            "silent": sorted(j for j in range(k) if not replies[j]),
            "evidence": [f"{self.workers.index(e.peer) if e.peer in self.workers else -1}:{e.kind}" for e in self.transport.evidence[evidence_before:]],
            "disagreeing_pairs": int((disagree > 0).sum()) // 2,
            "detect_seconds": detect_seconds,  # wall time of the detection alone
            "coordinator_seconds": work_seconds,  # wall time from the last reply to the optimizer step
            "t_start": started,
            "t_collected": collected,
            "t_end": clock.now(),
        }
        if evaluate:
            record.update({f"test_{key}": value for key, value in self.task.evaluate(self.model).items()})
        return record

    def _detect(self, t: int, shared, disagree) -> Detection:
        if self.config.scheme == "aspis":
            return detect_clique(agreement_matrix(shared, disagree), self.config.q)
        if self.window is not None:
            return self.window.observe(t, shared, disagree)
        return Detection(None, frozenset())

    async def _ask(self, worker: str, t: int, files: tuple[int, ...], samples: torch.Tensor, weights: torch.Tensor) -> dict[int, torch.Tensor]:
        """The worker's file copies by file index; {} when it was silent or malformed (evidence recorded).

        A request that fails fast (no route, a broken stream, no handler yet) is
        retried every second until the timeout: only a worker that never answers
        in time is silent.
        """
        payload = encode({"t": t, "files": list(files), "samples": samples[list(files)].contiguous(), "weights": weights})
        clock = self.transport.clock
        deadline = clock.now() + self.config.timeout
        while True:
            try:
                response = await self.transport.request(worker, TASK_TOPIC, payload, max(deadline - clock.now(), 1e-3))
                return self._parse_reply(worker, t, files, response)
            except RemoteError as exc:
                self.transport.report(exc.evidence)
                return {}
            except PeerTimeout:
                return {}
            except PhalanxError as exc:
                if clock.now() + RETRY_SECONDS >= deadline:
                    log.info("worker %s gave no copies at iteration %d: %s", worker[:8], t, exc)
                    return {}
                await clock.sleep(RETRY_SECONDS)

    def _parse_reply(self, worker: str, t: int, files: tuple[int, ...], response: bytes) -> dict[int, torch.Tensor]:
        message = decode(response, worker, self.transport.limits)

        def bad(detail: str) -> RemoteError:
            return RemoteError(Evidence(worker, "malformed", detail, t))

        if not isinstance(message, dict) or message.get("t") != t or message.get("files") != list(files):
            raise bad("reply does not answer this iteration's files")
        grads = message.get("grads")
        if not isinstance(grads, torch.Tensor) or grads.dtype != torch.float32 or grads.shape != (len(files), self.dim):
            raise bad(f"grads must be float32 [{len(files)}, {self.dim}]")
        finite = torch.isfinite(grads).all(dim=1)
        if not bool(finite.all()):
            self.transport.report(Evidence(worker, "non_finite", f"{int((~finite).sum())} non-finite file gradients", t))
        return {f: grads[p] for p, f in enumerate(files) if bool(finite[p])}
