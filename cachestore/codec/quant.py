"""Quantizers of the codec modes: KV tensor to payload sections, vectorized torch.

Every function works on the tensor's own device. KV is [layers, 2, kv_heads, tokens,
head_dim]; keys (index 0) are scaled per channel, values (index 1) per token, as in KIVI.
Scales and zero points are fp16, rounded outward (scales up, zero points down) so every
input lies inside its group's range and the error stays within half a step.

int4/int2 take options (`Variant`): `rot_values` multiplies values by an orthonormal
block-Hadamard matrix along head_dim before quantizing (and again after: it is its own inverse),
which spreads outlier channels over the whole head; `clip` lets the encoder shrink each group's
range where that lowers the group's squared error (decoding is unchanged; values beyond the
clipped range saturate, everything inside it stays within half a step). The split options
(`split_layout`) and their per-layer bits (`HiLayers`) are quantized by `_quantize_split`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from cachestore.codec import scalecodes
from cachestore.codec.frame import (
    KEY_CLASS_BITS,
    OUTLIER_BITS,
    key_class_shifts,
    key_classes,
    outlier_channels,
)
from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.layout import (
    F16,
    NO_HI,
    PLAIN,
    Dims,
    HiLayers,
    Variant,
    groups,
    key_streams,
    split_layout,
)
from cachestore.codec.q8 import q8_rows
from cachestore.codec.rope import Rope, pair_mean, turn
from cachestore.errors import CodecError

# Range fractions the encoder tries per group with `clip` (the first is no clipping): for few
# levels a group's extremes waste most of the steps, for many levels clipping buys little.
CLIP_RATIOS = {2: (1.0, 0.9, 0.8, 0.7, 0.6, 0.5), 3: (1.0, 0.95, 0.9, 0.8, 0.7, 0.6), 4: (1.0, 0.95, 0.9, 0.85, 0.8),
               5: (1.0, 0.97, 0.94, 0.9), 6: (1.0, 0.98, 0.96), 8: (1.0,)}
# Fractions of a group's largest magnitude the symmetric value encoder tries as its outermost level (`sym_values`)
SYM_RATIOS = {2: (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4), 3: (1.0, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5),
              4: (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7), 5: (1.0, 0.95, 0.9, 0.85, 0.8)}


def _outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """fp32 -> fp16, rounded up (or down) so the result bounds x; CodecError if not finite."""
    h = x.to(F16)
    limit = torch.full_like(h, float("inf") if up else float("-inf"))
    off = h.float() < x if up else h.float() > x
    h = torch.where(off, torch.nextafter(h, limit), h)
    if not bool(torch.isfinite(h).all()):
        raise CodecError("KV holds NaN/Inf or values beyond the fp16 range of scales")
    return h


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """The scale as fp32 with zeros replaced by one: all-zero groups quantize to 0, not NaN."""
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Pad `dim` to `size` by repeating the last slice, which leaves min and max unchanged."""
    have = x.shape[dim]
    if have == size:
        return x
    last = x.narrow(dim, have - 1, 1)
    reps = [-1] * x.dim()
    reps[dim] = size - have
    return torch.cat([x, last.expand(*reps)], dim=dim)


