"""Quantizers of the codec modes: KV tensor to payload sections and back, vectorized torch.

Every function works on the tensor's own device. KV is [layers, 2, kv_heads, tokens,
head_dim]; keys (index 0) are scaled per channel, values (index 1) per token, as in KIVI.
Scales and zero points are fp16, rounded outward (scales up, zero points down) so every
input lies inside its group's range and the error stays within half a step.

int4/int2 take options (`Variant`): `rot_keys` / `rot_values` multiply keys / values by an
orthonormal block-Hadamard matrix along head_dim before quantizing (and again after: it is its
own inverse), which spreads outlier channels over the whole head; `clip` lets the encoder
shrink each group's range where that lowers the group's squared error (decoding is unchanged;
values beyond the clipped range saturate, everything inside it stays within half a step).
Only the rotations change what a decoder must do, so only they are recorded in the frame.

A grouped frame may also keep the keys and/or values of some layers at int8 (`HiLayers`, format 3):
those layers are quantized exactly as mode int8 quantizes them (never rotated), the others as the
grouped mode; each half's int4/int2 codes are then packed layer by layer, every layer starting on a byte.
Its layer table may also give some layers' keys or values the other grouped precision (int4 in an int2
frame, int2 in an int4 frame: `ALT_BITS`), quantized as that mode would (same group, same options).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

from cachestore import kernels
from cachestore.errors import CodecError
from cachestore.frame import MODE_BITS as BITS

F16 = torch.float16
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0

Section = tuple[torch.dtype, tuple[int, ...]]
# q8: llama.cpp's q8_0, the layout of its KV cache at --cache-type-k/v q8_0: per token and head, each 32 channels an
# fp16 scale then 32 int8 codes
Q8_BLOCK, Q8_BYTES = 32, 34
_LITTLE_ENDIAN = sys.byteorder == "little"


class Variant(NamedTuple):
    """Options of the grouped modes (int4/int2); both off is the original KIVI-style codec."""

    rot_keys: bool = False  # block-Hadamard rotation of keys along head_dim (in the frame)
    rot_values: bool = False  # the same for values
    clip: bool = False  # encoder-side range clipping (decoders need not know)


PLAIN = Variant()


class HiLayers(NamedTuple):
    """A grouped frame's per-layer bits (sorted, distinct; none by default): layers whose keys / values are kept at
    int8, and layers whose keys / values take the other grouped precision (`ALT_BITS`: int4 in an int2 frame, int2
    in an int4 frame). Every other layer's half takes the frame's own mode."""

    keys: tuple[int, ...] = ()
    values: tuple[int, ...] = ()
    alt_keys: tuple[int, ...] = ()
    alt_values: tuple[int, ...] = ()

    @property
    def counts(self) -> tuple[int, int, int, int]:
        """How many layers take each precision besides the mode's: (int8 keys, int8 values, alt keys, alt values)."""
        return len(self.keys), len(self.values), len(self.alt_keys), len(self.alt_values)


NO_HI = HiLayers()
ALT_BITS = {"int4": 2, "int2": 4}  # the other grouped precision a layer of a grouped frame may take
_ALT_MODE = {"int4": "int2", "int2": "int4"}
# Range fractions the encoder tries per group with `clip` (the first is no clipping): for few
# levels a group's extremes waste most of the steps, for many levels clipping buys little.
CLIP_RATIOS = {2: (1.0, 0.9, 0.8, 0.7, 0.6, 0.5), 4: (1.0, 0.95, 0.9, 0.85, 0.8)}


class Dims(NamedTuple):
    layers: int
    heads: int
    tokens: int
    head_dim: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def groups(dims: Dims, group: int) -> tuple[int, int, int, int]:
    """(key group, key groups per channel, value group, value groups per token).

    A group never spans more than the tokens (keys) or channels (values) there are, so a
    1-token frame is not padded to a whole group.
    """
    gk, gv = min(group, dims.tokens), min(group, dims.head_dim)
    return gk, _ceil_div(dims.tokens, gk), gv, _ceil_div(dims.head_dim, gv)


