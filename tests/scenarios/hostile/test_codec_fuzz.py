"""Property tests: whatever bytes reach the decoder, only CodecError ever comes out.

KVSTASH_FUZZ_EXAMPLES sets the examples per property (default 300); raise it for a long run.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachestore.codec import Codec, CodecSpec
from cachestore.codec.frame import HEADER, HEADER_SIZE, MAGIC, checksum
from cachestore.codec.layout import PLAIN
from cachestore.codec.quant import rotate
from cachestore.errors import CodecError

EXAMPLES = int(os.environ.get("KVSTASH_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow])
SPECS = ["exact+none", "exact+lz4", "fp16+zstd:1", "int8+lz4", "int8+none", "int4+zstd:1/g4",
         "int2+lz4/g8/plain", "int2+lz4/g8", "int4+none/g4/rotv/clip",  # these two: format 2
         "int4+none/g4/symv/s8/k5=0", "int2+lz4/g8/rotv/clip/symv/s8/k3=0",  # format 5, layer 0 one bit more
         "int2+zstd:1/g8/symv/s8/v3=0"]
DECODER = Codec()
LIMIT = 1 << 16  # elements: a crafted header may not make the fuzzer allocate much


def _seed_frames() -> list[bytes]:
    kv = torch.linspace(-3, 3, 1 * 2 * 2 * 7 * 8).view(1, 2, 2, 7, 8)
    frames = [Codec(spec).encode(kv) for spec in SPECS]
    frames.append(Codec("exact+lz4").encode(kv.to(torch.bfloat16)))
    return frames


SEEDS = _seed_frames()


def _with_checksum(frame: bytes) -> bytes:
    """Recompute the checksum so a mutation reaches the parts behind it."""
    if len(frame) < HEADER_SIZE:
        return frame
    digest = checksum(frame[:HEADER_SIZE], frame[HEADER_SIZE:])
    return frame[:HEADER_SIZE - 8] + struct.pack("<Q", digest) + frame[HEADER_SIZE:]


def _decode_or_codec_error(frame: bytes) -> None:
    try:
        out = DECODER.decode(frame, max_elements=LIMIT, device="cpu")
    except CodecError:
        return
    assert isinstance(out, torch.Tensor) and out.dim() == 5 and out.shape[1] == 2


@FUZZ
@given(seed=st.sampled_from(SEEDS), edits=st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    fix=st.booleans())
def test_mutated_frames(seed: bytes, edits: list[tuple[int, int]], fix: bool) -> None:
    frame = bytearray(seed)
    for pos, value in edits:
        frame[pos % len(frame)] = value
    _decode_or_codec_error(_with_checksum(bytes(frame)) if fix else bytes(frame))


@FUZZ
@given(seed=st.sampled_from(SEEDS), cut=st.integers(0, 10_000), extra=st.binary(max_size=16))
def test_truncated_or_extended_frames_always_fail(seed: bytes, cut: int, extra: bytes) -> None:
    frame = seed[:cut % len(seed)] if not extra else seed + extra
    with pytest.raises(CodecError):
        DECODER.decode(frame, device="cpu")
    with pytest.raises(CodecError):
        DECODER.decode(_with_checksum(frame), device="cpu")


@FUZZ
@given(data=st.binary(max_size=512), prefix=st.booleans())
def test_random_bytes(data: bytes, prefix: bool) -> None:
    frame = MAGIC + b"\x01" + data if prefix else data
    with pytest.raises(CodecError):
        DECODER.decode(frame, device="cpu")


@FUZZ
@given(fields=st.tuples(*[st.integers(0, 7)] * 5, st.integers(0, 1), st.integers(0, 70),
                        *[st.sampled_from([0, 1, 2, 3, 7, 64, 1 << 20, (1 << 32) - 1])] * 4,
                        st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1)),
       payload=st.binary(max_size=600), fix_lengths=st.booleans())
def test_crafted_headers(fields: tuple[int, ...], payload: bytes, fix_lengths: bool) -> None:
    """Well-checksummed headers with arbitrary fields over arbitrary payloads."""
    values = list(fields)
    if fix_lengths:
        values[-1] = len(payload)
    header = HEADER.pack(MAGIC, *values, 0)
    _decode_or_codec_error(_with_checksum(header + payload))


@FUZZ
@given(spec=st.sampled_from(SPECS), shape=st.tuples(
    st.integers(1, 3), st.just(2), st.integers(1, 3), st.integers(1, 20), st.integers(1, 12)),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scale=st.sampled_from([0.0, 1e-3, 1.0, 300.0]))
def test_any_valid_input_round_trips(spec: str, shape: tuple[int, ...], dtype: torch.dtype,
                                     scale: float) -> None:
    kv = (torch.randn(*shape) * scale).to(dtype)
    out = DECODER.decode(Codec(CodecSpec.parse(spec)).encode(kv), device="cpu")
    assert out.shape == kv.shape and out.dtype == dtype and torch.isfinite(out).all()
    x = kv.float()
    variant = CodecSpec.parse(spec).variant
    if variant is None or variant == PLAIN:
        bound = (x.max() - x.min()) / 6 * 1.02 + x.abs().max() * 2.0**-4 + 1e-6  # int2 at worst
        assert (out.float() - x).abs().max() <= bound
        return
    # Rotated or clipped: the contract bounds the error's norm, not each element (test_codec.py): at most
    # that of int2's half-steps over the range of the rotated data, plus the output dtype's rounding.
    xr = torch.stack([x[:, 0], rotate(x[:, 1]) if variant.rot_values else x[:, 1]], 1)
    step = (xr.max() - xr.min()) / 6 * 1.02 + xr.abs().max() * 2.0**-10
    bound = (step + x.abs().max() * 2.0**-7 + 1e-6) * x.numel() ** 0.5
    assert (out.float() - x).norm() <= bound
