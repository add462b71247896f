"""The per-block codec policy: block 0 (the attention sink) keeps int8 under 4- and 2-bit codecs."""

from __future__ import annotations

from typing import Any

import pytest

from cachestore.codec import Codec, read_header
from cachestore.codec.blockcodec import BlockCodecs
from ops.redisproc import RedisProcess
from tests.support import HISTORY, chat, make_client, wait_written


@pytest.mark.parametrize(("spec", "sink"), [("int2", "int8+lz4"), ("int4+zstd/g32", "int8+zstd:3"),
                                            ("int8", "int8+lz4"), ("exact", "exact+lz4")])
def test_policy(spec: str, sink: str) -> None:
    codecs = BlockCodecs.for_spec(spec)
    assert codecs.at(0).spec.name() == sink
    assert codecs.at(1) is codecs.main and codecs.at(7) is codecs.main
    assert ("sink=" in codecs.name()) == (codecs.sink is not codecs.main)


@pytest.mark.parametrize(("codec", "main"), [("int2+lz4", (2, "int2", b"")),
                                             ("int4+zstd/symv/s8/v5=0", (5, "int4", bytes((0x54, 0x44))))])
def test_pod_stores_block_zero_as_int8_and_hits(redis_server: RedisProcess, tiny_model: Any, codec: str,
                                                main: tuple[int, str, bytes]) -> None:
    """The other blocks in the main codec: format 5 frames (a layer one bit more) included, through the pod's whole
    path."""
    with make_client(redis_server, tiny_model, codec=codec, local_tier_bytes=0) as client:
        first = chat(client, HISTORY)
        assert first.status_code == 200
        wait_written(client)
        pipeline = client.app.state.pod.pipeline  # type: ignore[attr-defined]
        prompt = pipeline.engine.chat_ids(HISTORY)
        hashes = pipeline.hashes(b"default", prompt)
        raw = redis_server.client()
        headers = []
        for h in hashes:
            keys = [k for k in raw.scan_iter(match=f"*:blk:*:{h.hex()}*")]
            assert len(keys) == 1
            headers.append(read_header(raw.get(keys[0])))
        assert (headers[0].mode, headers[0].layer_bits) == ("int8", b"")
        assert {(h.version, h.mode, h.layer_bits) for h in headers[1:]} == {main}, headers
        second = chat(client, HISTORY)
        assert second.headers["x-kv-cache"] == "hit"
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(hashes) * 16


def test_a_rotated_frame_under_a_plain_key_is_refused() -> None:
    import torch  # noqa: PLC0415

    from service.cache.framegate import frame_problem  # noqa: PLC0415

    kv = torch.randn(2, 2, 2, 16, 64)  # [L, 2, H, T, D]
    plain, rotated = Codec("int4/plain"), Codec("int4/rotv")
    shape = list(kv.shape)
    assert frame_problem(plain.encode(kv), plain.spec, shape, torch.float32) is None
    assert frame_problem(rotated.encode(kv), rotated.spec, shape, torch.float32) is None
    problem = frame_problem(rotated.encode(kv), plain.spec, shape, torch.float32)
    assert problem is not None and problem.reason == "codec"
    assert frame_problem(plain.encode(kv), rotated.spec, shape, torch.float32) is not None