def _asym(x: torch.Tensor, dim: int, levels: int, ratios: tuple[float, ...] = (1.0,),
          span: int | None = None, extremes: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Asymmetric quantization of x (fp32) with one (scale, zero) per slice along `dim`.

    With several `ratios`, each slice's range is also tried shrunk about its middle by each
    ratio, and the (scale, zero, codes) of the smallest squared error are kept per slice.
    With `span` (8-bit range codes, `scalecodes`) the ranges are coded between the extremes of the
    slices across `span` (or between `extremes` given), and (extremes, range codes, codes) are returned instead.
    """
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    ext = extremes if extremes is not None else scalecodes.extremes_of(lo, hi, dim, span) if span is not None else None
    best: list[torch.Tensor] = []
    for ratio in ratios:
        mid, half = (lo + hi) * 0.5, (hi - lo) * (0.5 * ratio)
        low = lo if ratio == 1.0 else mid - half
        top = hi if ratio == 1.0 else mid + half
        if ext is None:
            zero = kept = _outward(low, up=False)
            scale = _outward((top - zero.float()) / levels, up=True)
        else:
            kept = scalecodes.codes_of(ext, low, top, dim)
            scale, zero = scalecodes.expand(ext, kept, dim, levels)
        zero32 = zero.float()
        q = ((x - zero32) / _safe(scale)).round_().clamp_(0, levels)
        if len(ratios) == 1:
            best = [scale, kept, q]
            break
        err = torch.addcmul(zero32, q, scale.float()).sub_(x).square_().sum(dim, keepdim=True)
        if not best:
            best = [scale, kept, q, err]
            continue
        better = err < best[3]
        best = [torch.where(better, new, old) for new, old in zip((scale, kept, q, err), best, strict=True)]
    return (best[0] if ext is None else ext), best[1], best[2].to(torch.uint8)


@functools.cache
def hadamard_cpu(dim: int) -> torch.Tensor:
    """Orthonormal, symmetric block-diagonal Hadamard matrix [dim, dim] (fp32, cpu).

    Blocks are Sylvester Hadamard matrices of the largest power of two dividing `dim` (at most
    128): 64 -> one 64x64 block, 96 -> three 32x32 blocks. The matrix is its own inverse.
    """
    size = min(dim & -dim, 128)
    block = torch.ones(1, 1)
    while block.shape[0] < size:
        block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
    return torch.kron(torch.eye(dim // size), block / math.sqrt(size)).contiguous()


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (fp32) times the block-Hadamard matrix: rotates, and undoes a rotation."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)  # one 2-D matmul; a view when x is contiguous
    return (flat @ hadamard_cpu(dim).to(x.device)).view(x.shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2**bits (bits 1, 2, 4 or 8), any shape -> uint8 [ceil(n * bits / 8)], low bits first."""
    per_byte = 8 // bits
    flat = q.reshape(-1)
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    cols = flat.view(-1, per_byte)  # [bytes, per_byte]
    out = cols[:, 0].clone()
    for j in range(1, per_byte):  # over the 2 or 4 values sharing a byte, not over the data
        out |= cols[:, j] << (bits * j)
    return out


def quantize(mode: str, kv: torch.Tensor, group: int, variant: Variant = PLAIN,
             hi: HiLayers = NO_HI, rope: Rope | None = None) -> list[torch.Tensor]:
    """kv [layers, 2, heads, tokens, dim] -> the payload sections of `layout`, on kv's device. `rope`: the model's,
    which `variant.unrope` needs (the keys' rotation is undone within the block before quantizing) and `key_classes`
    uses to rank channels by their RoPE pair."""
    if mode == "exact":
        return [kv.contiguous()]
    if mode == "fp16":
        half = kv.to(F16).contiguous()
        if kv.dtype != F16 and not bool(torch.isfinite(half).all()) and bool(torch.isfinite(kv).all()):
            raise CodecError("KV values overflow fp16; use mode exact")
        return [half]
    x = kv.float()
    if mode == "q8":  # [L, 2, T, H, D] rows, quantized in blocks of 32 channels: one flat section
        return [q8_rows(x.transpose(2, 3)).reshape(-1)]
    k, v = x[:, 0], x[:, 1]  # [L, H, T, D]
    if mode == "int8":
        sk, qk = _int8(k, 2)
        sv, qv = _int8(v, 3)
        return [sk, sv, qk, qv]
    if mode not in BITS:
        raise CodecError(f"unknown mode {mode!r}")
    if variant.split:
        if any(not 0 <= layer < k.shape[0] for layer in (*hi.up_keys, *hi.up_values)):
            raise CodecError(f"the codec gives layers {tuple(hi)} (keys, values) one bit more, but the KV has "
                             f"{k.shape[0]} layers")
        if variant.unrope:
            if rope is None:
                raise CodecError("keys without their RoPE (/unrope) need the model's RoPE, which this encoder lacks")
            k = turn(k, rope, -1)
        return _quantize_split(mode, k, v, group, variant, hi, rope)
    if hi != NO_HI or variant.scale8:
        raise CodecError("range codes and per-layer bits take a split layout (/outk, /symv or /kbits)")
    sk, zk, qk = _grouped_keys(k, group, BITS[mode], variant)
    sv, zv, qv = _grouped_values(v, group, BITS[mode], variant)
    return [sk, zk, sv, zv, pack(qk, BITS[mode]), pack(qv, BITS[mode])]


def _int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of x [L, H, T, D] (fp32) with one scale per slice along `dim`: (scale, codes)."""
    scale = _outward(x.abs().amax(dim=dim, keepdim=True) / 127, up=True)  # keys [L,H,1,D], values [L,H,T,1]
    return scale, (x / _safe(scale)).round_().clamp_(-127, 127).to(torch.int8)


def _grouped_keys(k: torch.Tensor, group: int, bits: int, variant: Variant) -> tuple[torch.Tensor, ...]:
    """Keys [L, H, T, D] (fp32) -> scale, zero [L, H, groups, 1, D] and codes [L, H, groups, group, D]."""
    n_layers, h, t, d = k.shape
    gk, nk, _, _ = groups(Dims(n_layers, h, t, d), group)
    kg = _pad(k, 2, nk * gk).view(n_layers, h, nk, gk, d)  # groups of tokens per channel
    return _asym(kg, 3, (1 << bits) - 1, CLIP_RATIOS[bits] if variant.clip else (1.0,),
                 scalecodes.KEY_SPAN if variant.scale8 else None)


def _grouped_values(v: torch.Tensor, group: int, bits: int, variant: Variant) -> tuple[torch.Tensor, ...]:
    """Values [L, H, T, D] (fp32) -> scale, zero [L, H, T, groups, 1] and codes [L, H, T, groups, group]."""
    n_layers, h, t, d = v.shape
    _, _, gv, nv = groups(Dims(n_layers, h, t, d), group)
    v = rotate(v) if variant.rot_values else v
    vg = _pad(v, 3, nv * gv).view(n_layers, h, t, nv, gv)  # groups of channels per token
    return _asym(vg, 4, (1 << bits) - 1, CLIP_RATIOS[bits] if variant.clip else (1.0,),
                 scalecodes.VALUE_SPAN if variant.scale8 else None)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack` of each q[i] (uint8 codes, leading dim = layers) padded to a whole byte, concatenated."""
    rows = q.reshape(q.shape[0], math.prod(q.shape[1:]))
    pad = (-rows.shape[1]) % (8 // bits)
    if pad:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], pad)], dim=1)
    return pack(rows, bits)


