"""A pod's store and pipeline on an engine that lends sequence states (both llama.cpp engines), for tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from cachestore.store import BlockStore
from ops.redisproc import RedisProcess
from service.app import store_settings
from service.cache.pipeline import Pipeline
from service.engines.llama.lending import LendsStates
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings
from tests.timing import wait_for_async


@contextlib.asynccontextmanager
async def rows_pod(engine: LendsStates, redis_server: RedisProcess, codec: str, b: int,
                   frame_key: str = "") -> AsyncIterator[tuple[BlockStore, Pipeline]]:
    """A pod's store and pipeline of codec `codec` on `engine`, no local tier, signing with `frame_key` if given;
    emptied after, and every context the engine lent back in its pool."""
    settings = PodSettings(redis_url=redis_server.url, namespace=f"rows-{codec}", codec=codec, block_tokens=b,
                           local_tier_bytes=0, frame_key=frame_key)
    store = BlockStore(store_settings(settings))
    pipe = Pipeline(settings, engine, store, codec, PodMetrics(), None)  # type: ignore[arg-type]
    try:
        yield store, pipe
    finally:
        await store.clear_namespace()
        await store.close()
        pipe.close()
    await all_contexts_back(engine)


async def all_contexts_back(engine: LendsStates) -> None:
    """Until every context the engine lent is back (handed back from the requests' done callbacks)."""
    await wait_for_async(lambda: not engine.contexts_lent, "every lent context back", 5)
