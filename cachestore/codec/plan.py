"""Where a frame's payload sections lie: their dtypes, shapes and offsets for a header, computed once per kind."""

from __future__ import annotations

import functools

from cachestore.codec.arrays import ITEMSIZE, Array
from cachestore.codec.frame import (
    GROUPED_MODES,
    KEY_CLASSES,
    OUTLIER_KEYS,
    ROT_VALUES,
    SCALE8,
    SYM_VALUES,
    UNROPE,
    FrameHeader,
)
from cachestore.codec.layout import Dims, HiLayers, Section, Variant, layout
from cachestore.errors import CodecError

ALIGN = 8
DTYPES = ("float32", "float16", "bfloat16")  # the KV dtypes a frame holds


def section_offsets(sections: list[Section]) -> tuple[list[int], int]:
    """Byte offset of each section (aligned to 8) and the raw payload length."""
    offsets, end = [], 0
    for dtype, shape in sections:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + nbytes(dtype, shape)
    return offsets, end


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * ITEMSIZE[dtype]


def plan(h: FrameHeader) -> tuple[tuple[Section, ...], tuple[int, ...], int]:
    """The header's payload sections, their offsets and the raw length; computed once per kind of frame (a
    lookup opens hundreds of frames of one shape: this was a third of opening one)."""
    return plan_of(h.mode, h.layers, h.kv_heads, h.tokens, h.head_dim, h.group_size, h.dtype, h.hi_counts,
                   variant_of(h))


def variant_of(h: FrameHeader) -> Variant:
    """The options a decoder must know, from the header's transform bits (clipping is the encoder's alone)."""
    t = h.transform
    return Variant(rot_values=bool(t & ROT_VALUES), outlier_keys=bool(t & OUTLIER_KEYS),
                   sym_values=bool(t & SYM_VALUES), scale8=bool(t & SCALE8), key_classes=bool(t & KEY_CLASSES),
                   unrope=bool(t & UNROPE))


@functools.lru_cache(maxsize=256)
def plan_of(mode: str, layers: int, heads: int, tokens: int, dim: int, group: int, dtype: str,
             hi_counts: tuple[int, ...], variant: Variant | None = None) -> tuple[tuple[Section, ...], tuple[int, ...],
                                                                                  int]:
    sections = layout(mode, Dims(layers, heads, tokens, dim), group if mode in GROUPED_MODES else 0,
                      dtype, hi_counts, variant)
    offsets, raw_len = section_offsets(sections)
    return tuple(sections), tuple(offsets), raw_len


def hi_of(h: FrameHeader) -> HiLayers:
    return HiLayers(h.up_layers(0), h.up_layers(1))


def itemsize(mode: str, dtype: str) -> int:
    return ITEMSIZE[dtype] if mode == "exact" else 2


def as_bytes(frame: bytes | bytearray | memoryview) -> memoryview:
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise CodecError(f"a frame is bytes, bytearray or memoryview, not {type(frame).__name__}")
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view



def stored_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A float section's shape as a FLAG_ROWS payload stores it: [layers, 2, tokens, kv_heads, head_dim]."""
    layers, two, heads, tokens, dim = shape
    return (layers, two, tokens, heads, dim)


def kind_of(h: FrameHeader) -> tuple[object, ...]:
    """Every field of a header but its checksum: frames of one kind share their layout."""
    return (h.version, h.mode, h.compressor, h.dtype, h.flags, h.group_size, h.layers, h.kv_heads, h.tokens,
            h.head_dim, h.raw_len, h.payload_len, h.transform, h.layer_bits)


def layer_slice(part: Array, first: int, count: int, layers: int) -> Array:
    """Layers [first, first + count) of a payload section: a leading-dim slice, or for the packed
    int4/int2 codes (flat bytes, layer-major, each layer's codes starting on a byte) those layers' bytes."""
    if part.ndim > 1:
        return part[first:first + count]
    per_layer = part.shape[0] // layers
    return part[first * per_layer:(first + count) * per_layer]
