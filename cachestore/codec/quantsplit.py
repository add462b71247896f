"""The quantizers of split layouts (frame formats 5 to 7, `layout.split_layout`): outlier key channels, key channel
classes, symmetric values, and layers one bit more; numpy arrays or torch tensors alike."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cachestore.codec import scalecodes
from cachestore.codec.arrays import Array, device_of, fixed_sum, from_host, namespace, round_clip, scatter, topk_indices
from cachestore.codec.frame import (
    KEY_CLASS_BITS,
    OUTLIER_BITS,
    key_class_shifts,
    key_classes,
    outlier_channels,
)
from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.grouped import (
    CLIP_RATIOS,
    SYM_RATIOS,
    asym,
    grouped_keys,
    grouped_values,
    pack,
    pack_rows,
    pad,
    safe,
)
from cachestore.codec.layout import NO_HI, Dims, HiLayers, Variant, groups, key_streams, split_layout
from cachestore.codec.rope import Rope, pair_mean
from cachestore.codec.rotation import rotate
from cachestore.errors import CodecError


def quantize_split(mode: str, k: Array, v: Array, group: int, variant: Variant,
                    hi: HiLayers = NO_HI, rope: Rope | None = None) -> list[Array]:
    """The sections of `split_layout` (formats 5 to 7), in its order: `hi` may give layers one bit more (up_keys,
    up_values) with range codes; keys already without their RoPE where `variant.unrope`."""
    n_layers, h, t, d = k.shape
    bits = BITS[mode]
    low = (1 << bits) - 1
    out: dict[str, Array] = {}
    if variant.unrope:
        assert rope is not None
        out["rope"] = rope.section(like=k)
    if variant.key_classes:
        if hi.up_keys:
            raise CodecError("key channel classes take no key layers one bit more")
        out |= _class_keys(k, mode, group, variant, rope)
    elif variant.outlier_keys:
        sk, zk, mask, qk, qko = _by_layers(lambda x, b: _outlier_keys(x, group, mode, variant, b), k, hi.up_keys,
                                           bits)
        hi_bits = OUTLIER_BITS[mode]
        xp = namespace(qko)
        out["mask"], out["pko"] = pack_mask(mask), pack_rows(qko, hi_bits) if hi_bits < 8 else xp.reshape(qko, (-1,))
    else:
        sk, zk, qk = _by_layers(lambda x, b: grouped_keys(x, group, b, variant), k, hi.up_keys, bits)
    if not variant.key_classes:
        out["sk"], out["zk"] = sk, zk
        out["pk"] = pack_rows(qk & low, bits)
    if hi.up_keys:
        out["pkt"] = pack_rows(_layers(qk, hi.up_keys) >> bits, 1)
    if variant.sym_values:
        sv, svc, qv = _by_layers(lambda x, b: _sym_values(x, group, b, variant), v, hi.up_values, bits)
        out["sv"], out["svc"] = sv, svc
    else:
        out["sv"], out["zv"], qv = _by_layers(lambda x, b: grouped_values(x, group, b, variant), v, hi.up_values,
                                              bits)
    out["pv"] = pack_rows(qv & low, bits)
    if hi.up_values:
        out["pvt"] = pack_rows(_layers(qv, hi.up_values) >> bits, 1)
    return [out[name] for name in split_layout(mode, Dims(n_layers, h, t, d), group, variant, hi.counts)]


def _layers(x: Array, layers: tuple[int, ...] | list[int]) -> Array:
    """x's leading slices `layers`, in that order (a copy)."""
    xp = namespace(x)
    return xp.take(x, from_host(_index(layers), xp, device_of(x)), axis=0)


def _index(layers: tuple[int, ...] | list[int]) -> np.ndarray:
    return np.asarray(layers, dtype=np.int64)


def _by_layers(quantize_at: Callable[[Array, int], tuple[Array, ...]], x: Array,
               up: tuple[int, ...], bits: int) -> tuple[Array, ...]:
    """`quantize_at(x, bits)`, but the layers `up` at bits + 1: every result is layers first, so the two are
    merged layer by layer."""
    if not up:
        return quantize_at(x, bits)
    xp = namespace(x)
    rest = [layer for layer in range(x.shape[0]) if layer not in set(up)]
    raised = quantize_at(_layers(x, up), bits + 1)
    own = quantize_at(_layers(x, rest), bits) if rest else raised
    merged = []
    for mine, more in zip(own, raised, strict=True):
        whole = xp.empty((x.shape[0], *more.shape[1:]), dtype=more.dtype, device=device_of(more))
        for rank, layer in enumerate(rest):
            whole[layer] = mine[rank]
        for rank, layer in enumerate(up):
            whole[layer] = more[rank]
        merged.append(whole)
    return tuple(merged)


