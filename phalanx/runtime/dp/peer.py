"""A data-parallel peer: compute a public-batch gradient, all-reduce, step.

The same class runs in the simulator and over hivemind; it sees only the
transport interface. A Byzantine peer is this same peer with an `attack`
policy that rewrites what it sends; nothing marks it to the others.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...algorithms.btard.attacks import ProtocolPolicy
from ...algorithms.btard.bans import BanLedger
from ...algorithms.robust.attacks import Attack, AttackView
from ...core.errors import ConfigError
from ...training.device import resolve_device
from ...training.plugin import TaskConfig, load_task
from ...training.task import (
    TASKS,
    Task,
    compute_gradient,
    flat_params,
    make_task,
    num_params,
    set_flat_grad,
    set_flat_params,
    train_flops,
)
from ...transport.base import Transport
from ..rounds.btard import BTARDConfig, SecureResult, SecureRound
from ..rounds.butterfly import (
    AllReduceConfig,
    AllReduceResult,
    ButterflyAllReduce,
    Reducer,
    TrustedServerAllReduce,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    task: str = "digits-mlp"
    batch_size: int = 32
    optimizer: str = "sgd"  # sgd (with momentum) or adam
    lr: float = 0.1
    momentum: float = 0.9
    eval_every: int = 10  # evaluate on the held-out split every k steps (evaluating peers only)
    corpus: str = ""  # chars-gpt only: a text file to train on ("" = the default corpus built from Python's docs)
    device: str = "cpu"  # cpu | cuda | auto (cuda when one is visible): where models train; all messages stay CPU float32

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"train.task={self.task!r} is not known; allowed: {', '.join(TASKS)}")
        if self.corpus and self.task != "chars-gpt":
            raise ConfigError(f"train.corpus is only used by train.task='chars-gpt', not {self.task!r}")
        if self.corpus and not Path(self.corpus).is_file():
            raise ConfigError(f"train.corpus={self.corpus!r} is not a readable file; name a text file")
        if self.optimizer not in ("sgd", "adam"):
            raise ConfigError(f"train.optimizer={self.optimizer!r} is not allowed; use 'sgd' or 'adam'")
        if self.batch_size < 1:
            raise ConfigError(f"train.batch_size={self.batch_size} must be >= 1")
        if not 0 < self.lr < float("inf"):
            raise ConfigError(f"train.lr={self.lr} must be a finite number > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"train.momentum={self.momentum} must be in [0, 1)")
        if self.eval_every < 1:
            raise ConfigError(f"train.eval_every={self.eval_every} must be >= 1")
        resolve_device(self.device)


def task_of(config: TrainConfig, plugin: TaskConfig = TaskConfig()) -> Task:
    """The plug-in task `plugin` names, else the built-in one of `config` (with its corpus for chars-gpt)."""
    if plugin.enabled:
        return load_task(plugin)
    return make_task(config.task, corpus=config.corpus) if config.corpus else make_task(config.task)


def make_optimizer(config: TrainConfig, params) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)


StepRecord = dict


class DataParallelPeer:
    def __init__(
        self,
        transport: Transport,
        task: Task,
        config: TrainConfig,
        run_seed: int,
        *,
        allreduce: AllReduceConfig = AllReduceConfig(),
        reducer: Reducer | None = None,
        attack: Attack | None = None,
        colluders: int = 0,
        evaluate: bool = False,
        btard: BTARDConfig = BTARDConfig(),
        policy: ProtocolPolicy | None = None,
        server: str | None = None,
    ) -> None:
        self.transport = transport
        self.task = task
        self.config = config
        self.run_seed = run_seed
        self.attack = attack
        self.colluders = colluders  # the f an attack assumes (ALIE's z depends on it)
        self.evaluate = evaluate
        self.ledger = BanLedger()
        self.model = task.build_model(run_seed).to(resolve_device(config.device))  # every replica starts from the same public seed
        self.optimizer = make_optimizer(config, self.model.parameters())
        self.dim = num_params(self.model)
        self.flops = train_flops(task, self.model, config.batch_size)
        if btard.enabled:
            self.allreduce = SecureRound(transport, self.dim, allreduce, btard, self.ledger, self._public_gradient, policy)
        elif allreduce.topology == "server":
            if server is None:
                raise ConfigError("allreduce.topology='server' needs the trusted server's peer id (DataParallelPeer(server=...))")
            self.allreduce = TrustedServerAllReduce(transport, self.dim, server, reducer or allreduce.build_reducer(), allreduce)
        else:
            self.allreduce = ButterflyAllReduce(transport, self.dim, reducer or allreduce.build_reducer(), allreduce)
        self.step = 0
        self.admit: Callable[[int, list[str]], list[str]] | None = None  # who trains at a step (catch-up's roster)
        self.on_update: list[Callable[[int, torch.Tensor], None]] = []  # told each step's applied update
        self._params_at: dict[int, torch.Tensor] = {}  # BTARD: parameters each recent step's gradients were taken at
        self._scratch: torch.nn.Module | None = None  # BTARD: model that validators recompute gradients on
        self.on_result: list[Callable[[int, AllReduceResult], None]] = []  # told each step's all-reduce outcome

    def group(self, step: int | None = None) -> list[str]:
        """This step's group: current members that are admitted and not banned, in sorted order."""
        members = self.transport.members()
        if self.admit is not None:
            members = self.admit(self.step if step is None else step, members)
        return self.ledger.filter(members)

    async def run(self, steps: int) -> None:
        while self.step < steps:
            if self.ledger.is_banned(self.transport.peer_id):
                break
            await self.train_step(self.step)
            self.step += 1
        await self.settle()

    async def settle(self) -> None:
        """BTARD: resolve every pending background verification (a peer that stops)."""
        if isinstance(self.allreduce, SecureRound):
            await self.allreduce.settle()

    async def finish(self, record: StepRecord) -> None:
        """BTARD: after the last step, resolve the pending verifications; their bans go into `record`."""
        if isinstance(self.allreduce, SecureRound):
            await self.allreduce.settle()
            record["bans"] = record.get("bans", []) + [dataclasses.asdict(b) for b in self.allreduce.take_bans()]
            record["banned"] = list(self.ledger.banned)

    async def train_step(self, step: int) -> StepRecord:
        me = self.transport.peer_id
        clock = self.transport.clock
        started = clock.now()
        group = self.group(step)
        self.transport.board.prune(step - 2)  # broadcasts older than two steps are settled
        x, y = self.task.batch(self.run_seed, me, step, self.config.batch_size)
        if isinstance(self.allreduce, SecureRound):
            self._params_at = {k: v for k, v in self._params_at.items() if k >= step - 2}
            self._params_at[step] = flat_params(self.model)
        gradient, loss = compute_gradient(self.task, self.model, x, y)
        await self.transport.charge_compute(self.flops)
        computed = clock.now()
        if self.attack is not None:
            gradient = self.attack(self._attack_view(step, gradient, group, x, y))
        result = await self.allreduce(step, gradient, group)
        for listener in self.on_result:
            listener(step, result)
        set_flat_grad(self.model, result.vector)
        self.optimizer.step()
        for listener in self.on_update:
            listener(step, result.vector)
        record: StepRecord = {
            "step": step,
            "peer": me,
            "loss": float(loss),
            "group": len(group),
            "dropped": len(result.dropped_senders),
            "missing_parts": len(result.missing_parts),
            "t_start": started,
            "t_computed": computed,
            "t_end": clock.now(),
        }
        if isinstance(result, SecureResult):
            record["bans"] = [dataclasses.asdict(b) for b in result.bans]
            record["banned"] = list(self.ledger.banned)
        if self.evaluate and ((step + 1) % self.config.eval_every == 0):
            record.update({f"test_{k}": v for k, v in self.task.evaluate(self.model).items()})
        return record

    def _public_gradient(self, peer: str, step: int) -> torch.Tensor:
        """`peer`'s gradient at `step` recomputed from its public batch at that step's parameters (validation).

        Verification runs in the background of later steps, so it uses a
        scratch copy of the model loaded with the parameters of `step`.
        """
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.model)
        set_flat_params(self._scratch, self._params_at[step])
        return compute_gradient(self.task, self._scratch, *self.task.batch(self.run_seed, peer, step, self.config.batch_size))[0]

    def _attack_view(self, step: int, gradient: torch.Tensor, group: list[str], x, y) -> AttackView:
        honest = None
        if self.attack.omniscient:
            # Batches are public, so a colluding attacker can recompute every
            # other member's honest gradient itself: that is its omniscience.
            others = [p for p in group if p != self.transport.peer_id]
            grads = [compute_gradient(self.task, self.model, *self.task.batch(self.run_seed, p, step, self.config.batch_size))[0] for p in others]
            honest = torch.stack(grads) if grads else gradient.unsqueeze(0)

        def recompute(label_map):
            return compute_gradient(self.task, self.model, x, y, label_map)[0]

        return AttackView(
            step=step,
            own_gradient=gradient,
            honest_gradients=honest,
            n=len(group),
            f=self.colluders,
            seed=self.run_seed,
            peer_index=group.index(self.transport.peer_id),
            recompute_gradient=recompute,
        )
