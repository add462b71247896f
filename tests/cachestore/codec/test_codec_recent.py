"""`/recent=`: a sequence's partial last block (a tail, a session's partial block) at int8 (or int4 under int2) while
full blocks keep the spec's mode; the spec, the block policy, the pinned partial frame and a pod that writes and
reuses such blocks against a real private Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from cachestore.codec import Codec, CodecSpec, read_header, recent_spec
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.layout import NO_HI, HiLayers, Variant
from cachestore.errors import ConfigError
from cachestore.tails import unpack_tail
from ops.redisproc import RedisProcess
from tests.golden.cases import frame_path, make_input
from tests.support import SHORT_HISTORY as HISTORY
from tests.support import computed_tokens, follow_up, make_client, wait_written

SPEC = "int2+zstd/rotv/clip/symv/s8/k3=2/recent=int8"


def test_spec_names_the_recent_mode_and_parses_back() -> None:
    spec = CodecSpec.parse(SPEC)
    assert (spec.mode, spec.recent, spec.hi) == ("int2", "int8", HiLayers(up_keys=(2,)))
    assert spec.name() == "int2+zstd:3/g64/rotv/clip/symv/s8/k3=2/recent=int8"
    assert CodecSpec.parse(spec.name()) == spec
    assert CodecSpec.parse("int4/recent=int8").name() == "int4+lz4/g64/plain/recent=int8"
    # part of the fingerprint: pods with and without it, or with another recent mode, never share keys
    pinned = "int2+zstd:3/g64/rotv/clip/symv/s8/k3=2/recent=int8,sink=int8+zstd:3"
    assert BlockCodecs.for_spec(SPEC).name() == pinned
    names = {BlockCodecs.for_spec(s).name() for s in ("int2", "int2/recent=int8", "int2/recent=int4")}
    assert len(names) == 3


@pytest.mark.parametrize("text", ["int8/recent=int8", "int4/recent=int4", "int4/recent=int2", "int2/recent=int2",
                                  "int2/recent=fp16", "exact/recent=int8", "q8/recent=int8", "int2/recent=",
                                  "int2/recent=int8/k3=1", "int2/recent=int8/recent=int8"])
def test_spec_refuses_a_recent_mode_it_cannot_honour(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)
    with pytest.raises(ConfigError):
        Codec(text)


def test_recent_spec_keeps_compressor_and_for_int4_the_group_and_options() -> None:
    assert recent_spec(CodecSpec.parse("int4+zstd:5/g32/symv/s8/k5=1/recent=int8")) == CodecSpec("int8", "zstd", 5)
    under = recent_spec(CodecSpec.parse("int2+lz4/g32/rotv/clip/symv/s8/k3=1/recent=int4"))
    assert under == CodecSpec("int4", "lz4", 3, 32, Variant(True, True, sym_values=True, scale8=True), NO_HI)
    plain = CodecSpec.parse("int2+zstd")
    assert recent_spec(plain) is plain


def test_block_policy_gives_only_the_partial_block_the_recent_mode() -> None:
    codecs = BlockCodecs.for_spec(SPEC)
    assert codecs.at(0) is codecs.sink and codecs.at(5) is codecs.main and codecs.main.spec.mode == "int2"
    assert codecs.partial_at(0) is codecs.sink  # a partial block from token 0 is the sink block
    assert codecs.partial_at(3).spec == CodecSpec("int8", "zstd")
    assert codecs.sink.spec == CodecSpec("int8", "zstd")
    without = BlockCodecs.for_spec("int2+zstd/rotv/clip/symv/s8/k3=2")
    assert without.partial_at(3) is without.main
    exact = BlockCodecs.for_spec("exact")
    assert exact.partial_at(2) is exact.main is exact.at(2)


def test_partial_frame_is_the_pinned_int8_frame_and_within_its_bound() -> None:
    """A /recent=int8 codec's partial block is exactly the int8+zstd frame the golden vector pins, and decodes
    within int8's bound (half a step of each key channel's / value token's scale)."""
    kv = make_input(torch.float32, (2, 2, 1, 5, 8))  # [layers, 2, kv_heads, tokens, head_dim]
    frame = BlockCodecs.for_spec("int4+zstd:3/g4/plain/recent=int8").partial_at(1).encode(kv)
    assert frame == frame_path("int8_fp32_zstd_partial").read_bytes()
    assert read_header(frame).mode == "int8"
    out = Codec().decode(frame, device="cpu")
    keys, values = kv[:, 0], kv[:, 1]
    key_step = keys.abs().amax(dim=2, keepdim=True) / 127  # per channel
    value_step = values.abs().amax(dim=3, keepdim=True) / 127  # per token
    assert bool(((out[:, 0] - keys).abs() <= key_step / 2 + 1e-3).all())
    assert bool(((out[:, 1] - values).abs() <= value_step / 2 + 1e-3).all())
    # and it is the int8 frame: what the grouped codec would have written differs
    assert frame != Codec("int4+zstd:3/g4/plain").encode(kv)


@pytest.fixture
def client(redis_server: RedisProcess, tiny_model: Any) -> Iterator[TestClient]:
    with make_client(redis_server, tiny_model, codec="int4+zstd/g8/recent=int8", pod_name="pod-recent") as c:
        yield c


def test_a_pod_writes_the_tail_at_int8_and_the_next_turn_reuses_it(client: TestClient,
                                                                    redis_server: RedisProcess) -> None:
    first, second = follow_up(client, client, HISTORY, return_token_ids=True)
    raw = redis_server.client()
    tails = list(raw.scan_iter(match="*:tail:*"))
    blocks = list(raw.scan_iter(match="*:blk:*"))
    assert tails and blocks
    modes = {read_header(unpack_tail(raw.get(key))[1]).mode for key in tails}
    assert modes == {"int8"}
    assert {read_header(raw.get(key)).mode for key in blocks} == {"int8", "int4"}  # block 0 is the sink
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == computed_tokens(first) and cached % 16  # whole blocks and the int8 tail after them
    assert 'kvstash_tail_lookups_total{result="used"}' in client.get("/metrics").text


def test_a_session_keeps_its_partial_block_at_int8(client: TestClient, redis_server: RedisProcess) -> None:
    assert client.post("/v1/sessions", json={"session_id": "s-recent", "messages": HISTORY[:1]}).status_code == 201
    r = client.post("/v1/sessions/s-recent/messages", json={"content": "Hello there!", "max_tokens": 8,
                                                           "temperature": 0})
    assert r.status_code == 200, r.text
    wait_written(client)
    raw = redis_server.client()
    [key] = list(raw.scan_iter(match="*:sess:*:s-recent"))
    partial = raw.hget(key, "partial")
    assert partial and read_header(partial).mode == "int8"
    again = client.post("/v1/sessions/s-recent/messages", json={"content": "And?", "max_tokens": 8,
                                                               "temperature": 0})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] % 16  # the partial block was reused
