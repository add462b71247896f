"""A hostile writer: full Redis access and the key schema, not the frame key. It writes well-formed values (moved
between two conversations' keys, copied from another tenant, altered with a recomputed checksum, of another
model, replayed) under the keys a conversation will look up; every reply stays a no-cache pod's and each rejection
is counted. Then a key rotation through pods: hits on both keys during it, on the new one only after it."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from cachestore.codec.frame import HEADER_SIZE, checksum
from cachestore.settings import StoreSettings
from cachestore.signing import TRAILER_SIZE
from cachestore.store import BlockStore
from ops.redisproc import RedisProcess
from tests.faultkit import (
    QUESTIONS,
    SYSTEM,
    chat,
    metric,
    pod_client,
    reference_reply,
    reply_of,
    uncached_pod,
    wait_written,
)
from tests.support import complete

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
ALPHA = {"authorization": "Bearer key-alpha"}
BETA = {"authorization": "Bearer key-beta"}
OTHER_SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one line, never more. " * 6}
X = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
Y = [OTHER_SYSTEM, {"role": "user", "content": QUESTIONS[1]}]


def _blocks(r: redis.Redis) -> set[bytes]:
    return set(r.scan_iter(match="kvstash:blk:*"))


@contextmanager
def tampered(r: redis.Redis, values: dict[bytes, bytes]) -> Iterator[None]:
    """`values` written over their keys for the block, then the originals put back."""
    saved = {k: (r.get(k), r.pttl(k)) for k in values}
    for key, value in values.items():
        r.set(key, value, keepttl=True)
    try:
        yield
    finally:
        for key, (value, ttl) in saved.items():
            assert value is not None
            r.set(key, value, px=max(int(ttl), 1000))


def _recomputed(value: bytes) -> bytes:
    """The value's frame with one payload byte changed and its checksum recomputed, its trailer kept."""
    body, trailer = bytearray(value[:-TRAILER_SIZE]), value[-TRAILER_SIZE:]
    body[-1] ^= 0x5A
    digest = checksum(bytes(body[:HEADER_SIZE]), bytes(body[HEADER_SIZE:]))
    body[HEADER_SIZE - 8:HEADER_SIZE] = struct.pack("<Q", digest)
    return bytes(body) + trailer


def _other_model_value(url: str, key: bytes) -> bytes:
    """A value a pod of another model (same frame key) signed under its own key for the same hash."""
    name = key.decode()
    ns, kind, model, rest = name.split(":", 3)
    other = f"{ns}:{kind}:{'f' * len(model)}:{rest}"

    async def write() -> bytes:
        store = BlockStore(StoreSettings.from_url(url, frame_key="fk-1"))
        try:
            assert store.signer is not None
            return store.signer.seal(other, redis.Redis.from_url(url).get(key)[:-TRAILER_SIZE])  # type: ignore[index]
        finally:
            await store.close()

    return asyncio.run(write())


def _store_events(pod: Any) -> dict[str, float]:
    """The store's event counters and breaker state, for a failure's message."""
    events = ("errors", "timeouts", "rejected_mac", "dropped_writes")
    got = {e: metric(pod, "kvstash_store_events", f'event="{e}"') for e in events}
    got["breaker_open"] = metric(pod, "kvstash_breaker_state", 'state="open"')
    return got


def test_a_hostile_writer_never_changes_a_reply(redis_server: RedisProcess, tiny_model: Any,
                                                figures: dict[str, object]) -> None:
    # the attacks are about MACs, not deadlines: a generous Redis timeout keeps a slow first chunk on a loaded CI
    # machine (over the default 0.5 s: a "bypass") from passing for a rejection
    with pod_client(redis_server.url, tiny_model, frame_key="fk-1", api_keys=KEYS, tenant_secret="ts",
                    redis_timeout_s=5.0) as pod, \
            uncached_pod(tiny_model) as plain:
        r = redis_server.client()
        chat(pod, X, headers=ALPHA)
        wait_written(pod)
        x_keys = sorted(_blocks(r))
        chat(pod, Y, headers=ALPHA)
        wait_written(pod)
        y_keys = sorted(_blocks(r) - set(x_keys))
        chat(pod, X, headers=BETA)  # the same conversation for another tenant: other keys, the same tokens
        wait_written(pod)
        beta_keys = sorted(_blocks(r) - set(x_keys) - set(y_keys))
        assert len(x_keys) >= 2 and y_keys and beta_keys
        hit = chat(pod, X, headers=ALPHA)
        assert hit.headers["x-kv-cache"] == "hit" and reply_of(hit) == reference_reply(plain, hit)
        old_x = {k: r.get(k) for k in x_keys}

        attacks: dict[str, dict[bytes, bytes]] = {
            "moved from another conversation": {k: r.get(v) for k, v in zip(x_keys, y_keys, strict=False)},
            "copied from another tenant": {k: r.get(v) for k, v in zip(x_keys, beta_keys, strict=False)},
            "altered, checksum recomputed": {k: _recomputed(v) for k, v in old_x.items()},  # type: ignore[arg-type]
            "of another model": {k: _other_model_value(redis_server.url, k) for k in x_keys},
            "moved within the conversation": {x_keys[0]: old_x[x_keys[1]]},  # type: ignore[dict-item]
        }
        rejected = before = metric(pod, "kvstash_frames_rejected_total", 'reason="mac"')
        identical = 0
        for name, values in attacks.items():
            with tampered(r, values):
                got = chat(pod, X, headers=ALPHA)
                assert got.headers["x-kv-cache"] != "bypass", (name, _store_events(pod))
                # every block forged: a miss; one block moved: a hit at most up to it
                assert got.headers["x-kv-cache"] == ("partial" if len(values) == 1 else "miss") or \
                    got.headers["x-kv-cache"] == "miss", name
                assert reply_of(got) == reference_reply(plain, got), name
                identical += 1
                wait_written(pod)
            now = metric(pod, "kvstash_frames_rejected_total", 'reason="mac"')
            assert now == rejected + 1, name  # counted, once: the lookup stops at the first rejected value
            assert metric(pod, "kvstash_cache_rejected_total", 'reason="mac"') == now
            rejected = now
        # replayed: values of the conversation itself, put back as they were (nothing else to replay: a block's
        # bytes are fixed by its key) still hit, and the reply is the no-cache pod's
        again = chat(pod, X, headers=ALPHA)
        assert again.headers["x-kv-cache"] == "hit" and reply_of(again) == reference_reply(plain, again)
        assert metric(pod, "kvstash_frames_rejected_total", 'reason="mac"') == rejected
        figures.update(attacks=len(attacks), replies_identical=identical, rejected_mac=int(rejected - before),
                       values_forged=sum(len(v) for v in attacks.values()), restored_hit=True)


