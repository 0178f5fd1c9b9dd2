"""Virtual time for the simulator: an asyncio loop whose clock never reads the wall.

`VirtualTimeLoop` is an asyncio loop whose clock never reads the
wall: when no callback is ready it jumps straight to the next timer, so
`asyncio.sleep`, `wait_for`, `call_at` and `Clock` all run on simulated seconds,
and an idle virtual hour costs microseconds. A loop with nothing ready and no
timer can never wake again: it raises `SimulationDeadlock`, naming the stuck
tasks. `run_simulation(main)` runs one simulation on a fresh loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import selectors
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol, TypeVar

from ..core.errors import LocalError

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskOwner(Protocol):
    """Whoever owns the tasks created in a context (a simulated peer: its crash cancels them)."""

    def adopt(self, task: asyncio.Task) -> None: ...


TASK_OWNER: contextvars.ContextVar[TaskOwner | None] = contextvars.ContextVar("phalanx_sim_owner", default=None)
"""The owner of the running context; every task created in it is adopted by that owner."""

CLOCK_RESOLUTION = 1e-9
"""Timers due within this many virtual seconds of now run together, at now."""


class SimulationDeadlock(LocalError):
    """No callback is ready and no timer is scheduled: the simulation can never move again."""


# --- virtual time ------------------------------------------------------------


class _VirtualSelector(selectors.SelectSelector):
    """Keeps the loop's file registrations but never waits: `select` advances virtual time."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list:
        return self._loop._advance(timeout)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on a virtual clock that jumps to the next timer when idle.

    It does no real I/O and cannot wait for threads (`run_in_executor` raises):
    a thread's wall time has no place on a virtual clock.
    """

    def __init__(self) -> None:
        self._virtual_now = 0.0
        self._sim_failure: BaseException | None = None
        self._sim_closing = False
        self._sim_tasks: dict[asyncio.Task, None] = {}
        super().__init__(_VirtualSelector(self))
        self._clock_resolution = CLOCK_RESOLUTION

    def time(self) -> float:
        return self._virtual_now

    def create_task(
        self, coro: Any, *, name: str | None = None, context: contextvars.Context | None = None
    ) -> asyncio.Task:
        """Create a task; remember it in creation order and give it to the peer that owns its context."""
        task = super().create_task(coro, name=name, context=context)
        self._sim_tasks[task] = None
        task.add_done_callback(self._forget_task)
        owner = context.get(TASK_OWNER) if context is not None else TASK_OWNER.get()
        if owner is not None:
            owner.adopt(task)
        return task

    def fail(self, exc: BaseException) -> None:
        """Stop the simulation: the next loop iteration raises `exc` out of run_until_complete/run_forever."""
        if self._sim_failure is None and not self._sim_closing:
            self._sim_failure = exc

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        """A callback that raised stops the simulation; anything else is logged as asyncio does."""
        exc = context.get("exception")
        if "handle" in context and isinstance(exc, Exception) and not self._sim_closing:
            self.fail(exc)  # a callback raised: a bug, fail fast rather than log and go on
        else:
            super().call_exception_handler(context)

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> NoReturn:
        raise LocalError(
            "the simulator's virtual clock cannot wait for threads: run the work inline "
            "and charge its cost with transport.charge_compute(flops)"
        )

    def close(self) -> None:
        """Cancel leftover tasks (in creation order), finalize async generators, then close."""
        if self.is_running() or self.is_closed():
            super().close()
            return
        self._sim_closing = True
        if self._sim_failure is not None:
            log.error("the simulation stopped with an unraised failure", exc_info=self._sim_failure)
        try:
            while pending := [task for task in self._sim_tasks if not task.done()]:
                for task in pending:
                    task.cancel()
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.run_until_complete(self.shutdown_asyncgens())
        except SimulationDeadlock as exc:
            log.warning("a task would not finish after being cancelled: %s", exc)
        finally:
            super().close()

    def _advance(self, timeout: float | None) -> list:
        """The selector's `select`: raise a pending failure, else jump to the next timer."""
        if self._sim_failure is not None and not self._sim_closing:
            exc, self._sim_failure = self._sim_failure, None
            raise exc
        if timeout is None:
            raise SimulationDeadlock(self._deadlock_message())
        if timeout > 0:
            # The loop asks to sleep until its earliest timer: go there exactly.
            self._virtual_now = self._scheduled[0].when()
        return []

    def _forget_task(self, task: asyncio.Task) -> None:
        self._sim_tasks.pop(task, None)

    def _deadlock_message(self) -> str:
        waiting = [task for task in self._sim_tasks if not task.done()]
        names = [f"{task.get_name()} ({getattr(task.get_coro(), '__qualname__', '?')})" for task in waiting[:8]]
        if len(waiting) > 8:
            names.append(f"and {len(waiting) - 8} more")
        return (
            f"simulation deadlock at virtual time {self._virtual_now:.6f} s: no callback is ready and no "
            f"timer is scheduled, so nothing can wake the {len(waiting)} waiting task(s): "
            f"{', '.join(names) or 'none'}. Something awaits an event, future or message that will never "
            "come: give the wait a timeout, or check who should have set it"
        )


def run_simulation(main: Callable[[], Awaitable[T]]) -> T:
    """Run `main()` to completion on a fresh VirtualTimeLoop starting at time 0, then close the loop.

    Hundreds of simulated peers make millions of short-lived objects; with the
    default collector thresholds a quarter of the wall time goes to scanning
    them, so the thresholds are raised for the run and restored after it.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(loop.create_task(await_factory(main), name="main"))
    finally:
        loop.close()
        gc.set_threshold(*thresholds)


async def await_factory(factory: Callable[[], Awaitable[T]]) -> T:
    """Await what `factory()` returns (a task's coroutine made inside the task, in its context)."""
    return await factory()
