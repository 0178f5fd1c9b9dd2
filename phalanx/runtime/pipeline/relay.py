"""A relay: serves one stage for as long as it lives; everything it does is a reaction to messages."""

from __future__ import annotations

from .node import PipelineNode


class Relay(PipelineNode):
    """A relay node; `serve()` keeps it alive until `stop()`."""

    async def serve(self) -> None:
        self.start_background()
        await self._stopped.wait()
