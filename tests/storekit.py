"""Store test helpers (no tests, and no torch: `make lowest` runs the tests that use them): block hashes made up
from numbers, and a scratch store in a namespace of one test's own."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from cachestore.hashing import BlockHash
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore


def block_hash(i: int, salt: int = 0) -> BlockHash:
    """A block hash that number `i` (and `salt`) always give, unrelated to any other's."""
    return BlockHash(random.Random(i * 7919 + salt).randbytes(16))


def namespace_for(request: pytest.FixtureRequest, prefix: str) -> str:
    """A namespace of the requesting test's own, one per parameter too (a shared server's tests never meet)."""
    return prefix + request.node.name[:40].replace("[", "-").replace("]", "")


@asynccontextmanager
async def scratch_store(settings: StoreSettings) -> AsyncIterator[BlockStore]:
    """A BlockStore of `settings`, its namespace emptied and its connections closed after."""
    store = BlockStore(settings)
    try:
        yield store
    finally:
        await store.clear_namespace()
        await store.close()
