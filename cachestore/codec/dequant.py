"""Dequantization of every codec mode: payload sections back to KV, written straight into the caller's output
(a strided view of a context is fine), by the native kernels where the CPU and the layout allow."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from cachestore.codec import kernels, scalecodes
from cachestore.codec.frame import (
    KEY_CLASS_BITS,
    OUTLIER_BITS,
    key_class_shifts,
    key_classes,
    outlier_channels,
)
from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.layout import F16, PLAIN, Dims, Variant, groups, key_streams, split_layout
from cachestore.codec.q8 import Q8_BLOCK, Q8_BYTES, q8_rows_into
from cachestore.codec.quant import hadamard_cpu, rotate
from cachestore.codec.rope import Rope, turn_into
from cachestore.errors import CodecError

_LITTLE_ENDIAN = sys.byteorder == "little"


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The inverse of `pack`: uint8 [bytes] -> uint8 [count].

    Each byte is widened to a lane of `8 // bits` bytes and its fields are shifted into the
    lane's bytes at once (int16 lanes for int4, int32 for int2, int64 for 1 bit): several times faster on CPUs
    than shifting a broadcast uint8 tensor once per field.
    """
    if bits == 4:
        lanes = packed.to(torch.int16)
        out = lanes << 4
        out |= lanes
        out &= 0x0F0F  # byte 0: low nibble, byte 1: high nibble (little-endian lanes)
    elif bits == 2:
        lanes = packed.to(torch.int32)
        out = lanes << 6
        out |= lanes
        out |= lanes << 12
        out |= lanes << 18
        out &= 0x03030303
    elif bits == 1:  # bit i of the byte -> byte i of an int64 lane: shifted left by 7 * i
        lanes = packed.to(torch.int64)
        out = lanes << 7
        out |= lanes
        for i in range(2, 8):
            out |= lanes << (7 * i)
        out &= 0x0101010101010101
    else:
        raise CodecError(f"cannot unpack {bits}-bit fields")
    if not _LITTLE_ENDIAN:
        return out.view(torch.uint8).view(-1, 8 // bits).flip(1).reshape(-1)[:count]
    return out.view(torch.uint8)[:count]


def dequantize(mode: str, parts: list[torch.Tensor], dims: Dims, group: int,
               dtype: torch.dtype, out: torch.Tensor | None = None,
               variant: Variant = PLAIN, up: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> torch.Tensor:
    """Payload sections (on the target device) -> kv [layers, 2, heads, tokens, dim] of dtype. `up`: the layers
    (of those the sections hold) whose keys / values a split frame's table gives one bit more.

    With `out` (that shape, any float dtype, possibly a strided view) the result is written there
    in out's dtype and `out` is returned: no intermediate tensor of the whole KV.
    """
    n_layers, h, t, d = dims
    if out is not None:
        dtype = out.dtype
    if mode in ("exact", "fp16"):
        if out is None:
            return parts[0] if mode == "exact" else parts[0].to(dtype)
        return out.copy_(parts[0])
    if out is None:
        out = torch.empty((n_layers, 2, h, t, d), dtype=dtype, device=parts[0].device)
    if mode == "q8":
        q8_rows_into(out.transpose(2, 3), parts[0].view(n_layers, 2, t, h, d // Q8_BLOCK * Q8_BYTES))
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
            q = unpack(packed, bits, math.prod(shape)).view(shape)
            _affine_into(out[:, half], q, scale, zero, dim, rot)
    return out


def _dequantize_split(mode: str, parts: list[torch.Tensor], dims: Dims, group: int, out: torch.Tensor,
                      variant: Variant, up: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> torch.Tensor:
    """The sections of `split_layout` (formats 5 to 7, range codes expanded; `dims` the layers they hold, `up` the
    layers of them one bit more) -> out [layers, 2, heads, tokens, dim]. A mask that does not mark exactly
    `outlier_channels` channels of every key group, or a class map without each class's count, raises CodecError."""
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
        if not bool((mask.sum(-1) == c).all()):
            raise CodecError(f"outlier key mask does not mark {c} channels in every key group")
        where = mask.unsqueeze(3).expand(kshape)
        codes = torch.empty(kshape, dtype=torch.uint8, device=mask.device)
        hi_bits = OUTLIER_BITS[mode]
        hi = _layer_codes(sec["pko"], hi_bits, n_layers, h * nk * gk * c) if hi_bits < 8 else sec["pko"]
        codes.masked_scatter_(~where, lo)
        codes.masked_scatter_(where, hi)
    else:
        codes = _raised_codes(sec["pk"], sec.get("pkt"), bits, n_layers, h * nk * gk * d, up_k).view(kshape)
    _affine_into(out[:, 0], codes, sec["sk"], sec["zk"], 2, False)
    if variant.unrope:  # the keys' RoPE, undone within the block, redone
        turn_into(out[:, 0], Rope.from_section(sec["rope"]), 1)
    vshape = (n_layers, h, t, nv, gv)
    if bits == 4 and not variant.sym_values and not variant.rot_values:
        if _int4_layers_into(out[:, 1], sec["pv"], sec.get("pvt"), sec["sv"], sec["zv"], vshape, up_v):
            return out
    qv = _raised_codes(sec["pv"], sec.get("pvt"), bits, n_layers, h * t * nv * gv, up_v).view(vshape)
    if variant.sym_values:  # (code - mid) * scale: the affine map with zero point -mid * scale
        scale = sec["sv"].float()
        mid = _levels(n_layers, bits, up_v, scale.device) / 2
        _affine_into(out[:, 1], qv, scale, scale * -mid, 3, variant.rot_values)
    else:
        _affine_into(out[:, 1], qv, sec["sv"], sec["zv"], 3, variant.rot_values)
    return out


def key_class_map(packed: torch.Tensor, mode: str, dim: int) -> torch.Tensor:
    """A KEY_CLASSES frame's "kcls" [L, H, groups, D / 4] -> each key channel's class [L, H, groups, D] (uint8, an
    index into the mode's KEY_CLASS_BITS); CodecError unless every group holds each class's `key_classes` count."""
    cls = unpack(packed.reshape(-1), 2, packed.numel() * 4).view(*packed.shape[:-1], dim)
    for c, count in enumerate(key_classes(mode, dim)):
        if not bool(((cls == c).sum(-1) == count).all()):
            raise CodecError(f"key channel classes: a group without {count} channels of {KEY_CLASS_BITS[mode][c]} "
                             f"bits")
    return cls


def _class_codes(sec: dict[str, torch.Tensor], mode: str, layers: int, kshape: tuple[int, ...]) -> torch.Tensor:
    """A KEY_CLASSES frame's key codes [L, H, groups, group, D] from its class map (as `expand_split` leaves it:
    [L, H, groups, D]) and code pieces. Every token of a group has each width's pieces in channel order, so the
    channel of each piece is known from the class map: every piece is shifted to its place in its channel's code
    and all are added into the codes in one scatter (a channel's pieces hold disjoint bits: adding is or-ing).
    One pass over the pieces instead of a gather per piece level: at 8B geometry about twice as fast."""
    n_layers, h, g, t, d = kshape
    cls = sec["kcls"].long()  # unpacked and checked by `expand_split`: each class has its count in every group
    per = h * g * t  # tokens of a layer
    pieces, channels = [], []
    for name, width, n in key_streams(mode, d):
        shifts = key_class_shifts(mode, width)
        has = torch.tensor([s is not None for s in shifts], device=cls.device)[cls]  # [L, H, groups, D]
        channel = has.nonzero()[:, -1].view(n_layers, h, g, n)  # row-major: each group's channels in order
        piece = _layer_codes(sec[name], width, layers, per * n).view(n_layers, h, g, t, n)
        if any(s for s in shifts if s is not None):
            shift = torch.tensor([s or 0 for s in shifts], dtype=torch.uint8, device=cls.device)[cls]
            piece = piece << shift.gather(-1, channel).unsqueeze(3)
        pieces.append(piece)
        channels.append(channel)
    index = torch.cat(channels, -1).unsqueeze(3).expand(n_layers, h, g, t, -1)
    codes = torch.zeros(kshape, dtype=torch.uint8, device=cls.device)
    return codes.scatter_add_(-1, index, torch.cat(pieces, -1))


def _raised_codes(packed: torch.Tensor, top: torch.Tensor | None, bits: int, layers: int, per_layer: int,
                  up: tuple[int, ...]) -> torch.Tensor:
    """`_layer_codes` of every layer at `bits`, the layers `up` with their top bits (packed per layer in `top`)
    added: uint8 [layers * per_layer]."""
    q = _layer_codes(packed, bits, layers, per_layer)
    if up and top is not None:
        q = q.view(layers, per_layer)
        q[list(up)] |= _layer_codes(top, 1, len(up), per_layer).view(len(up), per_layer) << bits
        q = q.view(-1)
    return q


def _levels(layers: int, bits: int, raised: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The highest code of each layer [layers, 1, 1, 1, 1] (fp32): 2**bits - 1, one bit more in the layers `raised`."""
    per_layer = torch.full((layers, 1, 1, 1, 1), float((1 << bits) - 1), device=device)
    per_layer[list(raised)] = float((2 << bits) - 1)
    return per_layer


def expand_split(mode: str, parts: list[torch.Tensor], dims: Dims, group: int, variant: Variant,
                 up: tuple[tuple[int, ...], tuple[int, ...]]) -> list[torch.Tensor]:
    """A split frame's sections (`split_layout`, the whole frame) with its range codes expanded to fp16
    scales and zero points: key channels at their own levels (outlier channels OUTLIER_BITS, those of a key class
    its bits, the others the mode's bits or one more in the layers `up[0]`), values at their layer's. A key class
    map comes back unpacked, [L, H, groups, D] (`key_class_map`: CodecError unless each class has its count)."""
    names = list(split_layout(mode, dims, group, variant, (len(up[0]), len(up[1]))))
    sec = dict(zip(names, parts, strict=True))
    bits = BITS[mode]

    key_levels = _levels(dims.layers, bits, up[0], parts[0].device)
    if variant.key_classes:  # the class map unpacked (and checked) once, for the levels here and the codes' places
        sec["kcls"] = key_class_map(sec["kcls"], mode, dims.head_dim)  # [L, H, groups, D]
        levels = torch.tensor([max(1, (1 << b) - 1) for b in KEY_CLASS_BITS[mode]], dtype=torch.float32,
                              device=parts[0].device)  # 0 bits: one level (the zero point alone)
        key_levels = levels[sec["kcls"].long()].unsqueeze(3)
    elif variant.outlier_keys:
        mask = unpack_mask(sec["mask"], dims.head_dim).unsqueeze(3)  # [L, H, groups, 1, D]
        key_levels = torch.where(mask, float((1 << OUTLIER_BITS[mode]) - 1), key_levels)
    sec["sk"], sec["zk"] = scalecodes.expand(sec["sk"], sec["zk"], scalecodes.KEY_AXIS, key_levels)
    if variant.sym_values:
        sec["sv"] = scalecodes.sym_expand(sec["sv"], sec["svc"])
    else:
        sec["sv"], sec["zv"] = scalecodes.expand(sec["sv"], sec["zv"], scalecodes.VALUE_AXIS,
                                                 _levels(dims.layers, bits, up[1], parts[0].device))
    return [sec[name] for name in names]


def _layer_codes(packed: torch.Tensor, bits: int, layers: int, per_layer: int) -> torch.Tensor:
    """Codes packed per layer, each layer padded to a whole byte (`quant.pack_rows`) -> uint8 [layers * per_layer]."""
    per_byte = 8 // bits
    row = -(-per_layer // per_byte)
    q = unpack(packed.reshape(-1), bits, layers * row * per_byte).view(layers, row * per_byte)
    return q[:, :per_layer].reshape(-1)


def unpack_mask(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 [..., dim / 8] -> bool [..., dim]: the inverse of `quant.pack_mask`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(*packed.shape[:-1], dim)


def _int4_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               shape: tuple[int, ...], dim: int) -> bool:
    """`_affine_into` of int4 codes still packed ([L, H, groups, group, D] for keys, dim 2; [L, H, T, groups, group]
    for values, dim 3), unpacked, scaled and offset in one pass (cachestore.codec.kernels); False where that does not
    apply (codes padded past out's size, or no kernel): nothing written."""
    if shape[dim] * shape[dim + 1] != out.shape[dim]:
        return False
    try:
        grouped = _grouped(out, shape, dim)
    except RuntimeError:
        return False
    return kernels.int4_into(grouped, packed, scale, zero)


def _int4_layers_into(out: torch.Tensor, packed: torch.Tensor, top: torch.Tensor | None, scale: torch.Tensor,
                      zero: torch.Tensor, shape: tuple[int, ...], up: tuple[int, ...]) -> bool:
    """`_affine_into` of a split frame's int4 values (`_raised_codes`: packed per layer, the layers `up` with a top
    bit in `top`) a layer at a time: the kernel's one pass (`_int4_into`) for the 4-bit layers, torch for the others.
    False where the kernel does not apply (nothing written, or every layer left to the caller to write)."""
    layers, per_layer = shape[0], math.prod(shape[1:])
    if per_layer % 2 or not kernels.enabled() or (up and top is None):
        return False
    flat, half, one = packed.reshape(-1), per_layer // 2, (1, *shape[1:])
    for n in range(layers):
        if n not in up and not _int4_into(out[n:n + 1], flat[n * half:(n + 1) * half], scale[n:n + 1],
                                          zero[n:n + 1], one, 3):
            return False
    if up:
        assert top is not None
        tops = _layer_codes(top, 1, len(up), per_layer).view(len(up), per_layer)
        for rank, n in enumerate(up):
            q = unpack(flat[n * half:(n + 1) * half], 4, per_layer) | (tops[rank] << 4)
            _affine_into(out[n:n + 1], q.view(one), scale[n:n + 1], zero[n:n + 1], 3, False)
    return True


def _grouped(out: torch.Tensor, shape: Sequence[int], dim: int) -> torch.Tensor:
    """out [L, H, T, D] viewed as codes of `shape` group it: dim `dim` split into shape[dim] groups of
    shape[dim + 1] (keys: T, dim 2; values: D, dim 3)."""
    return out.view(*out.shape[:dim], shape[dim], shape[dim + 1], *out.shape[dim + 1:])


def int8_codes_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """out [L, H, T, D] (any float dtype, a strided view is fine; or [L, frames, H, T, D], a run of frames) = int8 codes
    q times their fp16 scale."""
    if kernels.int8_into(out, q, scale):  # one pass, where the CPU and the layout allow: the same values
        return
    if out.dtype != F16:  # int8 -> fp32 copy is vectorized: ~4x the fp16 route here
        out.copy_(q).mul_(scale.float())
        return
    # fp16 (llama.cpp's context): the exact fp32 product rounded once into out, as an fp16 multiply rounds it; through a
    # frame-sized fp32 temporary, 25% faster here than building fp16 codes from their bits and multiplying in fp16
    out.copy_(q.float().mul_(scale.float()))


def _affine_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 dim: int, rot: bool) -> None:
    """out [L, H, T, D] = q * scale + zero (rotated back if `rot`), q grouped along `dim` of out.

    q [L, H, groups, group, D] (dim 2) or [L, H, T, groups, group] (dim 3), possibly padded past
    out's size along `dim`. Without padding or rotation the codes are converted, scaled and
    offset in out itself: no temporary tensor the size of the KV (a fresh one costs page faults).
    """
    size = out.shape[dim]
    padded = q.shape[dim] * q.shape[dim + 1] != size
    scale32, zero32 = scale.float(), zero.float()  # q * scale is exact in fp32 (<= 15 bits)
    if not padded and not rot and out.dtype == torch.float32:
        grouped = _grouped(out, q.shape, dim)
        # scaled and offset in one pass over out (addcmul), not two: a third less of the layer's traffic
        torch.addcmul(zero32, grouped.copy_(q), scale32, out=grouped)
        return
    x = q.to(torch.float32).mul_(scale32).add_(zero32)
    x = x.flatten(dim, dim + 1).narrow(dim, 0, size)
    if rot and out.dtype == torch.float32 and not padded:
        _rotate_into(x, out)
    else:
        out.copy_(rotate(x) if rot else x)


def _rotate_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """out [L, H, T, D] (fp32, any strides with unit-stride rows) = rotate(x [L, H, T, D]).

    One batched matmul per layer writing straight into out (a block of a larger context is a
    strided view): measured about a third faster than a matmul into a new tensor and a copy.
    """
    matrix = hadamard_cpu(x.shape[-1]).to(x.device).expand(x.shape[1], -1, -1)  # [H, D, D]
    for layer in range(x.shape[0]):
        torch.bmm(x[layer], matrix, out=out[layer])