def _quantize_split(mode: str, k: torch.Tensor, v: torch.Tensor, group: int, variant: Variant,
                    hi: HiLayers = NO_HI, rope: Rope | None = None) -> list[torch.Tensor]:
    """The sections of `split_layout` (formats 5 to 7), in its order: `hi` may give layers one bit more (up_keys,
    up_values) with range codes; keys already without their RoPE where `variant.unrope`."""
    n_layers, h, t, d = k.shape
    bits = BITS[mode]
    low = (1 << bits) - 1
    out: dict[str, torch.Tensor] = {}
    if variant.unrope:
        assert rope is not None
        out["rope"] = rope.section().to(k.device)
    if variant.key_classes:
        if hi.up_keys:
            raise CodecError("key channel classes take no key layers one bit more")
        out |= _class_keys(k, mode, group, variant, rope)
    elif variant.outlier_keys:
        sk, zk, mask, qk, qko = _by_layers(lambda x, b: _outlier_keys(x, group, mode, variant, b), k, hi.up_keys,
                                           bits)
        hi_bits = OUTLIER_BITS[mode]
        out["mask"], out["pko"] = pack_mask(mask), pack_rows(qko, hi_bits) if hi_bits < 8 else qko.reshape(-1)
    else:
        sk, zk, qk = _by_layers(lambda x, b: _grouped_keys(x, group, b, variant), k, hi.up_keys, bits)
    if not variant.key_classes:
        out["sk"], out["zk"] = sk, zk
        out["pk"] = pack_rows(qk & low, bits)
    if hi.up_keys:
        out["pkt"] = pack_rows(qk[list(hi.up_keys)] >> bits, 1)
    if variant.sym_values:
        sv, svc, qv = _by_layers(lambda x, b: _sym_values(x, group, b, variant), v, hi.up_values, bits)
        out["sv"], out["svc"] = sv, svc
    else:
        out["sv"], out["zv"], qv = _by_layers(lambda x, b: _grouped_values(x, group, b, variant), v, hi.up_values,
                                              bits)
    out["pv"] = pack_rows(qv & low, bits)
    if hi.up_values:
        out["pvt"] = pack_rows(qv[list(hi.up_values)] >> bits, 1)
    return [out[name] for name in split_layout(mode, Dims(n_layers, h, t, d), group, variant, hi.counts)]


