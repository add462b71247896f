"""Plain redis-py beside the store: the resume bench's floor reads (GETs of the bytes a hit fetches, as the pod chunks
them), and an operator's --redis-url checked before a bench starts."""

from __future__ import annotations

import asyncio
from typing import Any


def raw_client(url: str, timeout_s: float = 0.5) -> Any:
    """The floor's blocking redis-py client of `url`, parsed as the service parses it (cachestore's StoreSettings and
    make_client: redis+cluster://, redis+sentinel://, rediss://, unix://): a Cluster client for a Cluster URL (its
    pipeline reads the nodes one after another: the floor is then plain redis-py's, not the fastest possible read)."""
    from cachestore.redisclient import make_client  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415

    return make_client(StoreSettings.from_url(url, op_timeout_s=timeout_s, write_timeout_s=max(5.0, timeout_s)),
                       asynchronous=False)


def operator_redis(url: str) -> Any:
    """An operator's --redis-url checked before a bench starts: parsed as the service parses it, and answering PING
    (a bad URL or an unreachable server is a ConfigError: one line, exit 2). Returns its StoreSettings."""
    import redis  # noqa: PLC0415
    import redis.exceptions  # noqa: PLC0415

    from cachestore.errors import ConfigError  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415

    settings = StoreSettings.from_url(url)
    try:
        client = raw_client(url, timeout_s=5.0)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        raise ConfigError(f"cannot use Redis at {settings.masked_url}: {first[0]}") from None
    return settings


async def raw_get_one(raw: Any, key: str) -> bytes:
    """One value by the blocking raw client (off the event loop)."""
    value = await asyncio.to_thread(raw.get, key)
    assert isinstance(value, bytes), key
    return value


def raw_get(raw: Any, keys: list[str]) -> list[Any]:
    """Plain GETs of `keys` on a blocking redis-py client, in the pod's chunks (`chunk_plan`): the least a read of
    those bytes costs here (one pipeline of them all is slower: 116-192 ms against 72-75 ms for 97 MB in 127
    values, because both ends buffer the whole reply)."""
    from service.cache.lookup import chunk_plan  # noqa: PLC0415

    got: list[Any] = []
    for chunk in chunk_plan(len(keys)):
        pipe = raw.pipeline(transaction=False)
        for key in keys[chunk.start:chunk.stop]:
            pipe.get(key)
        got += pipe.execute()
    return got
