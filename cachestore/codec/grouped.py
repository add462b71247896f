"""The grouped quantizers every mode shares: fp16 bounds rounded outward, asymmetric groups (with clipping and
range codes), int8, and the packing of codes; numpy arrays or torch tensors alike (`cachestore.codec.arrays`)."""

from __future__ import annotations

import math

from cachestore.codec import scalecodes
from cachestore.codec.arrays import Array, axis_slice, copy, device_of, fixed_sum, namespace, round_clip
from cachestore.codec.layout import Dims, Variant, groups
from cachestore.codec.rotation import rotate
from cachestore.errors import CodecError

# Range fractions the encoder tries per group with `clip` (the first is no clipping): for few
# levels a group's extremes waste most of the steps, for many levels clipping buys little.
CLIP_RATIOS = {2: (1.0, 0.9, 0.8, 0.7, 0.6, 0.5), 3: (1.0, 0.95, 0.9, 0.8, 0.7, 0.6), 4: (1.0, 0.95, 0.9, 0.85, 0.8),
               5: (1.0, 0.97, 0.94, 0.9), 6: (1.0, 0.98, 0.96), 8: (1.0,)}
# Fractions of a group's largest magnitude the symmetric value encoder tries as its outermost level (`sym_values`)
SYM_RATIOS = {2: (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4), 3: (1.0, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5),
              4: (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7), 5: (1.0, 0.95, 0.9, 0.85, 0.8)}


def outward(x: Array, up: bool) -> Array:
    """fp32 -> fp16, rounded up (or down) so the result bounds x; CodecError if not finite."""
    xp = namespace(x)
    h = xp.astype(x, xp.float16)
    limit = xp.full_like(h, float("inf") if up else float("-inf"))
    off = xp.astype(h, xp.float32) < x if up else xp.astype(h, xp.float32) > x
    h = xp.where(off, xp.nextafter(h, limit), h)
    if not bool(xp.all(xp.isfinite(h))):
        raise CodecError("KV holds NaN/Inf or values beyond the fp16 range of scales")
    return h


def safe(scale: Array) -> Array:
    """The scale as fp32 with zeros replaced by one: all-zero groups quantize to 0, not NaN."""
    xp = namespace(scale)
    s = xp.astype(scale, xp.float32)
    return xp.where(s > 0, s, xp.ones_like(s))


def pad(x: Array, dim: int, size: int) -> Array:
    """Pad `dim` to `size` by repeating the last slice, which leaves min and max unchanged."""
    have = x.shape[dim]
    if have == size:
        return x
    xp = namespace(x)
    last = axis_slice(x, dim, have - 1, have)
    reps = list(x.shape)
    reps[dim] = size - have
    return xp.concat([x, xp.broadcast_to(last, tuple(reps))], axis=dim)


def asym(x: Array, dim: int, levels: int, ratios: tuple[float, ...] = (1.0,),
          span: int | None = None, extremes: Array | None = None) -> tuple[Array, ...]:
    """Asymmetric quantization of x (fp32) with one (scale, zero) per slice along `dim`.

    With several `ratios`, each slice's range is also tried shrunk about its middle by each
    ratio, and the (scale, zero, codes) of the smallest squared error are kept per slice.
    With `span` (8-bit range codes, `scalecodes`) the ranges are coded between the extremes of the
    slices across `span` (or between `extremes` given), and (extremes, range codes, codes) are returned instead.
    """
    xp = namespace(x)
    lo, hi = xp.min(x, axis=dim, keepdims=True), xp.max(x, axis=dim, keepdims=True)
    ext = extremes if extremes is not None else scalecodes.extremes_of(lo, hi, dim, span) if span is not None else None
    best: list[Array] = []
    for ratio in ratios:
        mid, half = (lo + hi) * 0.5, (hi - lo) * (0.5 * ratio)
        low = lo if ratio == 1.0 else mid - half
        top = hi if ratio == 1.0 else mid + half
        if ext is None:
            zero = kept = outward(low, up=False)
            scale = outward((top - xp.astype(zero, xp.float32)) / levels, up=True)
        else:
            kept = scalecodes.codes_of(ext, low, top, dim)
            scale, zero = scalecodes.expand(ext, kept, dim, levels)
        zero32 = xp.astype(zero, xp.float32)
        q = round_clip((x - zero32) / safe(scale), 0, levels)
        if len(ratios) == 1:
            best = [scale, kept, q]
            break
        err = q * xp.astype(scale, xp.float32)  # exact (codes of at most 8 bits times an fp16 scale)
        err += zero32
        err -= x
        err *= err
        err = fixed_sum(err, dim)
        if not best:
            best = [scale, kept, q, err]
            continue
        better = err < best[3]
        best = [xp.where(better, new, old) for new, old in zip((scale, kept, q, err), best, strict=True)]
    return (best[0] if ext is None else ext), best[1], xp.astype(best[2], xp.uint8)


