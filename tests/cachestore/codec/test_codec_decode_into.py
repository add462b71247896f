"""Codec.decode_into: every mode decodes into a slice of a larger preallocated context, bit-equal to decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachestore.codec import Codec
from cachestore.errors import CodecError

SPECS = ["exact", "fp16", "int8", "int4/g32", "int2", "exact+zstd", "int8+zstd",
         "int4/g32/rotv", "int2/g8/rotv/clip", "int4/plain", "int2/g8/symv/s8"]


@pytest.mark.parametrize("spec", SPECS)
def test_decode_into_a_slice_equals_decode(spec: str) -> None:
    kv = torch.randn(3, 2, 2, 40, 16, generator=torch.Generator().manual_seed(1))  # [L, 2, H, T, D]
    codec = Codec(spec)
    frame = codec.encode(kv)
    context = torch.full((3, 2, 2, 100, 16), 7.0)
    assert codec.decode_into(frame, context[:, :, :, 30:70]).data_ptr() == context[:, :, :, 30:].data_ptr()
    assert torch.equal(context[:, :, :, 30:70], codec.decode(frame, device="cpu").float())
    assert bool((context[:, :, :, :30] == 7).all()) and bool((context[:, :, :, 70:] == 7).all())


def test_decode_into_casts_to_the_output_dtype() -> None:
    kv = torch.randn(2, 2, 1, 8, 16)
    half = torch.empty(2, 2, 1, 8, 16, dtype=torch.float16)
    Codec("int8").decode_into(Codec("int8").encode(kv), half)
    decoded = Codec("int8").decode(Codec("int8").encode(kv), device="cpu")
    assert torch.allclose(half.float(), decoded, atol=2e-3, rtol=1e-3)


def test_decode_into_rejects_a_frame_of_another_shape_untouched() -> None:
    frame = Codec("int4").encode(torch.randn(2, 2, 1, 8, 16))
    out = torch.zeros(2, 2, 1, 9, 16)
    with pytest.raises(CodecError, match="output"):
        Codec("int4").decode_into(frame, out)
    assert not bool(out.any())
    with pytest.raises(CodecError):
        Codec("int4").decode_into(frame[:-3], torch.zeros(2, 2, 1, 8, 16))


@pytest.mark.parametrize("spec", ["exact+none", "fp16+none", "int8+none"])
def test_a_stored_frame_is_read_in_place_not_copied_first(spec: str) -> None:
    """An uncompressed frame's sections are the frame's own bytes until dequantized into the context: a float
    frame once went through a copy of its whole payload first (47 MB for 2048 SmolLM2 tokens of fp16)."""
    kv = torch.randn(2, 2, 2, 8, 16, generator=torch.Generator().manual_seed(2))
    frame = Codec(spec).encode(kv)
    opened = Codec(spec).open(frame, device="cpu")
    start = np.frombuffer(frame, dtype=np.uint8).ctypes.data  # where the frame's bytes are
    assert opened.borrowed
    assert all(start <= p.data_ptr() < start + len(frame) for p in opened.parts), spec
    out = torch.zeros(2, 2, 2, 8, 16)
    assert torch.equal(opened.decode_into(out), Codec(spec).decode(frame, device="cpu").float())
    alone = opened.decode_into()  # no output given: a tensor of its own, never the frame's bytes
    assert not start <= alone.data_ptr() < start + len(frame)
    alone.fill_(3.0)
    assert torch.equal(Codec(spec).decode(frame, device="cpu").float(), out)


@pytest.mark.parametrize("spec", ["int8", "int4+zstd/symv/s8/k5=0.2"])
def test_an_fp16_context_gets_the_fp32_values_rounded_once(spec: str) -> None:
    """int8 codes times their fp16 scale are exact in fp32; an fp16 output (llama.cpp's context) holds exactly those
    products rounded to fp16, whichever route the decode takes."""
    kv = torch.randn(3, 2, 2, 64, 32, generator=torch.Generator().manual_seed(4)) * 5
    frame = Codec(spec).encode(kv)
    wide = torch.empty(3, 2, 2, 64, 32)
    half = torch.empty(3, 2, 2, 64, 32, dtype=torch.float16)
    Codec(spec).decode_into(frame, wide)
    Codec(spec).decode_into(frame, half)
    assert torch.equal(half, wide.half())
