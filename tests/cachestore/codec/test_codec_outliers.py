"""Outlier key channels (/outk) and symmetric values (/symv), with range codes (/s8): frame format 5."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from cachestore.codec import Codec, CodecSpec, read_header
from cachestore.codec.frame import HEADER_SIZE, OUTLIER_KEYS, SCALE8, SYM_VALUES, outlier_channels
from cachestore.codec.plan import plan
from cachestore.errors import CodecError, ConfigError
from ops.redisproc import RedisProcess
from tests.support import SHORT_HISTORY as HISTORY
from tests.support import (
    check_gate_refuses_others,
    check_layers_decode_apart,
    computed_tokens,
    follow_up,
    kv_sample,
    pod_pair,
    resealed,
)

SHAPE = (3, 2, 2, 40, 16)  # [layers, 2, kv_heads, tokens, head_dim]


def _keys_with_outliers(seed: int = 0) -> torch.Tensor:
    """KV whose keys have a few channels far wider than the rest, as real keys do."""
    kv = kv_sample(SHAPE, torch.float32, seed=seed)
    kv[:, 0, :, :, 3] *= 40
    kv[:, 0, :, :, 11] *= 25
    return kv


def test_spec_names_the_options_and_parses_back() -> None:
    spec = CodecSpec.parse("int2+zstd/rotv/clip/outk/symv/s8/recent=int8")
    assert spec.variant is not None and spec.variant.outlier_keys and spec.variant.sym_values
    assert spec.name() == "int2+zstd:3/g64/rotv/clip/outk/symv/s8/recent=int8"
    assert CodecSpec.parse(spec.name()) == spec
    assert spec.transform == 2 | OUTLIER_KEYS | SYM_VALUES | SCALE8
    assert CodecSpec.parse("int4/outk/s8").name() == "int4+lz4/g64/outk/s8"
    names = {CodecSpec.parse(s).name() for s in ("int2/outk/s8", "int2/symv/s8", "int2/outk/symv/s8", "int2/plain")}
    assert len(names) == 4  # part of the fingerprint


@pytest.mark.parametrize("text", ["int8/outk", "fp16/symv", "int2/outk/k4=1", "int4/symv/k8=2", "int2/outk/outk",
                                  "int2/plain/symv", "int2/outk", "int4/symv"])
def test_spec_refuses_options_where_they_do_not_apply(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


def test_a_model_whose_head_dim_cannot_be_split_is_refused() -> None:
    CodecSpec.parse("int2/outk/s8").check_model(30, 64)
    with pytest.raises(ConfigError, match="head_dim"):
        CodecSpec.parse("int2/outk/s8").check_model(30, 12)  # 1 channel in 8
    with pytest.raises(ConfigError, match="head_dim"):
        CodecSpec.parse("int4/outk/s8").check_model(30, 40)  # 1 channel in 16
    with pytest.raises(CodecError, match="head_dim"):
        Codec("int2/outk/s8").encode(torch.randn(1, 2, 1, 4, 12))
    with pytest.raises(CodecError, match="head_dim"):  # 1 in 16 of 40 channels: a frame no reader would take
        Codec("int4/outk/s8").encode(torch.randn(1, 2, 1, 4, 40))


@pytest.mark.parametrize("mode", ["int2", "int4"])
def test_the_widest_key_channels_take_the_higher_precision(mode: str) -> None:
    """Every key group's `outlier_channels` widest channels take the higher precision: their error falls well below
    what the mode's own bits leave them."""
    kv = _keys_with_outliers()
    frame = Codec(f"{mode}+none/g8/outk/s8").encode(kv)
    header = read_header(frame)
    assert (header.version, header.transform) == (5, OUTLIER_KEYS | SCALE8)
    out = Codec().decode(frame, device="cpu")
    plain = Codec().decode(Codec(f"{mode}+none/g8/plain").encode(kv), device="cpu")
    keys = kv[:, 0]
    for channel in (3, 11) if outlier_channels(mode, SHAPE[4]) >= 2 else (3,):
        mine = (out[:, 0, ..., channel] - keys[..., channel]).abs().mean()
        theirs = (plain[:, 0, ..., channel] - keys[..., channel]).abs().mean()
        assert mine < theirs / 3, channel