def pack(q: Array, bits: int) -> Array:
    """uint8 values < 2**bits (bits 1, 2, 4 or 8), any shape -> uint8 [ceil(n * bits / 8)], low bits first."""
    xp = namespace(q)
    per_byte = 8 // bits
    flat = xp.reshape(q, (-1,))
    extra = (-flat.shape[0]) % per_byte
    if extra:
        flat = xp.concat([flat, xp.zeros(extra, dtype=flat.dtype, device=device_of(flat))])
    cols = xp.reshape(flat, (-1, per_byte))  # [bytes, per_byte]
    out = copy(cols[:, 0])
    for j in range(1, per_byte):  # over the 2 or 4 values sharing a byte, not over the data
        out |= cols[:, j] << (bits * j)
    return out


def int8(x: Array, dim: int) -> tuple[Array, Array]:
    """Symmetric int8 of x [L, H, T, D] (fp32) with one scale per slice along `dim`: (scale, codes)."""
    xp = namespace(x)
    scale = outward(xp.max(xp.abs(x), axis=dim, keepdims=True) / 127, up=True)  # keys [L,H,1,D], values [L,H,T,1]
    return scale, xp.astype(round_clip(x / safe(scale), -127, 127), xp.int8)


def grouped_keys(k: Array, group: int, bits: int, variant: Variant) -> tuple[Array, ...]:
    """Keys [L, H, T, D] (fp32) -> scale, zero [L, H, groups, 1, D] and codes [L, H, groups, group, D]."""
    xp = namespace(k)
    n_layers, h, t, d = k.shape
    gk, nk, _, _ = groups(Dims(n_layers, h, t, d), group)
    kg = xp.reshape(pad(k, 2, nk * gk), (n_layers, h, nk, gk, d))  # groups of tokens per channel
    return asym(kg, 3, (1 << bits) - 1, CLIP_RATIOS[bits] if variant.clip else (1.0,),
                 scalecodes.KEY_SPAN if variant.scale8 else None)


def grouped_values(v: Array, group: int, bits: int, variant: Variant) -> tuple[Array, ...]:
    """Values [L, H, T, D] (fp32) -> scale, zero [L, H, T, groups, 1] and codes [L, H, T, groups, group]."""
    xp = namespace(v)
    n_layers, h, t, d = v.shape
    _, _, gv, nv = groups(Dims(n_layers, h, t, d), group)
    v = rotate(v) if variant.rot_values else v
    vg = xp.reshape(pad(v, 3, nv * gv), (n_layers, h, t, nv, gv))  # groups of channels per token
    return asym(vg, 4, (1 << bits) - 1, CLIP_RATIOS[bits] if variant.clip else (1.0,),
                 scalecodes.VALUE_SPAN if variant.scale8 else None)


def pack_rows(q: Array, bits: int) -> Array:
    """`pack` of each q[i] (uint8 codes, leading dim = layers) padded to a whole byte, concatenated."""
    xp = namespace(q)
    rows = xp.reshape(q, (q.shape[0], math.prod(q.shape[1:])))
    extra = (-rows.shape[1]) % (8 // bits)
    if extra:
        rows = xp.concat([rows, xp.zeros((rows.shape[0], extra), dtype=rows.dtype, device=device_of(rows))], axis=1)
    return pack(rows, bits)
