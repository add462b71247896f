"""The resume bench's floor reads: plain redis-py GETs of the bytes a hit fetches, as the pod chunks them."""

from __future__ import annotations

import asyncio
from typing import Any


def raw_client(url: str) -> Any:
    """The floor's blocking redis-py client of `url`: a Cluster client for a Cluster URL (its pipeline reads the
    nodes one after another: the floor is then plain redis-py's, not the fastest possible read)."""
    from cachestore.redisclient import make_client  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415

    return make_client(StoreSettings.from_url(url), asynchronous=False)


async def raw_get_one(raw: Any, key: str) -> bytes:
    """One value by the blocking raw client (off the event loop)."""
    value = await asyncio.to_thread(raw.get, key)
    assert isinstance(value, bytes), key
    return value


def raw_get(raw: Any, keys: list[str]) -> list[Any]:
    """Plain GETs of `keys` on a blocking redis-py client, in the pod's chunks (`chunk_plan`): the least a read of
    those bytes costs here (one pipeline of them all is slower: 116-192 ms against 72-75 ms for 97 MB in 127
    values, because both ends buffer the whole reply)."""
    from service.lookup import chunk_plan  # noqa: PLC0415

    got: list[Any] = []
    for chunk in chunk_plan(len(keys)):
        pipe = raw.pipeline(transaction=False)
        for key in keys[chunk.start:chunk.stop]:
            pipe.get(key)
        got += pipe.execute()
    return got
