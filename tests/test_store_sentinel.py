"""BlockStore through Redis Sentinel: the master is found by name from a redis+sentinel:// URL."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cachestore.hashing import BlockHash
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisProcess, free_port, redis_binary


@pytest.fixture
def sentinel_port(redis_server: RedisProcess, tmp_path: Path) -> Iterator[int]:
    """One sentinel watching `redis_server` as master `kvmaster`."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                    f"sentinel monitor kvmaster 127.0.0.1 {redis_server.port} 1\n")
    proc = subprocess.Popen([redis_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                masters = redis.Redis(port=port, socket_timeout=0.5).sentinel_masters()
                if "kvmaster" in masters:
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.skip("redis-server could not run as a sentinel here")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_store_through_sentinel(redis_server: RedisProcess, sentinel_port: int) -> None:
    settings = StoreSettings.from_url(f"redis+sentinel://127.0.0.1:{sentinel_port}/kvmaster", namespace="sent")
    assert settings.is_sentinel
    store = BlockStore(settings)
    try:
        hashes, frames = [BlockHash(bytes([i]) * 16) for i in range(3)], [b"a" * 10, b"b" * 20, b"c" * 30]
        assert await store.put_blocks("abcdef0123456789", hashes, frames) == 3
        assert await store.lookup("abcdef0123456789", hashes) == frames
    finally:
        await store.close()
    assert len(list(redis_server.client().scan_iter(match="sent:blk:*"))) == 3  # landed on the master
