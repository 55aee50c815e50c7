"""One request's outputs as an asyncio stream, filled from another thread.

Kept apart from the engine (no torch here) so that the API process of `symbiont serve`
(`symbiont/serve/http/front.py`) uses the same streams without importing it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from symbiont.serve.sequence import RequestOutput


class RequestStream:
    """Outputs of one request, in order, ending with the one marked `finished`."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put_threadsafe(self, output: RequestOutput) -> None:
        hand_over(self.loop, [(self, output)])

    def put_nowait(self, output: RequestOutput) -> None:
        """Only from the event loop's own thread."""
        self._queue.put_nowait(output)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            output = await self._queue.get()
            yield output
            if output.finished:
                return


def hand_over(
    loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, RequestOutput]]
) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the server stopped
        loop.call_soon_threadsafe(_put_each, items)


def _put_each(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put_nowait(output)