def _by_layers(quantize_at: Callable[[torch.Tensor, int], tuple[torch.Tensor, ...]], x: torch.Tensor,
               up: tuple[int, ...], bits: int) -> tuple[torch.Tensor, ...]:
    """`quantize_at(x, bits)`, but the layers `up` at bits + 1: every result is layers first, so the two are
    merged layer by layer."""
    if not up:
        return quantize_at(x, bits)
    rest = [layer for layer in range(x.shape[0]) if layer not in set(up)]
    raised = quantize_at(x[list(up)], bits + 1)
    own = quantize_at(x[rest], bits) if rest else raised
    merged = []
    for mine, more in zip(own, raised, strict=True):
        whole = more.new_empty((x.shape[0], *more.shape[1:]))
        if rest:
            whole[rest] = mine
        whole[list(up)] = more
        merged.append(whole)
    return tuple(merged)


def _outlier_keys(k: torch.Tensor, group: int, mode: str, variant: Variant,
                  bits: int | None = None) -> tuple[torch.Tensor, ...]:
    """Keys [L, H, T, D] (fp32) with each key group's `outlier_channels` widest channels at OUTLIER_BITS, the others
    at `bits` (the mode's by default): range extremes [L, H, groups, 2, 1] and codes [L, H, groups, 2, D] (each
    channel's at its own precision), the channel mask [L, H, groups, D], the other channels' codes [L, n] and the
    outlier channels' codes [L, m]."""
    n_layers, h, t, d = k.shape
    gk, nk, _, _ = groups(Dims(n_layers, h, t, d), group)
    kg = _pad(k, 2, nk * gk).view(n_layers, h, nk, gk, d)
    bits, hi_bits = bits or BITS[mode], OUTLIER_BITS[mode]
    clip = variant.clip
    width = (kg.amax(3) - kg.amin(3)).float()  # [L, H, groups, D]
    c = outlier_channels(mode, d)
    picked = width.topk(c, dim=-1).indices.sort(-1).values  # in channel order, as the mask lists them
    mask = torch.zeros_like(width, dtype=torch.bool).scatter_(-1, picked, True).unsqueeze(3)  # [L, H, groups, 1, D]
    at = picked.unsqueeze(3)  # [L, H, groups, 1, C]
    ext = scalecodes.extremes_of(kg.amin(3, keepdim=True), kg.amax(3, keepdim=True), 3, scalecodes.KEY_SPAN)
    _, zl, ql = _asym(kg, 3, (1 << bits) - 1, CLIP_RATIOS[bits] if clip else (1.0,), extremes=ext)
    # only the outlier channels at the higher precision: ranges are per channel, so they are what the whole would give
    _, zh, qh = _asym(kg.gather(4, at.expand(n_layers, h, nk, gk, c)), 3, (1 << hi_bits) - 1,
                       CLIP_RATIOS[hi_bits] if clip else (1.0,), extremes=ext)
    zero = zl.scatter(4, at.expand(n_layers, h, nk, 2, c), zh)  # the outlier channels' codes into theirs
    lo = ql.masked_select(~mask.expand_as(ql)).view(n_layers, -1)
    return ext, zero, mask.squeeze(3), lo, qh.reshape(n_layers, -1)


