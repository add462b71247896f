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

import torch

from cachestore.errors import CodecError

F16 = torch.float16
LEVELS = 255
# the axis of size 2 in the grouped shapes [L, H, groups, group, D] (keys) and [L, H, T, groups, group] (values)
KEY_AXIS, VALUE_AXIS = 3, 4
KEY_SPAN, VALUE_SPAN = 4, 2  # the axis the extremes are taken across: channels (keys), tokens (values)


def expand(extremes: torch.Tensor, codes: torch.Tensor, axis: int,
           levels: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(extremes, codes) of one half -> its fp16 (scale, zero), for codes of `levels` + 1 levels (a number, or a
    tensor that broadcasts to the scale's shape: levels per layer or channel): the zero point
    rounded down to fp16 and the scale up, so the coded range covers what the codes say. Separate multiplies and adds
    (no fused multiply-add), so every machine computes the same bits."""
    lo = extremes.narrow(axis, 0, 1).float()
    step = (extremes.narrow(axis, 1, 1).float() - lo) / LEVELS
    zero = _fp16(lo + codes.narrow(axis, 0, 1).float() * step, up=False)
    top = lo + codes.narrow(axis, 1, 1).float() * step
    return _fp16(((top - zero.float()) / levels).clamp_(min=0), up=True), zero


def _fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """fp32 -> fp16 rounded up (or down): the nearest fp16 on that side of x."""
    h = x.to(F16)
    off = h.float() < x if up else h.float() > x
    return torch.where(off, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)


def extremes_of(lo: torch.Tensor, hi: torch.Tensor, axis: int, span: int) -> torch.Tensor:
    """The fp16 extremes of groups whose minima are `lo` and maxima `hi` (fp32, the scale's shape), taken across `span`
    and rounded outward, stacked along `axis`; CodecError unless they are finite."""
    return _finite(torch.cat([_fp16(lo.amin(span, keepdim=True), up=False),
                              _fp16(hi.amax(span, keepdim=True), up=True)], axis))


def codes_of(extremes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, axis: int) -> torch.Tensor:
    """The 8-bit codes of groups of range [lo, hi] (fp32) between their `extremes`: lo rounded down, hi up."""
    low = extremes.narrow(axis, 0, 1).float()
    step = (extremes.narrow(axis, 1, 1).float() - low) / LEVELS
    safe = torch.where(step > 0, step, torch.ones_like(step))
    down = ((lo - low) / safe).floor_().clamp_(0, LEVELS)
    up = ((hi - low) / safe).ceil_().clamp_(0, LEVELS)
    return torch.cat([down, up], axis).to(torch.uint8)


def sym_extremes(scale: torch.Tensor, span: int) -> torch.Tensor:
    """The fp16 extreme (largest) of symmetric scales `scale` (fp32) across `span`, rounded up; CodecError unless
    finite."""
    return _finite(_fp16(scale.amax(span, keepdim=True), up=True))


def _finite(extremes: torch.Tensor) -> torch.Tensor:
    """`extremes`, unless one is not finite (KV with NaN/Inf or beyond the fp16 range): CodecError."""
    if not bool(torch.isfinite(extremes).all()):
        raise CodecError("KV holds NaN/Inf or values beyond the fp16 range of range codes")
    return extremes


def sym_codes(extreme: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The 8-bit codes of symmetric scales `scale` (fp32) under their `extreme`, rounded up."""
    top = extreme.float()
    safe = torch.where(top > 0, top, torch.ones_like(top))
    return (scale / safe * LEVELS).ceil_().clamp_(0, LEVELS).to(torch.uint8)


def sym_expand(extreme: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Symmetric scales from their extreme and codes: extreme * code / 255, rounded up to fp16."""
    return _fp16(extreme.float() * codes.float() / LEVELS, up=True)