def _outlier_keys(k: Array, group: int, mode: str, variant: Variant,
                  bits: int | None = None) -> tuple[Array, ...]:
    """Keys [L, H, T, D] (fp32) with each key group's `outlier_channels` widest channels at OUTLIER_BITS, the others
    at `bits` (the mode's by default): range extremes [L, H, groups, 2, 1] and codes [L, H, groups, 2, D] (each
    channel's at its own precision), the channel mask [L, H, groups, D], the other channels' codes [L, n] and the
    outlier channels' codes [L, m]."""
    xp = namespace(k)
    n_layers, h, t, d = k.shape
    gk, nk, _, _ = groups(Dims(n_layers, h, t, d), group)
    kg = xp.reshape(pad(k, 2, nk * gk), (n_layers, h, nk, gk, d))
    bits, hi_bits = bits or BITS[mode], OUTLIER_BITS[mode]
    clip = variant.clip
    lo, top = xp.min(kg, axis=3, keepdims=True), xp.max(kg, axis=3, keepdims=True)
    width = (top - lo)[:, :, :, 0]  # [L, H, groups, D]
    c = outlier_channels(mode, d)
    picked = topk_indices(width, c)  # in channel order, as the mask lists them; ties to the lower channel
    mask = scatter(xp.zeros(width.shape, dtype=xp.bool, device=device_of(k)), -1, picked,
                   xp.ones(picked.shape, dtype=xp.bool, device=device_of(k)))[:, :, :, None, :]  # [L, H, groups, 1, D]
    at = picked[:, :, :, None, :]  # [L, H, groups, 1, C]
    ext = scalecodes.extremes_of(lo, top, 3, scalecodes.KEY_SPAN)
    _, zl, ql = asym(kg, 3, (1 << bits) - 1, CLIP_RATIOS[bits] if clip else (1.0,), extremes=ext)
    # only the outlier channels at the higher precision: ranges are per channel, so they are what the whole would give
    _, zh, qh = asym(xp.take_along_axis(kg, xp.broadcast_to(at, (n_layers, h, nk, gk, c)), axis=4), 3,
                      (1 << hi_bits) - 1, CLIP_RATIOS[hi_bits] if clip else (1.0,), extremes=ext)
    zero = scatter(zl, 4, xp.broadcast_to(at, (n_layers, h, nk, 2, c)), zh)  # the outlier channels' codes into theirs
    rest = xp.reshape(ql[~xp.broadcast_to(mask, ql.shape)], (n_layers, -1))
    return ext, zero, mask[:, :, :, 0, :], rest, xp.reshape(qh, (n_layers, -1))