def _class_keys(k: torch.Tensor, mode: str, group: int, variant: Variant,
                rope: Rope | None) -> dict[str, torch.Tensor]:
    """Keys [L, H, T, D] (fp32) in channel classes (the mode's `KEY_CLASS_BITS`, `key_classes` of each): in every key
    group the channels ranked by importance, their mean square over the group's tokens (averaged over each RoPE pair
    where the model's RoPE is known: a query's energy lies in the same pairs) times their range squared, the error a
    channel's step leaves; the most important take the most bits, the least the fewest (0 bits: their group's mean
    alone, as range codes of [mean, mean]). The sections "sk", "zk" (range codes), "kcls" and the code pieces
    (`layout.key_streams`) of `split_layout`."""
    n_layers, h, t, d = k.shape
    gk, nk, _, _ = groups(Dims(n_layers, h, t, d), group)
    kg = _pad(k, 2, nk * gk).view(n_layers, h, nk, gk, d)
    lo, top = kg.amin(3, keepdim=True), kg.amax(3, keepdim=True)
    ext = scalecodes.extremes_of(lo, top, 3, scalecodes.KEY_SPAN)
    energy = kg.square().mean(3)  # [L, H, groups, D]
    weight = pair_mean(energy, rope.pairing) if rope is not None else energy
    score = weight * (top - lo).squeeze(3).square()
    class_bits, counts = KEY_CLASS_BITS[mode], key_classes(mode, d)
    by_rank = torch.tensor([c for c in reversed(range(len(counts))) for _ in range(counts[c])], dtype=torch.uint8,
                           device=k.device)
    order = score.argsort(dim=-1, descending=True, stable=True)
    cls = torch.empty_like(order, dtype=torch.uint8).scatter_(-1, order, by_rank.expand_as(order).contiguous())
    # each class's channels quantized apart (every group holds the same count of each): gathered, then put back
    by_class = cls.argsort(dim=-1, stable=True)  # [L, H, groups, D]: class 0's channels first, in channel order
    codes = torch.empty((n_layers, h, nk, 2, d), dtype=torch.uint8, device=k.device)
    q = torch.empty(kg.shape, dtype=torch.uint8, device=k.device)
    start = 0
    for c, b in enumerate(class_bits):
        n = counts[c]
        at = by_class[..., start:start + n].unsqueeze(3)  # [L, H, groups, 1, n]
        start += n
        if not n:
            continue
        part = kg.gather(4, at.expand(n_layers, h, nk, gk, n))
        if b:
            _, kept, qc = _asym(part, 3, (1 << b) - 1, CLIP_RATIOS[b] if variant.clip else (1.0,), extremes=ext)
        else:
            mean = part.mean(3, keepdim=True)
            kept, qc = scalecodes.codes_of(ext, mean, mean, 3), torch.zeros_like(part, dtype=torch.uint8)
        codes.scatter_(4, at.expand(n_layers, h, nk, 2, n), kept)
        q.scatter_(4, at.expand(n_layers, h, nk, gk, n), qc)
    out = {"sk": ext, "zk": codes, "kcls": pack(cls, 2).view(n_layers, h, nk, d // 4)}
    for name, width, _ in key_streams(mode, d):
        shifts = key_class_shifts(mode, width)
        has = torch.tensor([s is not None for s in shifts], device=k.device)
        shift = torch.tensor([s or 0 for s in shifts], dtype=torch.uint8, device=k.device)
        at = has[cls.long()].unsqueeze(3).expand_as(q)
        pieces = (q >> shift[cls.long()].unsqueeze(3)) & ((1 << width) - 1)
        out[name] = pack_rows(pieces.masked_select(at).view(n_layers, -1), width)
    return out


def _sym_values(v: torch.Tensor, group: int, bits: int, variant: Variant) -> tuple[torch.Tensor, ...]:
    """Values [L, H, T, D] (fp32) -> the scales' extremes [L, H, 1, groups, 1], their range codes [L, H, T, groups, 1]
    (each scale extreme * code / 255) and codes [L, H, T, groups, group]: value = (code - (2**bits - 1) / 2) * scale,
    the scale chosen per group among SYM_RATIOS of its largest magnitude for the smallest squared error."""
    n_layers, h, t, d = v.shape
    _, _, gv, nv = groups(Dims(n_layers, h, t, d), group)
    v = rotate(v) if variant.rot_values else v
    vg = _pad(v, 3, nv * gv).view(n_layers, h, t, nv, gv)
    top = (1 << bits) - 1
    mid = top / 2
    amax = vg.abs().amax(4, keepdim=True)
    ext = scalecodes.sym_extremes(amax / mid, 2)
    best: list[torch.Tensor] = []
    for ratio in SYM_RATIOS[bits] if variant.clip else (1.0,):
        kept = scalecodes.sym_codes(ext, amax * (ratio / mid))
        scale = scalecodes.sym_expand(ext, kept)
        s32 = _safe(scale)
        q = (vg / s32 + mid).round_().clamp_(0, top)
        err = (q - mid).mul_(s32).sub_(vg).square_().sum(4, keepdim=True)
        if not best:
            best = [scale, kept, q, err]
            continue
        better = err < best[3]
        best = [torch.where(better, new, old) for new, old in zip((scale, kept, q, err), best, strict=True)]
    return ext, best[1], best[2].to(torch.uint8)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., D] (D a multiple of 8) -> uint8 [..., D / 8]: bit c % 8 of byte c // 8 is channel c."""
    bits = mask.reshape(*mask.shape[:-1], mask.shape[-1] // 8, 8).to(torch.uint8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)
