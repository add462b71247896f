"""Sliding-window (Gemma 3, gpt-oss) and hybrid conv (LFM2) models through hf pods: their full-attention layers as
blocks, the rest as boundary records (cachestore.boundary, service.engines.hf.boundarystate). A conversation
alternating between two pods hits on every later turn and replies token for token as one engine that prefills the
whole conversation (no cache); a record that is missing, corrupt, of another layout or of another tenant is a miss,
never a wrong answer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from cachestore.boundary import unpack_boundary
from cachestore.codec import read_header
from ops.redisproc import RedisProcess
from service.engines import GenParams
from service.engines.generation import GenRequest
from service.engines.hf.engine import HfEngine
from service.engines.hf.layout import CONV, RECURRENT
from tests.faultkit import reply_of
from tests.support import cached_tokens, redis_values, wait_written
from tests.swapods import (
    BLOCK,
    MAX_TOKENS,
    QUESTIONS,
    SYSTEM,
    RecordChecks,
    ask,
    pods,
)
from tests.tinymodels import tiny_hf_dir

WINDOW = 32  # the tiny sliding models' window
FULL_LAYERS = {"gemma3": 1, "gpt-oss": 1, "lfm2": 2}


def _load(name: str) -> HfEngine:
    return HfEngine.load(str(tiny_hf_dir(name)), parallel=2)


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss", "lfm2"])
def engines(request: pytest.FixtureRequest) -> Iterator[dict[str, HfEngine]]:
    """Pod a's engine, pod b's, and the reference that prefills without a cache."""
    loaded = {role: _load(request.param) for role in ("a", "b", "reference")}
    yield loaded
    for engine in loaded.values():
        engine.close()


def _name(engines: dict[str, HfEngine]) -> str:
    return {"gemma3_text": "gemma3", "gpt_oss": "gpt-oss", "lfm2": "lfm2"}[engines["a"].layout.arch]


def _kind(engines: dict[str, HfEngine]) -> dict[str, str]:
    return {"engine": "hf", "model": str(tiny_hf_dir(_name(engines)))}


def test_the_layout_is_read_from_the_model_and_named_in_the_fingerprint(engines: dict[str, HfEngine]) -> None:
    engine = engines["a"]
    layout = engine.layout
    assert engine.boundary_records and engine.geometry.num_layers == len(layout.full) == FULL_LAYERS[_name(engines)]
    assert engine.kv_layout.tag == layout.tag() != ""
    assert engine.fingerprint(BLOCK, "exact").model_id.endswith(layout.tag())
    if layout.sliding:
        assert layout.window == WINDOW and not layout.recurrent
    else:
        assert layout.recurrent == (0, 2) and {s.shape for s in layout.slots} == {(64, 3)}


def test_a_hit_at_a_boundary_continues_the_kv_of_a_prefill(engines: dict[str, HfEngine]) -> None:
    """The KV a hit computes after its boundary is the KV a prefill of the whole sequence computes: positions and
    masks carry on (a sliding layer's cumulative length, a conv layer's previous state); this holds even where a
    tiny model's greedy reply would not show it."""
    engine = engines["reference"]
    first = engine.generate(GenRequest(list(range(100, 100 + 5 * WINDOW)), None, GenParams(max_tokens=6)))
    position = len(first.seq_ids)
    assert [p for p, _ in first.boundaries] == [5 * WINDOW, position]
    follow = first.seq_ids + list(range(400, 400 + 2 * WINDOW))
    prefilled = engine.generate(GenRequest(follow, None, GenParams(max_tokens=6)))
    hit = engine.generate(GenRequest(follow, first.kv, GenParams(max_tokens=6), boundary=first.boundaries[-1][1]))
    assert hit.cached_tokens == position and hit.token_ids == prefilled.token_ids
    assert hit.kv.shape == prefilled.kv.shape
    assert torch.allclose(hit.kv[:, :, :, position:], prefilled.kv[:, :, :, position:], atol=1e-4)
    assert dict(hit.boundaries)[len(follow)] and engine.boundary_problem(hit.boundaries[0][1], len(follow)) is None
    # n > 1: every choice after the prompt's own state
    both = engine.generate(GenRequest(follow, first.kv, GenParams(max_tokens=6, n=2), boundary=first.boundaries[-1][1]))
    assert both.token_ids == both.choices[0].token_ids == prefilled.token_ids


