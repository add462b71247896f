"""A blocking facade over BlockStore for the CLI and scripts (one private event loop)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from cachestore.budget import EvictionResult
from cachestore.hashing import BlockHash
from cachestore.outcome import Result
from cachestore.sessions import SessionRecord
from cachestore.settings import StoreSettings
from cachestore.stats import StoreStats, Usage
from cachestore.store import BlockStore

T = TypeVar("T")


class SyncBlockStore:
    """The same operations as BlockStore, each run to completion on a private loop.

    Not for use inside a running event loop (use BlockStore there); not thread-safe.
    """

    def __init__(self, settings: StoreSettings) -> None:
        self._loop = asyncio.new_event_loop()
        self._store: BlockStore = self._run(self._create(settings))

    @staticmethod
    async def _create(settings: StoreSettings) -> BlockStore:
        return BlockStore(settings)  # the asyncio.Lock inside binds to this loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def __enter__(self) -> SyncBlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def store(self) -> BlockStore:
        return self._store

    @property
    def breaker_state(self) -> str:
        return self._store.breaker_state

    def stats(self) -> StoreStats:
        return self._store.stats()

    def ping(self) -> bool:
        return self._run(self._store.ping())

    def fetch(self, model: str, hashes: Sequence[BlockHash]) -> Result[list[bytes]]:
        return self._run(self._store.fetch(model, hashes))

    def store_blocks(self, model: str, hashes: Sequence[BlockHash], frames: Sequence[bytes]) -> Result[int]:
        return self._run(self._store.store_blocks(model, hashes, frames))

    def read_session(self, tenant: str, session_id: str) -> Result[SessionRecord | None]:
        return self._run(self._store.read_session(tenant, session_id))

    def write_session(self, record: SessionRecord, expected_version: int | None) -> Result[SessionRecord | None]:
        return self._run(self._store.write_session(record, expected_version))

    def delete_session(self, tenant: str, session_id: str) -> bool:
        return self._run(self._store.delete_session(tenant, session_id))

    def fork_session(self, tenant: str, src_id: str, dst_id: str) -> Result[SessionRecord | None]:
        return self._run(self._store.fork_session(tenant, src_id, dst_id))

    def list_sessions(self, tenant: str | None = None, limit: int = 10_000) -> list[tuple[str, str]]:
        return self._run(self._store.list_sessions(tenant, limit))

    def usage(self) -> Usage:
        return self._run(self._store.usage())

    def reconcile(self) -> EvictionResult:
        return self._run(self._store.reconcile())

    def clear_namespace(self) -> int:
        return self._run(self._store.clear_namespace())

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._store.close())
            self._loop.close()
