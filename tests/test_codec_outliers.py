"""Outlier key channels (/outk) and symmetric values (/symv): frame format 4 of the grouped modes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from cachestore.codec import Codec, CodecSpec, read_header
from cachestore.codec.frame import HEADER_SIZE, OUTLIER_KEYS, SYM_VALUES, outlier_channels
from cachestore.codec.plan import plan
from cachestore.errors import CodecError, ConfigError
from ops.redisproc import RedisProcess
from service.app import create_app
from service.settings import PodSettings
from tests.support import check_gate_refuses_others, check_layers_decode_apart, kv_sample, resealed, wait_written

SHAPE = (3, 2, 2, 40, 16)  # [layers, 2, kv_heads, tokens, head_dim]


def _keys_with_outliers(seed: int = 0) -> torch.Tensor:
    """KV whose keys have a few channels far wider than the rest, as real keys do."""
    kv = kv_sample(SHAPE, torch.float32, seed=seed)
    kv[:, 0, :, :, 3] *= 40
    kv[:, 0, :, :, 11] *= 25
    return kv


def test_spec_names_the_options_and_parses_back() -> None:
    spec = CodecSpec.parse("int2+zstd/rotv/clip/outk/symv/recent=int8")
    assert spec.variant is not None and spec.variant.outlier_keys and spec.variant.sym_values
    assert spec.name() == "int2+zstd:3/g64/rotv/clip/outk/symv/recent=int8"
    assert CodecSpec.parse(spec.name()) == spec
    assert spec.transform == 2 | OUTLIER_KEYS | SYM_VALUES
    assert CodecSpec.parse("int4/outk").name() == "int4+lz4/g64/outk"
    names = {CodecSpec.parse(s).name() for s in ("int2/outk", "int2/symv", "int2/outk/symv", "int2/plain")}
    assert len(names) == 4  # part of the fingerprint


@pytest.mark.parametrize("text", ["int8/outk", "fp16/symv", "int2/outk/k4=1", "int4/symv/k8=2", "int2/outk/outk",
                                  "int2/plain/symv"])
def test_spec_refuses_options_where_they_do_not_apply(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


def test_a_model_whose_head_dim_cannot_be_split_is_refused() -> None:
    CodecSpec.parse("int2/outk").check_model(30, 64)
    with pytest.raises(ConfigError, match="head_dim"):
        CodecSpec.parse("int2/outk").check_model(30, 12)  # 1 channel in 8
    with pytest.raises(ConfigError, match="head_dim"):
        CodecSpec.parse("int4/outk").check_model(30, 40)  # 1 channel in 16
    with pytest.raises(CodecError, match="head_dim"):
        Codec("int2/outk").encode(torch.randn(1, 2, 1, 4, 12))
    with pytest.raises(CodecError, match="head_dim"):  # 1 in 16 of 40 channels: a frame no reader would take
        Codec("int4/outk").encode(torch.randn(1, 2, 1, 4, 40))


@pytest.mark.parametrize(("mode", "hi_levels"), [("int2", 15), ("int4", 255)])
def test_the_widest_key_channels_take_the_higher_precision(mode: str, hi_levels: int) -> None:
    """Every key group's `outlier_channels` widest channels are within half a step of the higher precision, the rest
    within half a step of the mode's; so the outlier channels' error falls by about the ratio of the levels."""
    kv = _keys_with_outliers()
    group = 8
    frame = Codec(f"{mode}+none/g{group}/outk").encode(kv)
    header = read_header(frame)
    assert (header.version, header.transform) == (4, OUTLIER_KEYS)
    out = Codec().decode(frame)
    plain = Codec().decode(Codec(f"{mode}+none/g{group}/plain").encode(kv))
    levels = {"int2": 3, "int4": 15}[mode]
    c = outlier_channels(mode, SHAPE[4])
    keys = kv[:, 0]
    for start in range(0, SHAPE[3], group):
        block = keys[:, :, start:start + group]
        width = block.amax(2) - block.amin(2)  # [L, H, D]
        widest = width.topk(c, -1).indices
        is_hi = torch.zeros_like(width, dtype=torch.bool).scatter_(-1, widest, True)
        step = width / torch.where(is_hi, hi_levels, levels)
        err = (out[:, 0, :, start:start + group] - block).abs().amax(2)
        assert bool((err <= step / 2 * 1.01 + block.abs().amax(2) * 2**-10).all()), start
    for channel in (3, 11) if c >= 2 else (3,):
        mine = (out[:, 0, ..., channel] - keys[..., channel]).abs().mean()
        theirs = (plain[:, 0, ..., channel] - keys[..., channel]).abs().mean()
        assert mine < theirs / 3, channel
    torch.testing.assert_close(out[:, 1], plain[:, 1], rtol=0, atol=0)  # values as the mode's own


@pytest.mark.parametrize("bits", [2, 4])
def test_symmetric_values_are_within_half_a_step_of_their_scale(bits: int) -> None:
    kv = kv_sample(SHAPE, torch.float32, seed=5)
    mode = f"int{bits}"
    frame = Codec(f"{mode}+none/g8/symv").encode(kv)
    assert read_header(frame).transform == SYM_VALUES
    out = Codec().decode(frame)
    values = kv[:, 1].unflatten(-1, (2, 8))  # groups of 8 channels per token
    step = values.abs().amax(-1, keepdim=True) / ((2**bits - 1) / 2)
    err = (out[:, 1].unflatten(-1, (2, 8)) - values).abs()
    assert bool((err <= step / 2 * 1.01).all())
    plain = Codec().decode(Codec(f"{mode}+none/g8/plain").encode(kv))
    torch.testing.assert_close(out[:, 0], plain[:, 0], rtol=0, atol=0)  # keys as the mode's own


@pytest.mark.parametrize("spec", ["int2/g8/outk/symv", "int2+zstd/g5/rotv/clip/outk/symv", "int4/g32/rot/outk",
                                  "int4+zstd/g8/clip/symv", "int2/g8/outk"])
def test_layers_decode_apart_into_strided_views_as_whole(spec: str) -> None:
    check_layers_decode_apart(spec, ((4, 2, 2, 40, 16), (4, 2, 1, 7, 16), (4, 2, 3, 1, 16)), torch.float16)


def test_outlier_channels_and_symmetric_values_cost_about_what_the_plain_codec_does() -> None:
    """An eighth of int2's key channels at int4 (+0.25 bit a key), a sixteenth of int4's at int8 (+0.25 bit a key), is
    paid for by values without zero points (-0.25 bit a value): the frame stays within 1% of the plain codec's size."""
    kv = kv_sample((30, 2, 3, 64, 64), torch.float16)
    plain = len(Codec("int2+none/plain").encode(kv))
    split = len(Codec("int2+none/outk/symv").encode(kv))
    assert split == pytest.approx(plain, rel=0.01)
    assert len(Codec("int4+none/outk/symv").encode(kv)) == pytest.approx(len(Codec("int4+none/plain").encode(kv)),
                                                                         rel=0.01)


