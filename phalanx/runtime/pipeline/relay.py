"""A relay: serves one stage for as long as it lives; everything it does is a reaction to messages."""

from __future__ import annotations

import asyncio

from .node import PipelineNode


class Relay(PipelineNode):
    """A relay node; `serve()` keeps it alive until `stop()`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stopped = asyncio.Event()

    async def serve(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()
