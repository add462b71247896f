"""BlockStore through Redis Sentinel: the master is found by name from a redis+sentinel:// URL, the URL's query
arguments reach the connections, and a pod keeps answering (then hits again) when the primary is killed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from cachestore.hashing import BlockHash
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisProcessError, RedisSentinel
from tests.faultkit import QUESTIONS, SYSTEM, chat, pod_client, reply_of, wait_written


@pytest.fixture
def sentinel() -> Iterator[RedisSentinel]:
    """A primary and one replica, watched by one Sentinel as `kvmaster`."""
    try:
        watched = RedisSentinel().start()
    except RedisProcessError as exc:
        pytest.skip(f"redis-server could not run as a sentinel here: {exc}")
    try:
        yield watched
    finally:
        watched.cleanup()


async def test_store_through_sentinel(sentinel: RedisSentinel) -> None:
    settings = StoreSettings.from_url(sentinel.url + "?client_name=kvpod-sent&health_check_interval=5",
                                      namespace="sent")
    assert settings.is_sentinel
    store = BlockStore(settings)
    try:
        hashes, frames = [BlockHash(bytes([i]) * 16) for i in range(3)], [b"a" * 10, b"b" * 20, b"c" * 30]
        assert (await store.store_blocks("abcdef0123456789", hashes, frames)).value == 3
        assert (await store.fetch("abcdef0123456789", hashes)).value == frames
        # a lookup's reader thread finds the primary through the Sentinels too
        assert (await asyncio.to_thread(store.fetch_blocking, "abcdef0123456789", hashes)).value == frames
        primary = sentinel.nodes[0].client()
        # the URL's query arguments reached the connections to the primary (they used to be dropped)
        names = [c.get("name") for c in primary.client_list()]
        assert "kvpod-sent" in names, names
    finally:
        await store.close()
    assert len(list(primary.scan_iter(match="sent:blk:*"))) == 3  # landed on the primary


async def test_sentinel_credentials_come_from_the_query() -> None:
    """Sentinels that require a password: `?sentinel_password=` authenticates to them, not to the data nodes."""
    try:
        guarded = RedisSentinel(replicas=0, sentinel_password="s3ntinel-pw").start()
    except RedisProcessError as exc:
        pytest.skip(f"redis-server could not run as a sentinel here: {exc}")
    try:
        for query, works in (("?sentinel_password=s3ntinel-pw", True), ("", False)):
            store = BlockStore(StoreSettings.from_url(guarded.url + query, namespace="sentpw"))
            try:
                stored = (await store.store_blocks("abcdef0123456789", [BlockHash(b"\x01" * 16)], [b"x"])).value
                assert stored == (1 if works else 0), query
            finally:
                await store.close()
    finally:
        guarded.cleanup()


def test_primary_killed_replica_promoted_pod_answers_then_hits(sentinel: RedisSentinel, tiny_model: Any,
                                                               plain_pod: TestClient,
                                                               figures: dict[str, object]) -> None:
    expected: dict[str, str] = {}

    def correct(messages: list[dict[str, str]], reply: str) -> bool:
        key = repr(messages)
        expected.setdefault(key, reply_of(chat(plain_pod, messages)))
        return reply == expected[key]

    sent = ok = 0
    with pod_client(sentinel.url, tiny_model, redis_timeout_s=1.0) as pod:
        messages = [SYSTEM, {"role": "user", "content": QUESTIONS[1]}]
        assert correct(messages, reply_of(chat(pod, messages)))
        wait_written(pod)
        old = sentinel.primary()
        assert old.client().execute_command("WAIT", 1, 5000) == 1  # the replica holds the blocks too
        assert chat(pod, messages).headers["x-kv-cache"] == "hit"
        old.kill()
        killed_at = time.monotonic()
        statuses: list[str] = []
        while time.monotonic() - killed_at < 40:
            other = [SYSTEM, {"role": "user", "content": f"{QUESTIONS[2]} ({sent})"}]
            for m in (other, messages):
                resp = chat(pod, m)
                sent += 1
                ok += correct(m, reply_of(resp))  # replies continue throughout, by recompute if need be
            statuses.append(resp.headers["x-kv-cache"])
            wait_written(pod)
            if statuses[-1] == "hit" and sentinel.primary() is not old:
                break
            time.sleep(0.5)
        recovered_s = time.monotonic() - killed_at
        assert sentinel.wait_failover(old, 5) is not old
        assert statuses[-1] == "hit", statuses
        assert ok == sent
    figures.update(requests=sent, correct=ok, errors=0, recover_s=round(recovered_s, 2), statuses=statuses[:20])