def _split_frame() -> bytearray:
    return bytearray(Codec("int2+none/g4/outk").encode(kv_sample((1, 2, 1, 8, 8), torch.float32)))


def test_a_mask_that_marks_the_wrong_number_of_channels_is_refused_cleanly() -> None:
    frame = _split_frame()
    header = read_header(bytes(frame))
    names = ("sk", "zk", "sv", "zv", "mask")
    _, offsets, _ = plan(header)
    at = HEADER_SIZE + offsets[names.index("mask")]
    assert frame[at] != 0 and bin(frame[at]).count("1") == outlier_channels("int2", 8)
    for byte in (0x00, 0xFF, 0x07):
        edited = bytearray(frame)
        edited[at] = byte
        with pytest.raises(CodecError, match="outlier key mask"):
            Codec().decode(resealed(edited))


def test_a_frame_of_format_4_under_another_spec_is_refused_before_decoding() -> None:
    check_gate_refuses_others("int2+zstd/rotv/clip/outk/symv",
                              ("int2+zstd/rotv/clip", "int2+zstd/rotv/clip/outk", "int2+zstd/rotv/clip/symv"), SHAPE)


HISTORY = [{"role": "system", "content": "You answer briefly. " * 3}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture
def pods(redis_server: RedisProcess, tiny_model: Any) -> Iterator[tuple[TestClient, TestClient]]:
    """Two pods of one fleet with the int2 codec of format 4, on one Redis."""
    spec = "int2+zstd/g8/rotv/clip/outk/symv/recent=int8"
    apps = [create_app(PodSettings(model="tiny-random", redis_url=redis_server.url, codec=spec, block_tokens=16,
                                   pod_name=f"pod-outk-{i}"), engine=tiny_model) for i in range(2)]
    with TestClient(apps[0], raise_server_exceptions=False) as a, \
            TestClient(apps[1], raise_server_exceptions=False) as b:
        yield a, b


def _chat(client: TestClient, messages: list[dict[str, str]]) -> Any:
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 12, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_pod_stores_format_4_blocks_and_another_pod_hits_them(pods: tuple[TestClient, TestClient],
                                                                 redis_server: RedisProcess) -> None:
    first_pod, second_pod = pods
    first = _chat(first_pod, HISTORY)
    wait_written(first_pod)
    raw = redis_server.client()
    headers = [read_header(raw.get(key)) for key in raw.scan_iter(match="*:blk:*")]
    assert {(h.mode, h.version, h.transform) for h in headers} >= {("int2", 4, 2 | OUTLIER_KEYS | SYM_VALUES)}
    reply = first["choices"][0]["message"]["content"]
    follow = [*HISTORY, {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    second = _chat(second_pod, follow)
    computed = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed
    lines = second_pod.get("/metrics").text.splitlines()
    assert not [line for line in lines if line.startswith("kvstash_cache_rejected_total{")]  # no frame discarded
