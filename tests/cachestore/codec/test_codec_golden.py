"""Golden frames pin the format: a change to header, layout or quantizers must be deliberate."""

from __future__ import annotations

import pytest
import torch

from cachestore.codec import Codec, read_header
from cachestore.codec.compress import decompress
from cachestore.codec.frame import HEADER_SIZE, UNROPE
from cachestore.errors import CodecError, RetiredFrame
from tests.golden.cases import CASES, RETIRED, expected_path, frame_path, golden_codec, make_input, tensor_bytes

NAMES = sorted(CASES)
# Rotated frames go through a matmul, whose rounding may differ in the last bit between BLAS
# builds (keys without their RoPE through sines and cosines, likewise between math libraries): their decoded tensor
# is pinned to within that, and their encoding by what it decodes to.
ROTATED = sorted(n for n in NAMES if "/rot" in CASES[n][0] or "/unrope" in CASES[n][0])
BIT_EXACT = sorted(set(NAMES) - set(ROTATED))


def _header_fields(frame: bytes) -> tuple[object, ...]:
    h = read_header(frame)
    return (h.version, h.mode, h.compressor, h.dtype, h.flags, h.transform, h.group_size, h.shape, h.raw_len)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    rel = 2.0**-6 if a.dtype == torch.bfloat16 else 2.0**-9  # two ulps of fp16 output, one of bf16
    return bool(torch.allclose(a.float(), b.float(), rtol=rel, atol=1e-6))


def _raw_payload(frame: bytes) -> bytes:
    header = read_header(frame)
    stored = memoryview(frame)[HEADER_SIZE + header.table_len:]  # after the layer table
    return bytes(decompress(stored, header.compressor, header.raw_len))


@pytest.mark.parametrize("name", BIT_EXACT)
def test_encoding_reproduces_the_golden_frame(name: str) -> None:
    spec, dtype, shape = CASES[name]
    golden = frame_path(name).read_bytes()
    frame = golden_codec(spec).encode(make_input(dtype, shape))
    if read_header(golden).compressor == "none":
        assert frame == golden
    else:
        # compressed bytes may differ between lz4/zstd library releases; what is pinned is
        # the header (less payload length and checksum) and the raw payload it decompresses to
        mine, theirs = read_header(frame), read_header(golden)
        assert (mine.version, mine.mode, mine.compressor, mine.dtype, mine.flags, mine.transform,
                mine.group_size, mine.shape, mine.raw_len, mine.layer_bits) == (
            theirs.version, theirs.mode, theirs.compressor, theirs.dtype, theirs.flags, theirs.transform,
            theirs.group_size, theirs.shape, theirs.raw_len, theirs.layer_bits)
        assert _raw_payload(frame) == _raw_payload(golden)


@pytest.mark.parametrize("name", ROTATED)
def test_rotated_golden_frames_decode_and_reencode_to_the_golden_tensor(name: str) -> None:
    spec, dtype, shape = CASES[name]
    golden = frame_path(name).read_bytes()
    expected = torch.frombuffer(bytearray(expected_path(name).read_bytes()), dtype=dtype).view(shape)
    header = read_header(golden)
    assert header.version in (2, 5, 6, 7) and header.transform & (2 | UNROPE)  # rotated values, unroped keys
    assert _close(Codec().decode(golden, device="cpu"), expected)
    frame = golden_codec(spec).encode(make_input(dtype, shape))
    assert _header_fields(frame) == _header_fields(golden)
    assert _close(Codec().decode(frame, device="cpu"), expected)


@pytest.mark.parametrize("name", BIT_EXACT)
def test_decoding_the_golden_frame_gives_the_golden_tensor(name: str) -> None:
    spec, dtype, shape = CASES[name]
    out = Codec("int2").decode(frame_path(name).read_bytes(), device="cpu")
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert tensor_bytes(out) == expected_path(name).read_bytes()
    if spec.startswith("exact"):
        assert torch.equal(out, make_input(dtype, shape))


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_frames_of_a_retired_format_are_refused_as_retired(name: str) -> None:
    frame = frame_path(name).read_bytes()
    with pytest.raises(RetiredFrame, match="retired format"):
        read_header(frame)
    with pytest.raises(RetiredFrame):
        Codec().decode(frame, device="cpu")


def test_golden_frames_cover_every_mode_and_compressor() -> None:
    headers = [read_header(frame_path(name).read_bytes()) for name in NAMES]
    assert {h.mode for h in headers} == {"exact", "fp16", "int8", "int4", "int2", "q8"}
    assert {h.version for h in headers} == {1, 2, 5, 6, 7}
    assert {h.transform for h in headers} == {0, 2, 60, 96, 112, 228, 246}
    assert {h.compressor for h in headers} == {"none", "lz4", "zstd"}
    assert {h.dtype for h in headers} == {"float32", "float16", "bfloat16"}
    assert any(h.shuffled for h in headers)


def test_a_future_version_is_rejected_cleanly() -> None:
    frame = bytearray(frame_path("int8_fp16_none").read_bytes())
    frame[4] = 8
    with pytest.raises(CodecError, match="version 8"):
        Codec().decode(bytes(frame), device="cpu")


@pytest.mark.parametrize(("name", "version", "transform", "match"), [
    ("int8_fp16_none", 2, 0, "transform 0x0 in version 2"),  # version 2 without anything needing it
    ("int8_fp16_none", 1, 2, "transform 0x2 for mode int8"),  # the reserved byte of format 1
    ("int8_fp16_none", 2, 2, "transform 0x2 for mode int8"),  # rotation on a mode that has none
    ("int2_fp16_none_g8_rotv", 2, 6, "transform 0x6 in version 2"),  # a layer table in format 2
    ("int2_fp16_none_g8_rotv", 2, 10, "transform 0xa in version 2"),  # outlier keys need format 5
    ("int2_fp16_none_g8_rotv", 1, 2, "transform 0x2 in version 1"),  # rotated values need format 2
    ("int8_fp16_none", 5, 48, "transform 0x30 for mode int8"),  # symmetric values on a mode that has none
    ("int2_fp32_none_g4_outk_symv_s8_k3", 5, 0x1c, "transform 0x1c in version 5"),  # format 5 without range codes
    ("int2_fp32_none_g4_outk_symv_s8_k3", 5, 0x7c, "transform 0x7c in version 5"),  # a format 6 bit in format 5
    ("int2_fp32_none_g8_kbits_symv_s8", 6, 0x30, "transform 0x30 in version 6"),  # format 6 without its bits
    ("int2_fp32_none_g8_kbits_symv_s8", 6, 0x78, "classes .* and outlier channels"),  # both at once
    ("int2_fp32_none_g8_kbits_symv_s8", 7, 0x70, "transform 0x70 in version 7"),  # int2's classes are format 6's
    ("int4_fp32_none_g8_kbits7_s8", 5, 0x60, "transform 0x60 in version 5"),  # format 7's bits in format 5
    ("int4_fp32_none_g8_kbits7_s8", 6, 0x60, "retired format"),  # int4's classes of format 6: retired
    ("int8_fp16_none", 3, 0, "retired format"),  # format 3, whatever it holds
    ("int2_fp16_none_g8_rotv", 2, 3, "retired format"),  # rotated keys
])
def test_inconsistent_version_and_transform_are_refused(name: str, version: int, transform: int,
                                                        match: str) -> None:
    frame = bytearray(frame_path(name).read_bytes())
    frame[4], frame[9] = version, transform  # the checksum then fails too; the header is checked first
    with pytest.raises(CodecError, match=match):
        Codec().decode(bytes(frame), device="cpu")