@pytest.mark.parametrize("bits", [2, 4])
def test_symmetric_values_are_within_half_a_step_of_their_scale(bits: int) -> None:
    """value = (code - mid) * scale: every value within half a step of the scale its range codes expand to."""
    kv = kv_sample(SHAPE, torch.float32, seed=5)
    frame = Codec(f"int{bits}+none/g8/symv/s8").encode(kv)
    assert read_header(frame).transform == SYM_VALUES | SCALE8
    opened = Codec().open(frame, device="cpu")
    scale = opened.parts[2].float()  # [L, H, T, value groups, 1]: "sv", expanded
    out = opened.decode_into()
    values = kv[:, 1].unflatten(-1, (2, 8))  # groups of 8 channels per token
    assert scale.shape == (*values.shape[:-1], 1)
    err = (out[:, 1].unflatten(-1, (2, 8)) - values).abs()
    assert bool((err <= scale / 2 * 1.01 + values.abs() * 2.0**-10).all())


@pytest.mark.parametrize("spec", ["int2/g8/outk/symv/s8", "int2+zstd/g5/rotv/clip/outk/symv/s8",
                                  "int4/g32/rotv/outk/s8", "int4+zstd/g8/clip/symv/s8", "int2/g8/outk/s8"])
def test_layers_decode_apart_into_strided_views_as_whole(spec: str) -> None:
    check_layers_decode_apart(spec, ((4, 2, 2, 40, 16), (4, 2, 1, 7, 16), (4, 2, 3, 1, 16)), torch.float16)


def test_outlier_channels_and_symmetric_values_cost_about_what_the_plain_codec_does() -> None:
    """An eighth of int2's key channels at int4 (+0.25 bit a key), a sixteenth of int4's at int8 (+0.25 bit a key), is
    paid for by values without zero points (-0.25 bit a value), and range codes save a quarter bit a value more: the
    frame is smaller than the plain codec's, by at most 15%."""
    kv = kv_sample((30, 2, 3, 64, 64), torch.float16)
    for mode in ("int2", "int4"):
        plain = len(Codec(f"{mode}+none/plain").encode(kv))
        split = len(Codec(f"{mode}+none/outk/symv/s8").encode(kv))
        assert 0.85 * plain < split < plain, (mode, plain, split)


def _split_frame() -> bytearray:
    return bytearray(Codec("int2+none/g4/outk/s8").encode(kv_sample((1, 2, 1, 8, 8), torch.float32)))


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
            Codec().decode(resealed(edited), device="cpu")


def test_a_frame_of_format_5_under_another_spec_is_refused_before_decoding() -> None:
    check_gate_refuses_others("int2+zstd/rotv/clip/outk/symv/s8",
                              ("int2+zstd/rotv/clip", "int2+zstd/rotv/clip/outk/s8", "int2+zstd/rotv/clip/symv/s8"),
                              SHAPE)




@pytest.fixture
def pods(redis_server: RedisProcess, tiny_model: Any) -> Iterator[tuple[TestClient, TestClient]]:
    """Two pods of one fleet with the int2 codec of format 5, on one Redis."""
    with pod_pair(redis_server, tiny_model, ("pod-outk-0", "pod-outk-1"),
                  codec="int2+zstd/g8/rotv/clip/outk/symv/s8/recent=int8") as pair:
        yield pair


def test_a_pod_stores_format_5_blocks_and_another_pod_hits_them(pods: tuple[TestClient, TestClient],
                                                                 redis_server: RedisProcess) -> None:
    first_pod, second_pod = pods
    first, second = follow_up(first_pod, second_pod, HISTORY)
    raw = redis_server.client()
    headers = [read_header(raw.get(key)) for key in raw.scan_iter(match="*:blk:*")]
    assert {(h.mode, h.version, h.transform) for h in headers} >= {("int2", 5, 2 | OUTLIER_KEYS | SYM_VALUES | SCALE8)}
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed_tokens(first)
    lines = second_pod.get("/metrics").text.splitlines()
    assert not [line for line in lines if line.startswith("kvstash_cache_rejected_total{")]  # no frame discarded
