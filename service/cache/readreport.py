"""What a lookup's reader and rehydration threads report to the event loop: one object per lookup, not callbacks.

The threads call its methods; each settles one of its futures on the loop (once), which the lookup awaits.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cachestore.outcome import Result
from cachestore.wire import Target


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


class ReadReport:
    """A lookup's reading as the event loop sees it: `first`, the first chunk's result (None: none came); `last`, set
    once the last chunk is being requested (the prompt's tail can go along); `verified`, how many leading frames passed
    the gate and their bytes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.first: asyncio.Future[Result[list[bytes | Target]] | None] = loop.create_future()
        self.last: asyncio.Future[None] = loop.create_future()
        self.verified: asyncio.Future[tuple[int, int]] = loop.create_future()

    def first_read(self, result: Result[list[bytes | Target]] | None) -> None:
        """(Any thread.) The first chunk came back (None: none will)."""
        self._loop.call_soon_threadsafe(_settle, self.first, result)

    def last_requested(self) -> None:
        """(Any thread.) The last chunk is (about to be) requested."""
        self._loop.call_soon_threadsafe(_settle, self.last, None)

    def frames_verified(self, frames: int, nbytes: int) -> None:
        """(Any thread.) The hit: `frames` leading frames passed the gate, `nbytes` in all."""
        self._loop.call_soon_threadsafe(_settle, self.verified, (frames, nbytes))
