"""BlockStore over TLS (self-signed certificate) as an ACL user limited to the namespace's keys."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cachestore.hashing import BlockHash
from cachestore.sessions import SessionRecord
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisProcess
from tests.support import tls_acl_server

PASSWORD = "s3cret-Pa55"


@pytest.fixture
def tls_acl_redis(tmp_path: Path) -> Iterator[tuple[RedisProcess, int, Path]]:
    """A redis-server with a TLS port and user `kv` allowed only keys `tlsns:*`."""
    with tls_acl_server(tmp_path, PASSWORD, "~tlsns:*") as found:
        yield found


async def test_tls_with_acl_user(tls_acl_redis: tuple[RedisProcess, int, Path]) -> None:
    server, tls_port, cert = tls_acl_redis
    url = f"rediss://kv:{PASSWORD}@127.0.0.1:{tls_port}/0"
    settings = StoreSettings.from_url(url, namespace="tlsns", tls_ca_path=str(cert), index_shards=4)
    assert PASSWORD not in repr(settings)
    store = BlockStore(settings)
    try:
        assert await store.ping()
        hashes = [BlockHash(bytes([i]) * 16) for i in range(6)]
        frames = [bytes([i]) * 5000 for i in range(6)]
        assert (await store.store_blocks("abcdef0123456789", hashes, frames)).value == 6
        assert (await store.fetch("abcdef0123456789", hashes)).value == frames
        # a lookup's reader thread: the blocking twin of the client speaks TLS with the same CA and ACL user
        assert (await asyncio.to_thread(store.fetch_blocking, "abcdef0123456789", hashes)).value == frames
        assert (await store.usage()).bytes_held == 30_000
        assert (await store.write_session(SessionRecord("acme", "s1", "m"), None)).value is not None
        assert await store.list_sessions() == [("acme", "s1")]
        assert (await store.reconcile()).stale_blocks == 0
        assert store.stats().errors == 0
    finally:
        await store.close()
    # the same user cannot touch keys outside its namespace, and plain TCP is not TLS
    user = redis.Redis(host="127.0.0.1", port=tls_port, ssl=True, ssl_ca_certs=str(cert), username="kv",
                       password=PASSWORD)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("other:key", b"x")
    user.close()
    other = BlockStore(StoreSettings.from_url(url, namespace="otherns", tls_ca_path=str(cert)))
    try:
        assert (await other.store_blocks("abcdef0123456789", hashes[:1], frames[:1])).value == 0  # NOPERM: dropped
        assert other.stats().dropped_writes == 1
    finally:
        await other.close()
