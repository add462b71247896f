"""Sliding-window (Gemma 3, gpt-oss) and hybrid recurrent (LFM2) models through llama.cpp pods: their full-attention
layers as blocks, the rest as boundary records (cachestore.boundary). A conversation alternating between two pods hits
on every later turn and replies token for token as one engine that kept the conversation; a record that is missing,
corrupt, of another layout or of another tenant is a miss, never a wrong answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import redis
import redis.asyncio

from cachestore.boundary import unpack_boundary
from cachestore.codec import read_header
from cachestore.inspect import namespace_stats
from cachestore.keys import KeySpace
from ops.redisproc import RedisProcess
from service.engines import GenParams
from service.engines.generation import GenRequest
from service.engines.llama.llamacpp import LlamaCppEngine
from tests.faultkit import reply_of
from tests.support import cached_tokens, redis_values, rewrite_values, wait_written
from tests.swapods import (
    BLOCK,
    MAX_TOKENS,
    QUESTIONS,
    SYSTEM,
    RecordChecks,
    ask,
    pods,
)
from tests.tinymodels import converter_missing, tiny_gguf

pytestmark = pytest.mark.skipif(converter_missing() is not None, reason=converter_missing() or "")

N_SWA = 32  # the tiny models' window


def _load(name: str) -> LlamaCppEngine:
    return LlamaCppEngine.load(str(tiny_gguf(name)), parallel=1, threads=1)


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss", "lfm2"])
def engines(request: pytest.FixtureRequest) -> Iterator[dict[str, LlamaCppEngine]]:
    """Pod a's engine, pod b's, and the reference that keeps the conversation itself."""
    with ExitStack() as stack:
        loaded = {role: _load(request.param) for role in ("a", "b", "reference")}
        for engine in loaded.values():
            stack.callback(engine.close)
        yield loaded


def _kind(engines: dict[str, LlamaCppEngine]) -> dict[str, str]:
    return {"engine": "llamacpp", "model": str(engines["a"].path)}


def _window_bytes(engine: LlamaCppEngine) -> int:
    """Bytes of the boundary state this layout writes at any position past its window (`boundarystate.split_state`)."""
    layout = engine.layout
    if layout.sliding_count:  # one stream: n_stream, a cell count, the cells, v_trans and n_layer, each layer's K, V
        rows = layout.kv_row_bytes[layout.full:]
        return 8 + 12 * N_SWA + 8 + sum(2 * (12 + N_SWA * row) for row in rows)
    # the cell count, the cell, s_trans and n_layer, each recurrent layer's R then S behind a 12-byte header
    return 4 + 8 + 8 + 2 * 12 * layout.recurrent_count + layout.recurrent_bytes


def test_a_conversation_alternating_pods_hits_every_later_turn_and_replies_exactly(
        engines: dict[str, LlamaCppEngine], redis_server: RedisProcess) -> None:
    reference = engines["reference"]
    assert not reference.layout.full_attention_only and reference.geometry.num_layers == reference.layout.full
    messages = [SYSTEM]
    known: dict[int, list[int]] = {}
    previous = None
    with pods(redis_server.url, engines, _kind(engines)) as (a, b):
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            pod = (a, b)[turn % 2]
            resp = ask(pod, engines["a"], messages)
            prompt = reference.chat_ids(messages, known)
            assert resp.json()["prompt_token_ids"] == prompt and len(prompt) > 4 * N_SWA
            cached = cached_tokens(resp)
            if previous is None:
                assert cached == 0 and resp.headers["x-kv-cache"] == "miss"
                expected = reference.generate(GenRequest(prompt, None, GenParams(max_tokens=MAX_TOKENS)))
            else:  # the other pod's sequence, to its last fed token: its boundary record
                assert cached == len(previous.seq_ids), (turn, cached, len(previous.seq_ids))
                assert resp.headers["x-kv-cache"] in ("hit", "partial")
                state = dict(previous.boundaries)[cached]  # the reference resumes where it stopped, as a pod does
                expected = reference.generate(GenRequest(prompt, previous.kv[:, :, :, :cached],
                                                         GenParams(max_tokens=MAX_TOKENS),
                                              boundary=state))
            assert reply_of(resp) == expected.text, f"turn {turn}: the cache changed the reply"
            previous = expected
            if expected.reply_ids is not None:
                known[len(messages)] = expected.reply_ids
            messages.append({"role": "assistant", "content": reply_of(resp)})
            wait_written(pod)
    records = [unpack_boundary(v) for v in redis_values(redis_server.url, "bnd").values()]
    # a record at each prompt's end and each sequence's end; the window or recurrent state the same size at every
    # boundary: the bytes of the sliding / recurrent layers grow with the boundaries, not with the context
    assert len(QUESTIONS) < len(records) <= 2 * len(QUESTIONS)
    assert {len(r.state) for r in records} == {_window_bytes(reference)}
    assert max(r.position for r in records) - min(r.position for r in records) > 2 * N_SWA
    blocks = redis_values(redis_server.url, "blk")
    assert blocks and {read_header(f).layers for f in blocks.values()} == {reference.layout.full}


class TestLlamaCppRecords(RecordChecks):
    window = N_SWA

    def kind(self, engines: dict[str, LlamaCppEngine]) -> dict[str, str]:
        return _kind(engines)

    def load(self, name: str) -> LlamaCppEngine:
        return _load(name)

    def other(self, engines: dict[str, LlamaCppEngine]) -> str:
        return "lfm2" if engines["a"].layout.sliding_count else "gemma3"


def test_records_are_in_admin_stats_verify_the_budget_and_a_session_export(redis_server: RedisProcess,
                                                                           tmp_path: Path) -> None:
    """A session of a sliding-window model moves to another Redis with its record and resumes there with a hit;
    stats count records, the budget accounts them, verify checks them."""
    from ops.cli import main  # noqa: PLC0415

    engines = {role: _load("gemma3") for role in ("a", "b")}
    target = RedisProcess().start()
    try:
        with pods(redis_server.url, engines, _kind(engines)) as (a, _):
            assert a.post("/v1/sessions", json={"session_id": "s", "messages": [SYSTEM]}).status_code == 201
            for text in QUESTIONS[:2]:
                turn = a.post("/v1/sessions/s/messages", json={"content": text, "max_tokens": MAX_TOKENS})
                assert turn.status_code == 200, turn.text
            wait_written(a)
        client = redis.Redis.from_url(redis_server.url)
        records = list(client.scan_iter(match="kvstash:bnd:*"))
        stats = asyncio.run(namespace_stats(redis.asyncio.Redis.from_url(redis_server.url), KeySpace("kvstash", 16),
                                            1 << 30))
        assert stats["kinds"]["boundary"]["keys"] == len(records) > 0
        for key in records:  # in the budget's index of its shard, with its size
            tag = key.decode()[key.decode().rfind("{"):]
            assert int(client.hget(f"kvstash:idx:size:{tag}", key)) >= client.strlen(key)
        flags = ["--engine", "llamacpp", "--model", str(engines["a"].path), "--codec", "exact",
                 "--block-tokens", str(BLOCK)]
        out = tmp_path / "s.json"
        assert main(["admin", "--redis-url", redis_server.url, "export", "s", str(out), *flags]) == 0
        assert "boundary" in json.loads(out.read_bytes())
        assert main(["admin", "--redis-url", target.url, "import", str(out), *flags]) == 0
        assert main(["admin", "--redis-url", redis_server.url, "verify"]) == 0
        rewrite_values(redis_server.url, "bnd", lambda v: v[:-1] + bytes([v[-1] ^ 1]))
        assert main(["admin", "--redis-url", redis_server.url, "verify"]) != 0
        with pods(target.url, engines, _kind(engines)) as (_, b):  # the imported session resumes at its record
            turn = b.post("/v1/sessions/s/messages", json={"content": QUESTIONS[2], "max_tokens": MAX_TOKENS})
        assert turn.status_code == 200, turn.text
        assert cached_tokens(turn) == len(json.loads(out.read_bytes())["session"]["token_ids"])
        client.close()
    finally:
        target.cleanup()
        for engine in engines.values():
            engine.close()
