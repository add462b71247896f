"""Quantizers of the codec modes: KV to payload sections, vectorized over numpy arrays or torch tensors alike
(`cachestore.codec.arrays`).

Every function works on its input's own kind and device. KV is [layers, 2, kv_heads, tokens,
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

from cachestore.codec.arrays import Array, namespace
from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.grouped import grouped_keys, grouped_values, int8, pack
from cachestore.codec.layout import NO_HI, PLAIN, HiLayers, Variant
from cachestore.codec.q8 import q8_rows
from cachestore.codec.quantsplit import quantize_split
from cachestore.codec.rope import Rope, turn
from cachestore.codec.rotation import rotate
from cachestore.errors import CodecError

__all__ = ["quantize", "rotate"]


def quantize(mode: str, kv: Array, group: int, variant: Variant = PLAIN,
             hi: HiLayers = NO_HI, rope: Rope | None = None) -> list[Array]:
    """kv [layers, 2, heads, tokens, dim] -> the payload sections of `layout`, of kv's kind, on its device. `rope`: the
    model's, which `variant.unrope` needs (the keys' rotation is undone within the block before quantizing) and
    `key_classes` uses to rank channels by their RoPE pair."""
    xp = namespace(kv)
    if mode == "exact":
        return [kv]
    if mode == "fp16":
        half = xp.astype(kv, xp.float16)
        if kv.dtype != xp.float16 and not bool(xp.all(xp.isfinite(half))) and bool(xp.all(xp.isfinite(kv))):
            raise CodecError("KV values overflow fp16; use mode exact")
        return [half]
    x = xp.astype(kv, xp.float32)
    if mode == "q8":  # [L, 2, T, H, D] rows, quantized in blocks of 32 channels: one flat section
        return [xp.reshape(q8_rows(xp.permute_dims(x, (0, 1, 3, 2, 4))), (-1,))]
    k, v = x[:, 0], x[:, 1]  # [L, H, T, D]
    if mode == "int8":
        sk, qk = int8(k, 2)
        sv, qv = int8(v, 3)
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
        return quantize_split(mode, k, v, group, variant, hi, rope)
    if hi != NO_HI or variant.scale8:
        raise CodecError("range codes and per-layer bits take a split layout (/outk, /symv or /kbits)")
    sk, zk, qk = grouped_keys(k, group, BITS[mode], variant)
    sv, zv, qv = grouped_values(v, group, BITS[mode], variant)
    return [sk, zk, sv, zv, pack(qk, BITS[mode]), pack(qv, BITS[mode])]
