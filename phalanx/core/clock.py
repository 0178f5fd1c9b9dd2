"""The clock protocols read: the running event loop's time.

On hivemind the loop runs in real time; in the simulator the loop itself runs
on virtual time, so `asyncio.sleep`, `wait_for` and this clock all agree there.
"""

from __future__ import annotations

import asyncio


class Clock:
    """Seconds on the current event loop's clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
