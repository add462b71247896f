"""8-bit range codes (`/s8`, frame formats 5 to 7, split layouts): a grouped frame's scales and zero points at a
quarter bit a value instead of half a bit.

An int4/int2 group normally stores its range as an fp16 scale and an fp16 zero point: 32 bits for 64 values. With
SCALE8 the groups of one block share two fp16 extremes (keys: the groups of one layer, head and token group across
all channels; values: one layer, head and channel group across all tokens), and each group stores its minimum and
maximum as 8-bit codes between them, the minimum rounded down and the maximum up, so every value still lies in its
group's range. Each pair of fp16 sections (scale, zero) of a layout becomes a pair (extremes, codes):

    keys    extremes [layers, heads, key groups, 2, 1]   codes [layers, heads, key groups, 2, head_dim]
    values  extremes [layers, heads, 1, value groups, 2]  codes [layers, heads, tokens, value groups, 2]

(along the axis of size 2: the low extreme or code first). `expand` turns a pair back into the fp16 scale and zero
point every decoder already takes; the encoder quantizes against exactly those, so decoding is the affine map of
every other grouped frame, native kernels included.
"""

from __future__ import annotations

from cachestore.codec.arrays import Array, axis_slice, namespace
from cachestore.errors import CodecError

LEVELS = 255
# the axis of size 2 in the grouped shapes [L, H, groups, group, D] (keys) and [L, H, T, groups, group] (values)
KEY_AXIS, VALUE_AXIS = 3, 4
KEY_SPAN, VALUE_SPAN = 4, 2  # the axis the extremes are taken across: channels (keys), tokens (values)


def _low(x: Array, axis: int) -> Array:
    return axis_slice(x, axis, 0, 1)


def _high(x: Array, axis: int) -> Array:
    return axis_slice(x, axis, 1, 2)


def expand(extremes: Array, codes: Array, axis: int, levels: int | Array) -> tuple[Array, Array]:
    """(extremes, codes) of one half -> its fp16 (scale, zero), for codes of `levels` + 1 levels (a number, or an
    array that broadcasts to the scale's shape: levels per layer or channel): the zero point
    rounded down to fp16 and the scale up, so the coded range covers what the codes say. Separate multiplies and adds
    (no fused multiply-add), so every machine computes the same bits."""
    xp = namespace(extremes, codes)
    lo = xp.astype(_low(extremes, axis), xp.float32)
    step = (xp.astype(_high(extremes, axis), xp.float32) - lo) / LEVELS
    zero = _fp16(lo + xp.astype(_low(codes, axis), xp.float32) * step, up=False)
    top = lo + xp.astype(_high(codes, axis), xp.float32) * step
    return _fp16(xp.clip((top - xp.astype(zero, xp.float32)) / levels, 0, None), up=True), zero


def _fp16(x: Array, up: bool) -> Array:
    """fp32 -> fp16 rounded up (or down): the nearest fp16 on that side of x."""
    xp = namespace(x)
    h = xp.astype(x, xp.float16)
    off = xp.astype(h, xp.float32) < x if up else xp.astype(h, xp.float32) > x
    return xp.where(off, xp.nextafter(h, xp.full_like(h, float("inf") if up else float("-inf"))), h)


def extremes_of(lo: Array, hi: Array, axis: int, span: int) -> Array:
    """The fp16 extremes of groups whose minima are `lo` and maxima `hi` (fp32, the scale's shape), taken across `span`
    and rounded outward, stacked along `axis`; CodecError unless they are finite."""
    xp = namespace(lo, hi)
    return _finite(xp.concat([_fp16(xp.min(lo, axis=span, keepdims=True), up=False),
                              _fp16(xp.max(hi, axis=span, keepdims=True), up=True)], axis=axis))


def codes_of(extremes: Array, lo: Array, hi: Array, axis: int) -> Array:
    """The 8-bit codes of groups of range [lo, hi] (fp32) between their `extremes`: lo rounded down, hi up."""
    xp = namespace(extremes, lo, hi)
    low = xp.astype(_low(extremes, axis), xp.float32)
    step = (xp.astype(_high(extremes, axis), xp.float32) - low) / LEVELS
    safe = xp.where(step > 0, step, xp.ones_like(step))
    down = xp.clip(xp.floor((lo - low) / safe), 0, LEVELS)
    up = xp.clip(xp.ceil((hi - low) / safe), 0, LEVELS)
    return xp.astype(xp.concat([down, up], axis=axis), xp.uint8)


def sym_extremes(scale: Array, span: int) -> Array:
    """The fp16 extreme (largest) of symmetric scales `scale` (fp32) across `span`, rounded up; CodecError unless
    finite."""
    xp = namespace(scale)
    return _finite(_fp16(xp.max(scale, axis=span, keepdims=True), up=True))


def _finite(extremes: Array) -> Array:
    """`extremes`, unless one is not finite (KV with NaN/Inf or beyond the fp16 range): CodecError."""
    xp = namespace(extremes)
    if not bool(xp.all(xp.isfinite(extremes))):
        raise CodecError("KV holds NaN/Inf or values beyond the fp16 range of range codes")
    return extremes


def sym_codes(extreme: Array, scale: Array) -> Array:
    """The 8-bit codes of symmetric scales `scale` (fp32) under their `extreme`, rounded up."""
    xp = namespace(extreme, scale)
    top = xp.astype(extreme, xp.float32)
    safe = xp.where(top > 0, top, xp.ones_like(top))
    return xp.astype(xp.clip(xp.ceil(scale / safe * LEVELS), 0, LEVELS), xp.uint8)


def sym_expand(extreme: Array, codes: Array) -> Array:
    """Symmetric scales from their extreme and codes: extreme * code / 255, rounded up to fp16."""
    xp = namespace(extreme, codes)
    return _fp16(xp.astype(extreme, xp.float32) * xp.astype(codes, xp.float32) / LEVELS, up=True)
