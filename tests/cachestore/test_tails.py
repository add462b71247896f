"""Tails and reply ids: value formats that reject what they did not write, and a pod that never reuses a wrong
token (forged tails and id records, edited replies, other tenants)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cachestore.errors import CodecError
from cachestore.hashing import BlockHash
from cachestore.tails import pack_ids, pack_tail, reply_digest, unpack_ids, unpack_tail
from ops.redisproc import RedisProcess
from tests.faultkit import metric
from tests.support import SHORT_HISTORY as HISTORY
from tests.support import chat, complete, computed_tokens, make_client, wait_written
from tests.timing import wait_for


def test_values_round_trip_and_reject_what_they_did_not_write() -> None:
    tail = pack_tail([5, 6, 7], b"FRAME")
    assert unpack_tail(tail) == ([5, 6, 7], b"FRAME")
    assert unpack_ids(pack_ids([1, 2])) == [1, 2]
    for bad in (tail[:-1], tail[:10], b"", tail[:20] + b"\0" + tail[21:], b"KVID" + tail[4:],
                bytes([tail[0]]) + tail[1:4] + b"\x02" + tail[5:]):
        with pytest.raises(CodecError):
            unpack_tail(bad)
    with pytest.raises(CodecError):
        unpack_ids(tail)  # a tail is not a reply record
    with pytest.raises(CodecError):
        unpack_ids(pack_ids([1]) + b"x")


def test_reply_digest_depends_on_root_and_exact_text() -> None:
    a, b = BlockHash(b"a" * 16), BlockHash(b"b" * 16)
    assert reply_digest(a, "hi") != reply_digest(b, "hi")
    assert reply_digest(a, "hi") != reply_digest(a, "hi ")
    assert reply_digest(a, "hi") == reply_digest(a, "hi")


def _keys(redis: RedisProcess, kind: str) -> list[bytes]:
    return list(redis.client().scan_iter(match=f"*:{kind}:*"))


def test_a_stateless_next_turn_hits_prompt_and_reply(kv_server: RedisProcess, tiny_model: Any) -> None:
    with make_client(kv_server, tiny_model) as c:
        first = chat(c, HISTORY, return_token_ids=True).json()
        assert _keys(kv_server, "tail") and _keys(kv_server, "ids")  # written before the reply ended
        reply = first["choices"][0]["message"]["content"]
        follow = [*HISTORY, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
        second = chat(c, follow, return_token_ids=True).json()
        computed = computed_tokens(first)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed
        fed = first["prompt_token_ids"] + first["choices"][0]["token_ids"][:-1]
        assert second["prompt_token_ids"][:computed] == fed


def test_forged_tail_and_forged_ids_are_never_used(redis_server: RedisProcess, tiny_model: Any) -> None:
    with make_client(redis_server, tiny_model) as c:
        first = chat(c, HISTORY, return_token_ids=True).json()
        raw = redis_server.client()
        [tail_key] = _keys(redis_server, "tail")
        tokens, frame = unpack_tail(raw.get(tail_key))
        forged = [t + 1 for t in tokens]  # a well-formed tail whose tokens the prompt does not continue
        raw.set(tail_key, pack_tail(forged, frame))
        [ids_key] = _keys(redis_server, "ids")
        ids = unpack_ids(raw.get(ids_key))
        raw.set(ids_key, pack_ids(ids[:-1] + [ids[-1] + 1]))  # ids that no longer decode to the reply's text
        reply = first["choices"][0]["message"]["content"]
        follow = [*HISTORY, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
        second = chat(c, follow, return_token_ids=True).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached % 16 == 0  # whole blocks only: the forged tail was refused
        metrics = c.get("/metrics").text
        assert 'kvstash_tail_lookups_total{result="mismatch"}' in metrics
        assert 'kvstash_reply_ids_total{result="mismatch"}' in metrics
        raw.set(tail_key, b"garbage")
        third = chat(c, follow).json()
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] % 16 == 0


def test_tenants_never_share_tails_or_reply_ids(redis_server: RedisProcess, tiny_model: Any) -> None:
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    with make_client(redis_server, tiny_model, api_keys=keys) as c:
        a = chat(c, HISTORY, headers={"authorization": "Bearer key-a"}).json()
        reply = a["choices"][0]["message"]["content"]
        follow = [*HISTORY, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
        b = chat(c, follow, headers={"authorization": "Bearer key-b"}).json()
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = chat(c, follow, headers={"authorization": "Bearer key-a"}).json()
        computed = computed_tokens(a)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == computed


def _blocks_soon(redis: RedisProcess, timeout_s: float = 10.0) -> int:
    """The blocks in Redis once some have landed (the write-back runs beside the reply)."""
    return wait_for(lambda: len(_keys(redis, "blk")), "blocks in Redis", timeout_s)


def test_prompt_blocks_are_in_redis_while_the_reply_streams(redis_server: RedisProcess, tiny_model: Any) -> None:
    with make_client(redis_server, tiny_model) as c:
        body = {"model": "tiny-random", "messages": HISTORY * 8, "max_tokens": 400, "stream": True,
                "stop": ["\x00never"], "return_token_ids": True}
        seen_during: list[int] = []
        last = b""
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for i, line in enumerate(r.iter_lines()):
                if i == 60:  # well into the reply: the prompt's blocks were queued after its first token
                    seen_during.append(_blocks_soon(redis_server))
                if line.startswith("data: {"):
                    last = line.encode()
        prompt_tokens = json.loads(last[6:])["prompt_token_ids"]
        assert seen_during and seen_during[0] >= len(prompt_tokens) // 16 > 0


def test_a_reply_ends_only_once_its_writes_are_in_redis(redis_server: RedisProcess, tiny_model: Any) -> None:
    """Writes paused in the middle of a long reply: the reply waits for them (bounded by write_wait_s), so a
    next turn sent the moment it ends finds everything; a pod that answered first would leave nothing there."""
    import threading  # noqa: PLC0415

    admin = redis_server.client()
    pause = threading.Timer(0.3, admin.execute_command, ("CLIENT", "PAUSE", "2000", "WRITE"))
    with make_client(redis_server, tiny_model, write_wait_s=10.0) as c:
        body = {"model": "tiny-random", "messages": HISTORY, "max_tokens": 300, "stop": ["\x00never"]}
        pause.start()
        try:
            first = c.post("/v1/chat/completions", json=body)
            tails, ids = _keys(redis_server, "tail"), _keys(redis_server, "ids")
        finally:
            pause.join()
        assert first.status_code == 200
        assert tails and ids, "the reply ended before its tail and reply ids were in Redis"


def test_a_tail_is_reused_as_far_as_the_prompt_continues_it(redis_server: RedisProcess, tiny_model: Any) -> None:
    """The same prompt again reuses every token its last request computed (the tail holds one past the prompt's
    usable end); a prompt that departs inside the tail reuses the tail up to the departure."""
    prompt = list(range(100, 140))  # 40 ids, 16-token blocks: 2 full blocks, a tail of 8 (39 usable)
    with make_client(redis_server, tiny_model) as c:
        assert complete(c, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_written(c)
        again = complete(c, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 39  # was 32: whole blocks only
        edited = prompt[:36] + [7, 8, 9, 10]
        reused = complete(c, edited)
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
        apart = prompt[:32] + [1, 2, 3, 4, 5, 6, 7, 8]  # departs at the tail's first token: whole blocks only
        assert complete(c, apart)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert metric(c, "kvstash_tail_lookups_total", 'result="used"') == 2
        assert metric(c, "kvstash_tail_lookups_total", 'result="mismatch"') == 1
    with make_client(redis_server, tiny_model, cache_enabled=False) as plain:  # the same reply as recomputing
        assert complete(plain, edited)["choices"][0]["text"] == reused["choices"][0]["text"]
        assert complete(plain, prompt)["choices"][0]["text"] == again["choices"][0]["text"]
