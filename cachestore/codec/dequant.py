"""Dequantization of every codec mode: payload sections back to KV, written straight into the caller's output
(a strided view of a context is fine), by the native kernels where the CPU and the layout allow; numpy arrays or
torch tensors alike (`cachestore.codec.arrays`: the output's kind and device)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np

from cachestore.codec import kernels, scalecodes
from cachestore.codec.arrays import (
    Array,
    affine_into,
    device_of,
    dtype_name,
    from_host,
    namespace,
    reshape_view,
    scatter,
)
from cachestore.codec.arrays import dtype as dtype_in
from cachestore.codec.frame import (
    KEY_CLASS_BITS,
    OUTLIER_BITS,
    key_class_shifts,
    key_classes,
    outlier_channels,
)
from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.layout import PLAIN, Dims, Variant, groups, key_streams, split_layout
from cachestore.codec.q8 import Q8_BLOCK, Q8_BYTES, q8_rows_into
from cachestore.codec.rope import Rope, turn_into
from cachestore.codec.rotation import rotate
from cachestore.errors import CodecError

_LITTLE_ENDIAN = sys.byteorder == "little"


def unpack(packed: Array, bits: int, count: int) -> Array:
    """The inverse of `pack`: uint8 [bytes] -> uint8 [count].

    Each byte is widened to a lane of `8 // bits` bytes and its fields are shifted into the
    lane's bytes at once (int16 lanes for int4, int32 for int2, int64 for 1 bit): several times faster on CPUs
    than shifting a broadcast uint8 array once per field.
    """
    xp = namespace(packed)
    if bits == 4:
        lanes = xp.astype(packed, xp.int16)
        out = lanes << 4
        out |= lanes
        out &= 0x0F0F  # byte 0: low nibble, byte 1: high nibble (little-endian lanes)
    elif bits == 2:
        lanes = xp.astype(packed, xp.int32)
        out = lanes << 6
        out |= lanes
        out |= lanes << 12
        out |= lanes << 18
        out &= 0x03030303
    elif bits == 1:  # bit i of the byte -> byte i of an int64 lane: shifted left by 7 * i
        lanes = xp.astype(packed, xp.int64)
        out = lanes << 7
        out |= lanes
        for i in range(2, 8):
            out |= lanes << (7 * i)
        out &= 0x0101010101010101
    else:
        raise CodecError(f"cannot unpack {bits}-bit fields")
    flat = out.view(dtype_in(xp, "uint8"))
    if not _LITTLE_ENDIAN:
        return xp.reshape(xp.flip(xp.reshape(flat, (-1, 8 // bits)), axis=1), (-1,))[:count]
    return flat[:count]


def dequantize(mode: str, parts: list[Array], dims: Dims, group: int, dtype: str, out: Array | None = None,
               variant: Variant = PLAIN, up: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> Array:
    """Payload sections (of one kind, on the target device) -> kv [layers, 2, heads, tokens, dim] of dtype (a name).
    `up`: the layers (of those the sections hold) whose keys / values a split frame's table gives one bit more.

    With `out` (that shape, any float dtype, possibly a strided view, of the sections' kind) the result is written
    there in out's dtype and `out` is returned: no intermediate array of the whole KV.
    """
    n_layers, h, t, d = dims
    xp = namespace(*parts) if out is None else namespace(out)
    if mode in ("exact", "fp16"):
        if out is None:
            return parts[0] if mode == "exact" else xp.astype(parts[0], dtype_in(xp, dtype))
        out[...] = parts[0]
        return out
    if out is None:
        out = xp.empty((n_layers, 2, h, t, d), dtype=dtype_in(xp, dtype), device=device_of(parts[0]))
    if mode == "q8":
        rows = xp.reshape(parts[0], (n_layers, 2, t, h, d // Q8_BLOCK * Q8_BYTES))
        q8_rows_into(xp.permute_dims(out, (0, 1, 3, 2, 4)), rows)
        return out
    if mode == "int8":
        sk, sv, qk, qv = parts
        int8_codes_into(out[:, 0], qk, sk)
        int8_codes_into(out[:, 1], qv, sv)
        return out
    if variant.split:
        return _dequantize_split(mode, parts, dims, group, out, variant, up)
    gk, nk, gv, nv = groups(dims, group)
    sk, zk, sv, zv, pk, pv = parts
    bits = BITS[mode]
    halves = ((pk, sk, zk, (n_layers, h, nk, gk, d), 2, False),
              (pv, sv, zv, (n_layers, h, t, nv, gv), 3, variant.rot_values))
    for half, (packed, scale, zero, shape, dim, rot) in enumerate(halves):
        if not (bits == 4 and not rot and _int4_into(out[:, half], packed, scale, zero, shape, dim)):
            q = xp.reshape(unpack(packed, bits, math.prod(shape)), shape)
            _affine_into(out[:, half], q, scale, zero, dim, rot)
    return out


def _dequantize_split(mode: str, parts: list[Array], dims: Dims, group: int, out: Array,
                      variant: Variant, up: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> Array:
    """The sections of `split_layout` (formats 5 to 7, range codes expanded; `dims` the layers they hold, `up` the
    layers of them one bit more) -> out [layers, 2, heads, tokens, dim]. A mask that does not mark exactly
    `outlier_channels` channels of every key group, or a class map without each class's count, raises CodecError."""
    xp = namespace(out)
    n_layers, h, t, d = dims
    gk, nk, gv, nv = groups(dims, group)
    bits = BITS[mode]
    up_k, up_v = up
    sec = dict(zip(split_layout(mode, dims, group, variant, (len(up_k), len(up_v))), parts, strict=True))
    kshape = (n_layers, h, nk, gk, d)
    c = outlier_channels(mode, d) if variant.outlier_keys else 0
    if variant.key_classes:
        codes = _class_codes(sec, mode, n_layers, kshape)
    elif variant.outlier_keys:
        lo = _raised_codes(sec["pk"], sec.get("pkt"), bits, n_layers, h * nk * gk * (d - c), up_k)
        mask = unpack_mask(sec["mask"], d)  # [L, H, groups, D]
        if not bool(xp.all(xp.sum(xp.astype(mask, xp.int32), axis=-1) == c)):
            raise CodecError(f"outlier key mask does not mark {c} channels in every key group")
        where = xp.broadcast_to(mask[:, :, :, None, :], kshape)
        codes = xp.empty(kshape, dtype=xp.uint8, device=device_of(mask))
        hi_bits = OUTLIER_BITS[mode]
        hi = _layer_codes(sec["pko"], hi_bits, n_layers, h * nk * gk * c) if hi_bits < 8 else sec["pko"]
        codes[~where] = lo
        codes[where] = xp.reshape(hi, (-1,))
    else:
        codes = xp.reshape(_raised_codes(sec["pk"], sec.get("pkt"), bits, n_layers, h * nk * gk * d, up_k), kshape)
    _affine_into(out[:, 0], codes, sec["sk"], sec["zk"], 2, False)
    if variant.unrope:  # the keys' RoPE, undone within the block, redone
        turn_into(out[:, 0], Rope.from_section(sec["rope"]), 1)
    vshape = (n_layers, h, t, nv, gv)
    if bits == 4 and not variant.sym_values and not variant.rot_values:
        if _int4_layers_into(out[:, 1], sec["pv"], sec.get("pvt"), sec["sv"], sec["zv"], vshape, up_v):
            return out
    qv = xp.reshape(_raised_codes(sec["pv"], sec.get("pvt"), bits, n_layers, h * t * nv * gv, up_v), vshape)
    if variant.sym_values:  # (code - mid) * scale: the affine map with zero point -mid * scale
        scale = xp.astype(sec["sv"], xp.float32)
        mid = _levels(xp, n_layers, bits, up_v, device_of(scale)) / 2
        _affine_into(out[:, 1], qv, scale, scale * -mid, 3, variant.rot_values)
    else:
        _affine_into(out[:, 1], qv, sec["sv"], sec["zv"], 3, variant.rot_values)
    return out


def key_class_map(packed: Array, mode: str, dim: int) -> Array:
    """A KEY_CLASSES frame's "kcls" [L, H, groups, D / 4] -> each key channel's class [L, H, groups, D] (uint8, an
    index into the mode's KEY_CLASS_BITS); CodecError unless every group holds each class's `key_classes` count."""
    xp = namespace(packed)
    count_all = math.prod(packed.shape)
    cls = xp.reshape(unpack(xp.reshape(packed, (-1,)), 2, count_all * 4), (*packed.shape[:-1], dim))
    for c, count in enumerate(key_classes(mode, dim)):
        if not bool(xp.all(xp.sum(xp.astype(cls == c, xp.int32), axis=-1) == count)):
            raise CodecError(f"key channel classes: a group without {count} channels of {KEY_CLASS_BITS[mode][c]} "
                             f"bits")
    return cls


def _class_codes(sec: dict[str, Array], mode: str, layers: int, kshape: tuple[int, ...]) -> Array:
    """A KEY_CLASSES frame's key codes [L, H, groups, group, D] from its class map (as `expand_split` leaves it:
    [L, H, groups, D]) and code pieces. Every token of a group has each width's pieces in channel order, so the
    channel of each piece is known from the class map: every piece is shifted to its place in its channel's code and
    put there, one scatter a width (a channel's pieces hold disjoint bits: or-ing them adds them)."""
    n_layers, h, g, t, d = kshape
    cls = sec["kcls"]
    xp = namespace(cls)
    device = device_of(cls)
    cls_index = xp.astype(cls, xp.int64)  # unpacked and checked by `expand_split`: each class has its count
    per = h * g * t  # tokens of a layer
    codes = xp.zeros(kshape, dtype=xp.uint8, device=device)
    for name, width, n in key_streams(mode, d):
        shifts = key_class_shifts(mode, width)
        has = from_host(np.array([s is not None for s in shifts]), xp, device)[cls_index]  # [L, H, groups, D]
        channel = xp.reshape(xp.nonzero(has)[-1], (n_layers, h, g, n))  # row-major: each group's channels in order
        piece = xp.reshape(_layer_codes(sec[name], width, layers, per * n), (n_layers, h, g, t, n))
        if any(s for s in shifts if s is not None):
            shift = from_host(np.array([s or 0 for s in shifts], dtype=np.uint8), xp, device)[cls_index]
            piece = piece << xp.take_along_axis(shift, channel, axis=-1)[:, :, :, None, :]
        index = xp.broadcast_to(channel[:, :, :, None, :], (n_layers, h, g, t, n))
        codes |= scatter(xp.zeros(kshape, dtype=xp.uint8, device=device), -1, index, piece)
    return codes


def _raised_codes(packed: Array, top: Array | None, bits: int, layers: int, per_layer: int,
                  up: tuple[int, ...]) -> Array:
    """`_layer_codes` of every layer at `bits`, the layers `up` with their top bits (packed per layer in `top`)
    added: uint8 [layers * per_layer]."""
    q = _layer_codes(packed, bits, layers, per_layer)
    if up and top is not None:
        xp = namespace(q)
        q = xp.reshape(q, (layers, per_layer))
        q[list(up)] = q[list(up)] | (xp.reshape(_layer_codes(top, 1, len(up), per_layer), (len(up), per_layer)) << bits)
        q = xp.reshape(q, (-1,))
    return q


def _levels(xp: object, layers: int, bits: int, raised: tuple[int, ...], device: object) -> Array:
    """The highest code of each layer [layers, 1, 1, 1, 1] (fp32): 2**bits - 1, one bit more in the layers `raised`."""
    per_layer = xp.full((layers, 1, 1, 1, 1), float((1 << bits) - 1), dtype=xp.float32,  # type: ignore[attr-defined]
                        device=device)
    if raised:
        per_layer[list(raised)] = float((2 << bits) - 1)
    return per_layer


def expand_split(mode: str, parts: list[Array], dims: Dims, group: int, variant: Variant,
                 up: tuple[tuple[int, ...], tuple[int, ...]]) -> list[Array]:
    """A split frame's sections (`split_layout`, the whole frame) with its range codes expanded to fp16
    scales and zero points: key channels at their own levels (outlier channels OUTLIER_BITS, those of a key class
    its bits, the others the mode's bits or one more in the layers `up[0]`), values at their layer's. A key class
    map comes back unpacked, [L, H, groups, D] (`key_class_map`: CodecError unless each class has its count)."""
    names = list(split_layout(mode, dims, group, variant, (len(up[0]), len(up[1]))))
    sec = dict(zip(names, parts, strict=True))
    bits = BITS[mode]
    xp = namespace(*parts)
    device = device_of(parts[0])
    key_levels = _levels(xp, dims.layers, bits, up[0], device)
    if variant.key_classes:  # the class map unpacked (and checked) once, for the levels here and the codes' places
        sec["kcls"] = key_class_map(sec["kcls"], mode, dims.head_dim)  # [L, H, groups, D]
        levels = from_host(np.array([max(1, (1 << b) - 1) for b in KEY_CLASS_BITS[mode]], dtype=np.float32), xp,
                           device)  # 0 bits: one level (the zero point alone)
        key_levels = levels[xp.astype(sec["kcls"], xp.int64)][:, :, :, None, :]
    elif variant.outlier_keys:
        mask = unpack_mask(sec["mask"], dims.head_dim)[:, :, :, None, :]  # [L, H, groups, 1, D]
        key_levels = xp.where(mask, float((1 << OUTLIER_BITS[mode]) - 1), key_levels)
    sec["sk"], sec["zk"] = scalecodes.expand(sec["sk"], sec["zk"], scalecodes.KEY_AXIS, key_levels)
    if variant.sym_values:
        sec["sv"] = scalecodes.sym_expand(sec["sv"], sec["svc"])
    else:
        sec["sv"], sec["zv"] = scalecodes.expand(sec["sv"], sec["zv"], scalecodes.VALUE_AXIS,
                                                 _levels(xp, dims.layers, bits, up[1], device))
    return [sec[name] for name in names]


def _layer_codes(packed: Array, bits: int, layers: int, per_layer: int) -> Array:
    """Codes packed per layer, each layer padded to a whole byte (`grouped.pack_rows`) -> uint8 [layers * per_layer]."""
    xp = namespace(packed)
    per_byte = 8 // bits
    row = -(-per_layer // per_byte)
    q = xp.reshape(unpack(xp.reshape(packed, (-1,)), bits, layers * row * per_byte), (layers, row * per_byte))
    return xp.reshape(q[:, :per_layer], (-1,))


def unpack_mask(packed: Array, dim: int) -> Array:
    """uint8 [..., dim / 8] -> bool [..., dim]: the inverse of `quantsplit.pack_mask`."""
    xp = namespace(packed)
    shifts = from_host(np.arange(8, dtype=np.uint8), xp, device_of(packed))
    return xp.reshape(xp.astype((packed[..., None] >> shifts) & 1, xp.bool), (*packed.shape[:-1], dim))


def _int4_into(out: Array, packed: Array, scale: Array, zero: Array, shape: tuple[int, ...], dim: int) -> bool:
    """`_affine_into` of int4 codes still packed ([L, H, groups, group, D] for keys, dim 2; [L, H, T, groups, group]
    for values, dim 3), unpacked, scaled and offset in one pass (cachestore.codec.kernels); False where that does not
    apply (codes padded past out's size, or no kernel): nothing written."""
    if shape[dim] * shape[dim + 1] != out.shape[dim]:
        return False
    try:
        grouped = _grouped(out, shape, dim)
    except (RuntimeError, ValueError):
        return False
    return kernels.int4_into(grouped, packed, scale, zero)


def _int4_layers_into(out: Array, packed: Array, top: Array | None, scale: Array, zero: Array,
                      shape: tuple[int, ...], up: tuple[int, ...]) -> bool:
    """`_affine_into` of a split frame's int4 values (`_raised_codes`: packed per layer, the layers `up` with a top
    bit in `top`) a layer at a time: the kernel's one pass (`_int4_into`) for the 4-bit layers, the library's for the
    others. False where the kernel does not apply (nothing written, or every layer left to the caller to write)."""
    layers, per_layer = shape[0], math.prod(shape[1:])
    if per_layer % 2 or not kernels.enabled() or (up and top is None):
        return False
    xp = namespace(packed)
    flat, half, one = xp.reshape(packed, (-1,)), per_layer // 2, (1, *shape[1:])
    for n in range(layers):
        if n not in up and not _int4_into(out[n:n + 1], flat[n * half:(n + 1) * half], scale[n:n + 1],
                                          zero[n:n + 1], one, 3):
            return False
    if up:
        assert top is not None
        tops = xp.reshape(_layer_codes(top, 1, len(up), per_layer), (len(up), per_layer))
        for rank, n in enumerate(up):
            q = unpack(flat[n * half:(n + 1) * half], 4, per_layer) | (tops[rank] << 4)
            _affine_into(out[n:n + 1], xp.reshape(q, one), scale[n:n + 1], zero[n:n + 1], 3, False)
    return True


def _grouped(out: Array, shape: Sequence[int], dim: int) -> Array:
    """out [L, H, T, D] viewed as codes of `shape` group it: dim `dim` split into shape[dim] groups of
    shape[dim + 1] (keys: T, dim 2; values: D, dim 3); ValueError where no view can."""
    return reshape_view(out, (*out.shape[:dim], shape[dim], shape[dim + 1], *out.shape[dim + 1:]))


def int8_codes_into(out: Array, q: Array, scale: Array) -> None:
    """out [L, H, T, D] (any float dtype, a strided view is fine; or [L, frames, H, T, D], a run of frames) = int8 codes
    q times their fp16 scale."""
    if kernels.int8_into(out, q, scale):  # one pass, where the CPU and the layout allow: the same values
        return
    xp = namespace(out)
    if dtype_name(out) == "float32":  # int8 -> fp32 copy is vectorized: ~4x the fp16 route here
        out[...] = q
        out *= xp.astype(scale, xp.float32)
        return
    # fp16 (llama.cpp's context): the exact fp32 product rounded once into out, as an fp16 multiply rounds it; through a
    # frame-sized fp32 temporary, 25% faster here than building fp16 codes from their bits and multiplying in fp16
    wide = xp.astype(q, xp.float32)
    wide *= xp.astype(scale, xp.float32)
    out[...] = wide


def _affine_into(out: Array, q: Array, scale: Array, zero: Array, dim: int, rot: bool) -> None:
    """out [L, H, T, D] = q * scale + zero (rotated back if `rot`), q grouped along `dim` of out.

    q [L, H, groups, group, D] (dim 2) or [L, H, T, groups, group] (dim 3), possibly padded past
    out's size along `dim`. Without padding or rotation the codes are converted, scaled and
    offset in out itself: no temporary array the size of the KV (a fresh one costs page faults).
    """
    xp = namespace(out)
    size = out.shape[dim]
    padded = q.shape[dim] * q.shape[dim + 1] != size
    scale32, zero32 = xp.astype(scale, xp.float32), xp.astype(zero, xp.float32)  # q * scale is exact in fp32
    if not padded and not rot and dtype_name(out) == "float32":
        try:
            grouped = _grouped(out, q.shape, dim)
        except (RuntimeError, ValueError):
            grouped = None
        if grouped is not None:
            grouped[...] = q
            affine_into(grouped, scale32, zero32)  # scaled and offset in one pass over out where the library can
            return
    x = xp.astype(q, xp.float32)
    affine_into(x, scale32, zero32)
    x = xp.reshape(x, (*x.shape[:dim], x.shape[dim] * x.shape[dim + 1], *x.shape[dim + 2:]))[
        (slice(None),) * dim + (slice(0, size),)]
    out[...] = rotate(x) if rot else x