def layout(mode: str, dims: Dims, group: int, dtype: torch.dtype,
           hi_counts: tuple[int, ...] = (0, 0, 0, 0)) -> list[Section]:
    """The (dtype, shape) of each payload section of `mode`, in payload order.

    With a layer table (grouped modes only; `hi_counts`: how many layers keep keys / values at int8, then how many
    take the other grouped precision, `HiLayers.counts`): the grouped sections of the mode's own layers (codes
    packed per layer), then int8's four sections of the int8 layers, then (only if there are any) the grouped
    sections of the layers at the other precision."""
    n_layers, h, t, d = dims
    if any(hi_counts):
        return _mixed_layout(mode, dims, group, (*hi_counts, 0, 0)[:4])
    if mode == "exact":
        return [(dtype, (n_layers, 2, h, t, d))]
    if mode == "fp16":
        return [(F16, (n_layers, 2, h, t, d))]
    if mode == "int8":
        qshape = (n_layers, h, t, d)
        return [(F16, (n_layers, h, 1, d)), (F16, (n_layers, h, t, 1)),
                (torch.int8, qshape), (torch.int8, qshape)]
    if mode == "fp8":
        if FP8 is None:
            raise CodecError("fp8 mode needs torch.float8_e4m3fn, which this torch lacks")
        return [(F16, (n_layers, 2, h, 1, d)), (FP8, (n_layers, 2, h, t, d))]
    if mode == "q8":  # token rows, layers first: [layers, 2, tokens, kv_heads, head_dim / 32 blocks of Q8_BYTES]
        if d % Q8_BLOCK:
            raise CodecError(f"q8 quantizes blocks of {Q8_BLOCK} channels of one head: head_dim {d} is no multiple")
        return [(torch.uint8, (n_layers * 2 * t * h * (d // Q8_BLOCK) * Q8_BYTES,))]
    if mode in BITS:
        gk, nk, gv, nv = groups(dims, group)
        per_byte = 8 // BITS[mode]
        kbytes = _ceil_div(n_layers * h * nk * gk * d, per_byte)
        vbytes = _ceil_div(n_layers * h * t * nv * gv, per_byte)
        kshape, vshape = (n_layers, h, nk, 1, d), (n_layers, h, t, nv, 1)
        return [(F16, kshape), (F16, kshape), (F16, vshape), (F16, vshape),
                (torch.uint8, (kbytes,)), (torch.uint8, (vbytes,))]
    raise CodecError(f"unknown mode {mode!r}")


def _mixed_layout(mode: str, dims: Dims, group: int, counts: tuple[int, ...]) -> list[Section]:
    if mode not in BITS:
        raise CodecError(f"per-layer bits apply to int4/int2 only, not {mode}")
    n_layers, h, t, d = dims
    gk, nk, gv, nv = groups(dims, group)
    nk_hi, nv_hi, nk_alt, nv_alt = counts
    nk_lo, nv_lo = n_layers - nk_hi - nk_alt, n_layers - nv_hi - nv_alt
    if min(counts) < 0 or nk_lo < 0 or nv_lo < 0:
        raise CodecError(f"{counts} int8 / other-precision layers of {n_layers}")
    kbytes, vbytes = _layer_code_bytes(mode, dims, group)
    sections = [(F16, (nk_lo, h, nk, 1, d)), (F16, (nk_lo, h, nk, 1, d)),
                (F16, (nv_lo, h, t, nv, 1)), (F16, (nv_lo, h, t, nv, 1)),
                (torch.uint8, (nk_lo * kbytes,)), (torch.uint8, (nv_lo * vbytes,)),
                (F16, (nk_hi, h, 1, d)), (F16, (nv_hi, h, t, 1)),
                (torch.int8, (nk_hi, h, t, d)), (torch.int8, (nv_hi, h, t, d))]
    if nk_alt or nv_alt:  # appended only when used: frames without them keep format 3's first layout
        kalt, valt = _layer_code_bytes(_ALT_MODE[mode], dims, group)
        sections += [(F16, (nk_alt, h, nk, 1, d)), (F16, (nk_alt, h, nk, 1, d)),
                     (F16, (nv_alt, h, t, nv, 1)), (F16, (nv_alt, h, t, nv, 1)),
                     (torch.uint8, (nk_alt * kalt,)), (torch.uint8, (nv_alt * valt,))]
    return sections


def _codes_per_layer(dims: Dims, group: int) -> tuple[int, int]:
    """How many key codes and value codes one layer of a grouped frame holds (padded groups included)."""
    gk, nk, gv, nv = groups(dims, group)
    return dims.heads * nk * gk * dims.head_dim, dims.heads * dims.tokens * nv * gv


def _layer_code_bytes(mode: str, dims: Dims, group: int) -> tuple[int, int]:
    """Bytes of one layer's packed key codes and value codes in a frame with int8 layers (each layer
    padded to a whole byte)."""
    keys, values = _codes_per_layer(dims, group)
    per_byte = 8 // BITS[mode]
    return _ceil_div(keys, per_byte), _ceil_div(values, per_byte)


def codes_split_by_layer(mode: str, dims: Dims, group: int) -> bool:
    """Whether the packed codes of every layer start on a byte (always, but for odd shapes of int4/int2):
    then a frame's layers can be dequantized separately."""
    if mode not in BITS:
        return True
    per_byte = 8 // BITS[mode]
    return all(n % per_byte == 0 for n in _codes_per_layer(dims, group))


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


def _asym(x: torch.Tensor, dim: int, levels: int,
          ratios: tuple[float, ...] = (1.0,)) -> tuple[torch.Tensor, ...]:
    """Asymmetric quantization of x (fp32) with one (scale, zero) per slice along `dim`.

    With several `ratios`, each slice's range is also tried shrunk about its middle by each
    ratio, and the (scale, zero, codes) of the smallest squared error are kept per slice.
    """
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    best: list[torch.Tensor] = []
    for ratio in ratios:
        mid, half = (lo + hi) * 0.5, (hi - lo) * (0.5 * ratio)
        zero = lo if ratio == 1.0 else mid - half
        zero = _outward(zero, up=False)
        zero32 = zero.float()
        top = hi if ratio == 1.0 else mid + half
        scale = _outward((top - zero32) / levels, up=True)
        q = ((x - zero32) / _safe(scale)).round_().clamp_(0, levels)
        if len(ratios) == 1:
            return scale, zero, q.to(torch.uint8)
        err = torch.addcmul(zero32, q, scale.float()).sub_(x).square_().sum(dim, keepdim=True)
        if not best:
            best = [scale, zero, q, err]
            continue
        better = err < best[3]
        best = [torch.where(better, new, old) for new, old in zip((scale, zero, q, err), best, strict=True)]
    return best[0], best[1], best[2].to(torch.uint8)


@functools.cache
def _hadamard_cpu(dim: int) -> torch.Tensor:
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
    return (flat @ _hadamard_cpu(dim).to(x.device)).view(x.shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2**bits, any shape -> uint8 [ceil(n * bits / 8)], low bits first."""
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


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The inverse of `pack`: uint8 [bytes] -> uint8 [count].

    Each byte is widened to a lane of `8 // bits` bytes and its fields are shifted into the
    lane's bytes at once (int16 lanes for int4, int32 for int2): several times faster on CPUs
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
    else:
        raise CodecError(f"cannot unpack {bits}-bit fields")
    if not _LITTLE_ENDIAN:
        return out.view(torch.uint8).view(-1, 8 // bits).flip(1).reshape(-1)[:count]
    return out.view(torch.uint8)[:count]


def quantize(mode: str, kv: torch.Tensor, group: int, variant: Variant = PLAIN,
             hi: HiLayers = NO_HI) -> list[torch.Tensor]:
    """kv [layers, 2, heads, tokens, dim] -> the payload sections of `layout`, on kv's device."""
    if mode == "exact":
        return [kv.contiguous()]
    if mode == "fp16":
        half = kv.to(F16).contiguous()
        if kv.dtype != F16 and not bool(torch.isfinite(half).all()) and bool(torch.isfinite(kv).all()):
            raise CodecError("KV values overflow fp16; use mode exact")
        return [half]
    x = kv.float()
    if mode == "fp8":
        if FP8 is None:
            raise CodecError("fp8 mode needs torch.float8_e4m3fn, which this torch lacks")
        scale = _outward(x.abs().amax(dim=3, keepdim=True) / FP8_MAX, up=True)  # [L,2,H,1,D]
        return [scale, (x / _safe(scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)]
    if mode == "q8":  # [L, 2, T, H, D] rows, quantized in blocks of 32 channels: one flat section
        return [q8_rows(x.transpose(2, 3)).reshape(-1)]
    k, v = x[:, 0], x[:, 1]  # [L, H, T, D]
    if mode == "int8":
        sk, qk = _int8(k, 2)
        sv, qv = _int8(v, 3)
        return [sk, sv, qk, qv]
    if mode not in BITS:
        raise CodecError(f"unknown mode {mode!r}")
    if hi != NO_HI:
        return _quantize_mixed(mode, k, v, group, variant, hi)
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
    k = rotate(k) if variant.rot_keys else k
    kg = _pad(k, 2, nk * gk).view(n_layers, h, nk, gk, d)  # groups of tokens per channel
    return _asym(kg, 3, (1 << bits) - 1, CLIP_RATIOS[bits] if variant.clip else (1.0,))


def _grouped_values(v: torch.Tensor, group: int, bits: int, variant: Variant) -> tuple[torch.Tensor, ...]:
    """Values [L, H, T, D] (fp32) -> scale, zero [L, H, T, groups, 1] and codes [L, H, T, groups, group]."""
    n_layers, h, t, d = v.shape
    _, _, gv, nv = groups(Dims(n_layers, h, t, d), group)
    v = rotate(v) if variant.rot_values else v
    vg = _pad(v, 3, nv * gv).view(n_layers, h, t, nv, gv)  # groups of channels per token
    return _asym(vg, 4, (1 << bits) - 1, CLIP_RATIOS[bits] if variant.clip else (1.0,))


def _quantize_mixed(mode: str, k: torch.Tensor, v: torch.Tensor, group: int, variant: Variant,
                    hi: HiLayers) -> list[torch.Tensor]:
    """The sections of `_mixed_layout`: grouped keys/values of the mode's layers, int8 of the `hi` ones, then the
    grouped keys/values of the layers at the other precision (if any)."""
    n_layers, bits = k.shape[0], BITS[mode]
    if any(not 0 <= layer < n_layers for layer in (*hi.keys, *hi.values, *hi.alt_keys, *hi.alt_values)):
        raise CodecError(f"the codec sets the bits of layers {tuple(hi)} (keys, values at int8; keys, values at "
                         f"{ALT_BITS[mode]} bits), but the KV has {n_layers} layers")
    if set(hi.keys) & set(hi.alt_keys) or set(hi.values) & set(hi.alt_values):
        raise CodecError("a layer's keys or values are given two precisions")
    lo_k = [layer for layer in range(n_layers) if layer not in hi.keys and layer not in hi.alt_keys]
    lo_v = [layer for layer in range(n_layers) if layer not in hi.values and layer not in hi.alt_values]
    sk, zk, qk = _grouped_keys(k[lo_k], group, bits, variant)
    sv, zv, qv = _grouped_values(v[lo_v], group, bits, variant)
    sk8, qk8 = _int8(k[list(hi.keys)], 2)
    sv8, qv8 = _int8(v[list(hi.values)], 3)
    parts = [sk, zk, sv, zv, pack_rows(qk, bits), pack_rows(qv, bits), sk8, sv8, qk8, qv8]
    if hi.alt_keys or hi.alt_values:
        alt = ALT_BITS[mode]
        ska, zka, qka = _grouped_keys(k[list(hi.alt_keys)], group, alt, variant)
        sva, zva, qva = _grouped_values(v[list(hi.alt_values)], group, alt, variant)
        parts += [ska, zka, sva, zva, pack_rows(qka, alt), pack_rows(qva, alt)]
    return parts


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack` of each q[i] (uint8 codes, leading dim = layers) padded to a whole byte, concatenated."""
    rows = q.reshape(q.shape[0], math.prod(q.shape[1:]))
    pad = (-rows.shape[1]) % (8 // bits)
    if pad:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], pad)], dim=1)
    return pack(rows, bits)


def dequantize(mode: str, parts: list[torch.Tensor], dims: Dims, group: int,
               dtype: torch.dtype, out: torch.Tensor | None = None,
               variant: Variant = PLAIN) -> torch.Tensor:
    """Payload sections (on the target device) -> kv [layers, 2, heads, tokens, dim] of dtype.

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
    compute = F16 if dtype == F16 else torch.float32
    if out is None:
        out = torch.empty((n_layers, 2, h, t, d), dtype=dtype, device=parts[0].device)
    if mode == "fp8":
        scale, q = parts
        return torch.mul(q.to(compute), scale.to(compute), out=out)
    if mode == "q8":
        q8_rows_into(out.transpose(2, 3), parts[0].view(n_layers, 2, t, h, d // Q8_BLOCK * Q8_BYTES))
        return out
    if mode == "int8":
        sk, sv, qk, qv = parts
        int8_codes_into(out[:, 0], qk, sk)
        int8_codes_into(out[:, 1], qv, sv)
        return out
    gk, nk, gv, nv = groups(dims, group)
    sk, zk, sv, zv, pk, pv = parts
    bits = BITS[mode]
    halves = ((pk, sk, zk, (n_layers, h, nk, gk, d), 2, variant.rot_keys),
              (pv, sv, zv, (n_layers, h, t, nv, gv), 3, variant.rot_values))
    for half, (packed, scale, zero, shape, dim, rot) in enumerate(halves):
        if not (bits == 4 and not rot and _int4_into(out[:, half], packed, scale, zero, shape, dim)):
            q = unpack(packed, bits, math.prod(shape)).view(shape)
            _affine_into(out[:, half], q, scale, zero, dim, rot)
    return out


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a multiple of 32, any float dtype) -> uint8 [..., D / 32 * 34]: llama.cpp's q8_0 blocks, each 32
    consecutive channels as an fp16 scale d = max|x| / 127 and 32 int8 codes round(x / d). Values that are q8_0 codes
    times their fp16 scale, held exactly (in fp32: a q8_0 cache parsed by `service.engines.llamastate`), come back as
    the very same bytes."""
    blocks = x.float().unflatten(-1, (-1, Q8_BLOCK))  # [..., D / 32, 32]
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).to(F16)  # [..., D / 32, 1]
    wide = scale.float()
    codes = torch.where(wide > 0, blocks / wide, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    out = torch.empty((*blocks.shape[:-1], Q8_BYTES), dtype=torch.uint8, device=x.device)
    out[..., :2] = scale.view(torch.uint8)
    out[..., 2:] = codes.view(torch.uint8)
    return out.flatten(-2)


def q8_rows_into(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out [..., D] (any float dtype, a strided view whose channels are contiguous is fine) = the q8_0 rows `rows`
    (uint8 [..., D / 32 * 34], `q8_rows`) dequantized: each code times its block's fp16 scale, exact in fp32."""
    blocks = rows.unflatten(-1, (-1, Q8_BYTES))  # [..., D / 32, 34]
    scale = blocks[..., :2].contiguous().view(F16).float()  # [..., D / 32, 1]
    codes = blocks[..., 2:].view(torch.int8)
    out.unflatten(-1, (-1, Q8_BLOCK)).copy_(codes.float().mul_(scale))
    return out


def _int4_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               shape: tuple[int, ...], dim: int) -> bool:
    """`_affine_into` of int4 codes still packed ([L, H, groups, group, D] for keys, dim 2; [L, H, T, groups, group]
    for values, dim 3), unpacked, scaled and offset in one pass (cachestore.kernels); False where that does not
    apply (codes padded past out's size, or no kernel): nothing written."""
    if shape[dim] * shape[dim + 1] != out.shape[dim]:
        return False
    try:
        grouped = _grouped(out, shape, dim)
    except RuntimeError:
        return False
    return kernels.int4_into(grouped, packed, scale, zero)


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


def dequantize_mixed(mode: str, parts: list[torch.Tensor], dims: Dims, group: int, out: torch.Tensor,
                     variant: Variant, hi: HiLayers, first: int = 0) -> torch.Tensor:
    """The sections of a frame with a layer table (`_mixed_layout`, the frame's whole `dims`) -> its layers
    [first, first + out.shape[0]) in out [those layers, 2, heads, tokens, dim], run by run of layers of
    one precision."""
    _, h, t, d = dims
    gk, nk, gv, nv = groups(dims, group)
    sk, zk, sv, zv, pk, pv, sk8, sv8, qk8, qv8 = parts[:10]
    # per tier (the mode's bits, then the other grouped precision): bits, a layer's code bytes per half, the sections
    tiers: list[tuple[int, tuple[int, int], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]] = [
        (BITS[mode], _layer_code_bytes(mode, dims, group), ((sk, zk, pk), (sv, zv, pv)))]
    if len(parts) > 10:
        ska, zka, sva, zva, pka, pva = parts[10:]
        alt = _ALT_MODE[mode]
        tiers.append((BITS[alt], _layer_code_bytes(alt, dims, group), ((ska, zka, pka), (sva, zva, pva))))
    halves = ((hi.keys, hi.alt_keys, (h, nk, gk, d), 2, variant.rot_keys, sk8, qk8),
              (hi.values, hi.alt_values, (h, t, nv, gv), 3, variant.rot_values, sv8, qv8))
    for half, (hi_layers, alt_layers, shape, dim, rot, scale8, q8) in enumerate(halves):
        pending: dict[int, list[tuple[torch.Tensor, int, int]]] = {}  # tier -> the runs torch dequantizes
        for start, stop, tier, rank in _runs(first, first + out.shape[0], hi_layers, alt_layers):
            target, n = out[start - first:stop - first, half], stop - start
            if tier < 0:
                int8_codes_into(target, q8[rank:rank + n], scale8[rank:rank + n])
                continue
            bits, sizes, sections = tiers[tier]
            nbytes, (scale, zero, packed) = sizes[half], sections[half]
            native = bits == 4 and not rot and 2 * nbytes == math.prod(shape)  # a run's codes lie whole, in C order
            if not (native and _int4_into(target, packed[rank * nbytes:(rank + n) * nbytes], scale[rank:rank + n],
                                          zero[rank:rank + n], (n, *shape), dim)):
                pending.setdefault(tier, []).append((target, n, rank))
        for tier, runs in pending.items():  # each tier's codes unpacked at once: [their count, *shape]
            bits, sizes, sections = tiers[tier]
            nbytes, (scale, zero, packed) = sizes[half], sections[half]
            r0, r1 = runs[0][2], runs[-1][2] + runs[-1][1]
            q = unpack(packed[r0 * nbytes:r1 * nbytes], bits, (r1 - r0) * nbytes * (8 // bits))
            q = q.view(r1 - r0, -1)[:, :math.prod(shape)].reshape(r1 - r0, *shape)  # a copy only if codes end mid-byte
            for target, n, rank in runs:
                _affine_into(target, q[rank - r0:rank - r0 + n], scale[rank:rank + n], zero[rank:rank + n], dim, rot)
    return out


def _runs(first: int, stop: int, hi_layers: tuple[int, ...],
          alt_layers: tuple[int, ...] = ()) -> list[tuple[int, int, int, int]]:
    """Maximal runs [start, end) of layers first..stop-1 of one precision: (start, end, tier, rank of start among
    the layers of its precision, i.e. its index in that precision's sections); tier -1 is int8, 0 the mode's own
    bits, 1 the other grouped precision."""
    runs: list[tuple[int, int, int, int]] = []
    hi_set, alt_set = set(hi_layers), set(alt_layers)
    for layer in range(first, stop):
        tier = -1 if layer in hi_set else 1 if layer in alt_set else 0
        if runs and runs[-1][2] == tier:
            runs[-1] = (runs[-1][0], layer + 1, tier, runs[-1][3])
            continue
        below_hi = sum(1 for x in hi_layers if x < layer)
        below_alt = sum(1 for x in alt_layers if x < layer)
        rank = below_hi if tier < 0 else below_alt if tier else layer - below_hi - below_alt
        runs.append((layer, layer + 1, tier, rank))
    return runs


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
    matrix = _hadamard_cpu(x.shape[-1]).to(x.device).expand(x.shape[1], -1, -1)  # [H, D, D]
    for layer in range(x.shape[0]):
        torch.bmm(x[layer], matrix, out=out[layer])