def test_key_rotation_through_pods(redis_server: RedisProcess, tiny_model: Any, figures: dict[str, object]) -> None:
    """A pod on key A writes a conversation; during the rotation a pod on B (previous A) hits A's values and writes
    B's; after it a pod on B alone rejects A's values (counted), replaces them, and hits from then on; a pod still
    on A no longer hits, and a pod on C hits neither key's. Every reply is a no-cache pod's."""
    url = redis_server.url
    first_turn = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    with pod_client(url, tiny_model, frame_key="key-A") as old, \
            pod_client(url, tiny_model, frame_key="key-B", frame_key_previous="key-A") as rotating, \
            pod_client(url, tiny_model, frame_key="key-B") as new, \
            pod_client(url, tiny_model, frame_key="key-C") as stranger, \
            uncached_pod(tiny_model) as plain:
        one = chat(old, first_turn)
        wait_written(old)
        during = chat(rotating, first_turn)  # reads A's values
        assert during.headers["x-kv-cache"] == "hit" and reply_of(during) == reply_of(one)
        a_cached = during.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        second_turn = [*first_turn, {"role": "assistant", "content": reply_of(one)},
                       {"role": "user", "content": QUESTIONS[1]}]
        two = chat(rotating, second_turn)  # A's blocks hit, the new ones are written under B
        wait_written(rotating)
        assert two.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= a_cached
        assert reply_of(two) == reference_reply(plain, two)
        again = chat(rotating, second_turn)  # A's values, then B's, in one lookup
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > a_cached
        assert reply_of(again) == reply_of(two)
        assert metric(rotating, "kvstash_frames_rejected_total", 'reason="mac"') == 0

        after = chat(new, second_turn)  # B alone: the first block is A's, rejected; nothing after it is read
        assert after.headers["x-kv-cache"] == "miss" and reply_of(after) == reference_reply(plain, after)
        assert metric(new, "kvstash_frames_rejected_total", 'reason="mac"') == 1
        wait_written(new)  # the rejected values are replaced by B's (present blocks are otherwise left alone)
        healed = chat(new, second_turn)
        assert healed.headers["x-kv-cache"] == "hit" and reply_of(healed) == reply_of(after)
        assert healed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > a_cached
        for pod in (old, stranger):  # A: not B's values; C: neither key's
            got = chat(pod, second_turn)
            assert got.headers["x-kv-cache"] == "miss" and reply_of(got) == reference_reply(plain, got)
            assert metric(pod, "kvstash_frames_rejected_total", 'reason="mac"') >= 1  # a block, a reply's ids
        figures.update(pods=5, cached_during_rotation=again.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                       rejected_during_rotation=0, rejected_after=1,
                       cached_healed=healed.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
                       old_and_other_key="miss", replies_identical=7)


def test_a_replayed_older_value_is_used_only_where_it_is_right(redis_server: RedisProcess, tiny_model: Any,
                                                               figures: dict[str, object]) -> None:
    """A MAC cannot tell a replayed older value of the same key (a tail this prefix held before) from the newest:
    the pod uses it only as far as its tokens continue the prompt, so the reply is still a no-cache pod's."""
    first = list(range(100, 140))  # 2 full 16-token blocks and a tail under the second block's hash
    second = first[:36] + [7, 8, 9, 10]  # the same blocks, another tail under the same key
    with pod_client(redis_server.url, tiny_model, frame_key="fk-1") as pod, \
            uncached_pod(tiny_model) as plain:
        r = redis_server.client()
        complete(pod, first, max_tokens=4)
        wait_written(pod)
        [tail_key] = list(r.scan_iter(match="kvstash:tail:*"))
        old_tail = r.get(tail_key)
        complete(pod, second + [11], max_tokens=4)  # the newest tail of this prefix replaces the first one
        wait_written(pod)
        assert r.get(tail_key) != old_tail
        r.set(tail_key, old_tail, keepttl=True)  # replayed: validly signed, for this very key, but older
        got = complete(pod, second, max_tokens=4)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 36  # as far as the old tail continues it
        assert got["choices"][0]["text"] == complete(plain, second, max_tokens=4)["choices"][0]["text"]
        assert metric(pod, "kvstash_frames_rejected_total", 'reason="mac"') == 0  # not a forgery: nothing rejected
        figures.update(prompt_tokens=len(second), cached_tokens=36, reply_identical=True, rejected_mac=0)