def _class_keys(k: Array, mode: str, group: int, variant: Variant, rope: Rope | None) -> dict[str, Array]:
    """Keys [L, H, T, D] (fp32) in channel classes (the mode's `KEY_CLASS_BITS`, `key_classes` of each): in every key
    group the channels ranked by importance, their mean square over the group's tokens (averaged over each RoPE pair
    where the model's RoPE is known: a query's energy lies in the same pairs) times their range squared, the error a
    channel's step leaves; the most important take the most bits, the least the fewest (0 bits: their group's mean
    alone, as range codes of [mean, mean]). The sections "sk", "zk" (range codes), "kcls" and the code pieces
    (`layout.key_streams`) of `split_layout`."""
    xp = namespace(k)
    device = device_of(k)
    n_layers, h, t, d = k.shape
    gk, nk, _, _ = groups(Dims(n_layers, h, t, d), group)
    kg = xp.reshape(pad(k, 2, nk * gk), (n_layers, h, nk, gk, d))
    lo, top = xp.min(kg, axis=3, keepdims=True), xp.max(kg, axis=3, keepdims=True)
    ext = scalecodes.extremes_of(lo, top, 3, scalecodes.KEY_SPAN)
    energy = fixed_sum(kg * kg, 3)[:, :, :, 0] / gk  # [L, H, groups, D]
    weight = pair_mean(energy, rope.pairing) if rope is not None else energy
    width = (top - lo)[:, :, :, 0]
    score = weight * (width * width)
    class_bits, counts = KEY_CLASS_BITS[mode], key_classes(mode, d)
    ranks = np.array([c for c in reversed(range(len(counts))) for _ in range(counts[c])], dtype=np.uint8)
    by_rank = from_host(ranks, xp, device)
    order = xp.argsort(score, axis=-1, descending=True, stable=True)
    cls = scatter(xp.zeros(order.shape, dtype=xp.uint8, device=device), -1, order,
                  xp.broadcast_to(by_rank, order.shape))
    # each class's channels quantized apart (every group holds the same count of each): gathered, then put back
    by_class = xp.argsort(cls, axis=-1, stable=True)  # [L, H, groups, D]: class 0's channels first, in channel order
    codes = xp.zeros((n_layers, h, nk, 2, d), dtype=xp.uint8, device=device)
    q = xp.zeros(kg.shape, dtype=xp.uint8, device=device)
    start = 0
    for c, b in enumerate(class_bits):
        n = counts[c]
        at = by_class[..., start:start + n][:, :, :, None, :]  # [L, H, groups, 1, n]
        start += n
        if not n:
            continue
        part = xp.take_along_axis(kg, xp.broadcast_to(at, (n_layers, h, nk, gk, n)), axis=4)
        if b:
            _, kept, qc = asym(part, 3, (1 << b) - 1, CLIP_RATIOS[b] if variant.clip else (1.0,), extremes=ext)
        else:
            mean = fixed_sum(part, 3) / gk
            kept, qc = scalecodes.codes_of(ext, mean, mean, 3), xp.zeros(part.shape, dtype=xp.uint8, device=device)
        codes = scatter(codes, 4, xp.broadcast_to(at, (n_layers, h, nk, 2, n)), kept)
        q = scatter(q, 4, xp.broadcast_to(at, (n_layers, h, nk, gk, n)), qc)
    out = {"sk": ext, "zk": codes, "kcls": xp.reshape(pack(cls, 2), (n_layers, h, nk, d // 4))}
    cls_index = xp.astype(cls, xp.int64)
    for name, width_bits, _ in key_streams(mode, d):
        shifts = key_class_shifts(mode, width_bits)
        has = from_host(np.array([s is not None for s in shifts]), xp, device)
        shift = from_host(np.array([s or 0 for s in shifts], dtype=np.uint8), xp, device)
        at = xp.broadcast_to(has[cls_index][:, :, :, None, :], q.shape)
        pieces = (q >> shift[cls_index][:, :, :, None, :]) & ((1 << width_bits) - 1)
        out[name] = pack_rows(xp.reshape(pieces[at], (n_layers, -1)), width_bits)
    return out


def _sym_values(v: Array, group: int, bits: int, variant: Variant) -> tuple[Array, ...]:
    """Values [L, H, T, D] (fp32) -> the scales' extremes [L, H, 1, groups, 1], their range codes [L, H, T, groups, 1]
    (each scale extreme * code / 255) and codes [L, H, T, groups, group]: value = (code - (2**bits - 1) / 2) * scale,
    the scale chosen per group among SYM_RATIOS of its largest magnitude for the smallest squared error."""
    xp = namespace(v)
    n_layers, h, t, d = v.shape
    _, _, gv, nv = groups(Dims(n_layers, h, t, d), group)
    v = rotate(v) if variant.rot_values else v
    vg = xp.reshape(pad(v, 3, nv * gv), (n_layers, h, t, nv, gv))
    top = (1 << bits) - 1
    mid = top / 2
    amax = xp.max(xp.abs(vg), axis=4, keepdims=True)
    ext = scalecodes.sym_extremes(amax / mid, 2)
    best: list[Array] = []
    for ratio in SYM_RATIOS[bits] if variant.clip else (1.0,):
        kept = scalecodes.sym_codes(ext, amax * (ratio / mid))
        scale = scalecodes.sym_expand(ext, kept)
        s32 = safe(scale)
        q = round_clip(vg / s32 + mid, 0, top)
        err = q - mid
        err *= s32
        err -= vg
        err *= err
        err = fixed_sum(err, 4)
        if not best:
            best = [scale, kept, q, err]
            continue
        better = err < best[3]
        best = [xp.where(better, new, old) for new, old in zip((scale, kept, q, err), best, strict=True)]
    return ext, best[1], xp.astype(best[2], xp.uint8)


def pack_mask(mask: Array) -> Array:
    """bool [..., D] (D a multiple of 8) -> uint8 [..., D / 8]: bit c % 8 of byte c // 8 is channel c."""
    xp = namespace(mask)
    bits = xp.astype(xp.reshape(mask, (*mask.shape[:-1], mask.shape[-1] // 8, 8)), xp.uint8)
    out = xp.astype(bits[..., 0], xp.uint8, copy=True)
    for j in range(1, 8):
        out |= bits[..., j] << j
    return out