def test_a_conversation_alternating_pods_hits_every_later_turn_and_replies_exactly(
        engines: dict[str, HfEngine], redis_server: RedisProcess) -> None:
    reference = engines["reference"]
    messages = [SYSTEM]
    known: dict[int, list[int]] = {}
    previous = None
    with pods(redis_server.url, engines, _kind(engines)) as (a, b):
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            pod = (a, b)[turn % 2]
            resp = ask(pod, engines["a"], messages)
            prompt = reference.chat_ids(messages, known)
            assert resp.json()["prompt_token_ids"] == prompt and len(prompt) > 4 * WINDOW
            cached = cached_tokens(resp)
            if previous is None:
                assert cached == 0 and resp.headers["x-kv-cache"] == "miss"
            else:  # the other pod's sequence, to its last fed token: its boundary record
                assert cached == len(previous.seq_ids), (turn, cached, len(previous.seq_ids))
                assert resp.headers["x-kv-cache"] in ("hit", "partial")
            # the reference prefills the whole conversation every turn: no cache, no boundary state of its own
            expected = reference.generate(GenRequest(prompt, None, GenParams(max_tokens=MAX_TOKENS)))
            assert reply_of(resp) == expected.text, f"turn {turn}: the cache changed the reply"
            assert resp.json()["choices"][0]["token_ids"] == expected.token_ids, f"turn {turn}: token for token"
            previous = expected
            if expected.reply_ids is not None:
                known[len(messages)] = expected.reply_ids
            messages.append({"role": "assistant", "content": reply_of(resp)})
            wait_written(pod)
    records = [unpack_boundary(v) for v in redis_values(redis_server.url, "bnd").values()]
    # a record at each prompt's end and each sequence's end, each state the same size: the bytes of the sliding /
    # conv layers grow with the boundaries, not with the context
    assert len(QUESTIONS) < len(records) <= 2 * len(QUESTIONS)
    assert len({len(r.state) for r in records}) == 1
    assert max(r.position for r in records) - min(r.position for r in records) > 2 * WINDOW
    blocks = redis_values(redis_server.url, "blk")
    assert blocks and {read_header(f).layers for f in blocks.values()} == {reference.geometry.num_layers}


class TestHfRecords(RecordChecks):
    window = WINDOW

    def kind(self, engines: dict[str, HfEngine]) -> dict[str, str]:
        return _kind(engines)

    def load(self, name: str) -> HfEngine:
        return _load(name)

    def other(self, engines: dict[str, HfEngine]) -> str:
        return "lfm2" if engines["a"].layout.sliding else "gemma3"


def test_a_qwen3_next_hit_continues_its_conv_and_recurrent_states() -> None:
    """A hybrid whose linear layers keep a conv and a recurrent state each: a hit at a boundary computes the KV and
    the reply a prefill does."""
    engine = _load("qwen3-next")
    try:
        assert engine.layout.recurrent == (0, 2) and {s.kind for s in engine.layout.slots} == {CONV, RECURRENT}
        first = engine.generate(GenRequest(list(range(100, 260)), None, GenParams(max_tokens=6)))
        position = len(first.seq_ids)
        follow = first.seq_ids + list(range(400, 464))
        prefilled = engine.generate(GenRequest(follow, None, GenParams(max_tokens=6)))
        hit = engine.generate(GenRequest(follow, first.kv, GenParams(max_tokens=6), boundary=first.boundaries[-1][1]))
        assert hit.cached_tokens == position and hit.token_ids == prefilled.token_ids
        assert torch.allclose(hit.kv[:, :, :, position:], prefilled.kv[:, :, :, position:], atol=1e-4)
    finally:
        engine.close()
