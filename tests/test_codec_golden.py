"""Golden frames pin the format: a change to header, layout or quantizers must be deliberate."""

from __future__ import annotations

import pytest
import torch

from cachestore.codec import Codec, read_header
from cachestore.compress import decompress
from cachestore.errors import CodecError
from cachestore.frame import HEADER_SIZE
from tests.golden.cases import CASES, expected_path, frame_path, make_input, tensor_bytes

NAMES = sorted(CASES)


def _raw_payload(frame: bytes) -> bytes:
    header = read_header(frame)
    return bytes(decompress(memoryview(frame)[HEADER_SIZE:], header.compressor, header.raw_len))


@pytest.mark.parametrize("name", NAMES)
def test_encoding_reproduces_the_golden_frame(name: str) -> None:
    spec, dtype, shape = CASES[name]
    golden = frame_path(name).read_bytes()
    frame = Codec(spec).encode(make_input(dtype, shape))
    if read_header(golden).compressor == "none":
        assert frame == golden
    else:
        # compressed bytes may differ between lz4/zstd library releases; what is pinned is
        # the header (less payload length and checksum) and the raw payload it decompresses to
        mine, theirs = read_header(frame), read_header(golden)
        assert (mine.mode, mine.compressor, mine.dtype, mine.flags, mine.group_size,
                mine.shape, mine.raw_len) == (theirs.mode, theirs.compressor, theirs.dtype,
                                              theirs.flags, theirs.group_size, theirs.shape,
                                              theirs.raw_len)
        assert _raw_payload(frame) == _raw_payload(golden)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_the_golden_frame_gives_the_golden_tensor(name: str) -> None:
    spec, dtype, shape = CASES[name]
    out = Codec("int2").decode(frame_path(name).read_bytes())
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert tensor_bytes(out) == expected_path(name).read_bytes()
    if spec.startswith("exact"):
        assert torch.equal(out, make_input(dtype, shape))


def test_golden_frames_cover_every_mode_and_compressor() -> None:
    headers = [read_header(frame_path(name).read_bytes()) for name in NAMES]
    assert {h.mode for h in headers} == {"exact", "fp16", "int8", "int4", "int2", "fp8"}
    assert {h.compressor for h in headers} == {"none", "lz4", "zstd"}
    assert {h.dtype for h in headers} == {"float32", "float16", "bfloat16"}
    assert any(h.shuffled for h in headers)


def test_a_future_version_is_rejected_cleanly() -> None:
    frame = bytearray(frame_path("int8_fp16_none").read_bytes())
    frame[4] = 2
    with pytest.raises(CodecError, match="version 2"):
        Codec().decode(bytes(frame))
