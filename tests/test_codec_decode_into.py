"""Codec.decode_into: every mode decodes into a slice of a larger preallocated context, bit-equal to decode."""

from __future__ import annotations

import pytest
import torch

from cachestore.codec import Codec
from cachestore.errors import CodecError

SPECS = ["exact", "fp16", "int8", "int4/g32", "int2", "fp8", "exact+zstd", "int8+zstd",
         "int4/g32/rot", "int2/g8/rotk/clip", "int4/plain"]  # rotated keys padded (g32) or not (g8)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_into_a_slice_equals_decode(spec: str) -> None:
    kv = torch.randn(3, 2, 2, 40, 16, generator=torch.Generator().manual_seed(1))  # [L, 2, H, T, D]
    codec = Codec(spec)
    frame = codec.encode(kv)
    context = torch.full((3, 2, 2, 100, 16), 7.0)
    assert codec.decode_into(frame, context[:, :, :, 30:70]).data_ptr() == context[:, :, :, 30:].data_ptr()
    assert torch.equal(context[:, :, :, 30:70], codec.decode(frame).float())
    assert bool((context[:, :, :, :30] == 7).all()) and bool((context[:, :, :, 70:] == 7).all())


def test_decode_into_casts_to_the_output_dtype() -> None:
    kv = torch.randn(2, 2, 1, 8, 16)
    half = torch.empty(2, 2, 1, 8, 16, dtype=torch.float16)
    Codec("int8").decode_into(Codec("int8").encode(kv), half)
    assert torch.allclose(half.float(), Codec("int8").decode(Codec("int8").encode(kv)), atol=2e-3, rtol=1e-3)


def test_decode_into_rejects_a_frame_of_another_shape_untouched() -> None:
    frame = Codec("int4").encode(torch.randn(2, 2, 1, 8, 16))
    out = torch.zeros(2, 2, 1, 9, 16)
    with pytest.raises(CodecError, match="output"):
        Codec("int4").decode_into(frame, out)
    assert not bool(out.any())
    with pytest.raises(CodecError):
        Codec("int4").decode_into(frame[:-3], torch.zeros(2, 2, 1, 8, 16))
