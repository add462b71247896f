"""The payload layout of each codec mode: its options (`Variant`), per-layer bits (`HiLayers`), and the dtype and
shape of every section, in payload order."""

from __future__ import annotations

from typing import NamedTuple

import torch

from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.frame import (
    OUTLIER_BITS,
    OUTLIER_SHARE,
    UP_BITS,
    key_class_shifts,
    key_class_streams,
    key_classes,
    key_classes_fit,
    outlier_channels,
    outlier_fits,
)
from cachestore.codec.q8 import Q8_BLOCK, Q8_BYTES
from cachestore.codec.scalecodes import KEY_AXIS, VALUE_AXIS
from cachestore.errors import CodecError

F16 = torch.float16
FP8 = getattr(torch, "float8_e4m3fn", None)

Section = tuple[torch.dtype, tuple[int, ...]]


class Variant(NamedTuple):
    """Options of the grouped modes (int4/int2); both off is the original KIVI-style codec."""

    rot_keys: bool = False  # block-Hadamard rotation of keys along head_dim (in the frame)
    rot_values: bool = False  # the same for values
    clip: bool = False  # encoder-side range clipping (decoders need not know)
    outlier_keys: bool = False  # each key group's widest channels at higher precision (format 4, in the frame)
    sym_values: bool = False  # values quantized symmetrically: a scale, no zero point (format 4, in the frame)
    scale8: bool = False  # group ranges as 8-bit codes between their block's extremes (format 5, in the frame)
    key_classes: bool = False  # each key group's channels at 0, 2, 3 or 4 bits by importance (format 6, in the frame)
    class_version: int = 0  # the frame version whose class counts apply (`frame.key_classes`; 0: a writer's)
    unrope: bool = False  # keys stored with RoPE undone within their block (format 6, in the frame)

    @property
    def split(self) -> bool:
        """Whether frames of this variant take format 4's layout (`split_layout`)."""
        return self.outlier_keys or self.sym_values or self.key_classes


PLAIN = Variant()


class HiLayers(NamedTuple):
    """A grouped frame's per-layer bits (sorted, distinct; none by default): layers whose keys / values are kept at
    int8, layers whose keys / values take the other grouped precision (`ALT_BITS`: int4 in an int2 frame, int2
    in an int4 frame), and layers whose keys / values take one bit more than the mode (`UP_BITS`: 5 in an int4
    frame, 3 in an int2 frame). Every other layer's half takes the frame's own mode."""

    keys: tuple[int, ...] = ()
    values: tuple[int, ...] = ()
    alt_keys: tuple[int, ...] = ()
    alt_values: tuple[int, ...] = ()
    up_keys: tuple[int, ...] = ()
    up_values: tuple[int, ...] = ()

    @property
    def counts(self) -> tuple[int, int, int, int, int, int]:
        """How many layers take each precision besides the mode's: (int8 keys, int8 values, alt keys, alt values,
        up keys, up values)."""
        return (len(self.keys), len(self.values), len(self.alt_keys), len(self.alt_values), len(self.up_keys),
                len(self.up_values))


NO_HI = HiLayers()
ALT_BITS = {"int4": 2, "int2": 4}  # the other grouped precision a layer of a grouped frame may take
ALT_MODE = {"int4": "int2", "int2": "int4"}
# where `_mixed_layout`'s tiers start: the mode's own layers (4 ranges, 2 codes, then int8's 4 sections), the layers
# at the other grouped precision (4 ranges, 2 codes), the layers one bit more (4 ranges, 2 codes, 2 of top bits)
ALT_AT, UP_AT = 10, 16


class Dims(NamedTuple):
    layers: int
    heads: int
    tokens: int
    head_dim: int


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def groups(dims: Dims, group: int) -> tuple[int, int, int, int]:
    """(key group, key groups per channel, value group, value groups per token).

    A group never spans more than the tokens (keys) or channels (values) there are, so a
    1-token frame is not padded to a whole group.
    """
    gk, gv = min(group, dims.tokens), min(group, dims.head_dim)
    return gk, ceil_div(dims.tokens, gk), gv, ceil_div(dims.head_dim, gv)


def layout(mode: str, dims: Dims, group: int, dtype: torch.dtype,
           hi_counts: tuple[int, ...] = (0, 0, 0, 0, 0, 0), variant: Variant | None = None) -> list[Section]:
    """The (dtype, shape) of each payload section of `mode`, in payload order.

    With a layer table (grouped modes only; `hi_counts`: how many layers keep keys / values at int8, then how many
    take the other grouped precision, then how many one bit more, `HiLayers.counts`): the grouped sections of the
    mode's own layers (codes packed per layer), then int8's four sections of the int8 layers, then (only if there
    are layers at the other precision or one bit more) the grouped sections of the layers at the other precision,
    then (only if there are any) those of the layers one bit more: their scales and zero points, their codes'
    low bits (the mode's) packed per layer, then their top bits, one a code, packed per layer.
    With `variant.scale8` every grouped (scale, zero) pair is stored as 8-bit range codes (`scalecodes`)."""
    n_layers, h, t, d = dims
    if variant is not None and variant.split:
        return list(split_layout(mode, dims, group, variant, hi_counts).values())
    s8 = variant is not None and variant.scale8
    if any(hi_counts):
        return _mixed_layout(mode, dims, group, (*hi_counts, 0, 0, 0, 0, 0, 0)[:6], s8)
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
        kbytes = ceil_div(n_layers * h * nk * gk * d, per_byte)
        vbytes = ceil_div(n_layers * h * t * nv * gv, per_byte)
        return [*_ranges(dims, group, n_layers, n_layers, s8), (torch.uint8, (kbytes,)), (torch.uint8, (vbytes,))]
    raise CodecError(f"unknown mode {mode!r}")


def _ranges(dims: Dims, group: int, n_keys: int, n_values: int, s8: bool) -> list[Section]:
    """The scale and zero point sections of `n_keys` layers' keys and `n_values` layers' values: fp16 [L, H, key
    groups, 1, D] twice and [L, H, T, value groups, 1] twice, or with `s8` each pair as (extremes, codes)."""
    _, h, t, d = dims
    _, nk, _, nv = groups(dims, group)
    kshape, vshape = (n_keys, h, nk, 1, d), (n_values, h, t, nv, 1)
    if not s8:
        return [(F16, kshape), (F16, kshape), (F16, vshape), (F16, vshape)]
    return [(F16, (n_keys, h, nk, 2, 1)), (torch.uint8, (n_keys, h, nk, 2, d)),
            (F16, (n_values, h, 1, nv, 2)), (torch.uint8, (n_values, h, t, nv, 2))]


def scale_pairs(mode: str, hi_counts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Where a SCALE8 frame's (extremes, codes) pairs lie in `layout`: (first section, axis, levels) of each."""
    tiers = [(0, BITS[mode])]
    counts = (*hi_counts, 0, 0, 0, 0, 0, 0)[:6]
    if any(counts[2:]):
        tiers.append((ALT_AT, ALT_BITS[mode]))
    if any(counts[4:]):
        tiers.append((UP_AT, UP_BITS[mode]))
    return [pair for at, bits in tiers
            for pair in ((at, KEY_AXIS, (1 << bits) - 1), (at + 2, VALUE_AXIS, (1 << bits) - 1))]


def key_streams(mode: str, head_dim: int, version: int = 0) -> list[tuple[str, int, int]]:
    """(section, width, pieces a token) of each key code section of a KEY_CLASSES frame of format `version` (0: a
    writer's), in `key_class_streams` order: "pk" the mode's width, "pkt" the 1-bit pieces, "pko" the other."""
    counts = key_classes(mode, head_dim, version)
    return [("pk" if w == BITS[mode] else "pkt" if w == 1 else "pko", w,
             sum(n for n, shift in zip(counts, key_class_shifts(mode, w), strict=True) if shift is not None))
            for w in key_class_streams(mode)]


def split_layout(mode: str, dims: Dims, group: int, variant: Variant,
                 hi_counts: tuple[int, ...] = (0, 0, 0, 0, 0, 0)) -> dict[str, Section]:
    """Format 4's sections of a grouped mode by name, in payload order, every one layers first (packed codes are
    padded to a whole byte per layer, so a frame's layers dequantize apart): key scales and zero points
    [L, H, key groups, 1, D]; value scales [L, H, T, value groups, 1] and, unless `sym_values`, their zero points;
    with `outlier_keys` a bit mask [L, H, key groups, D / 8] of each key group's outlier channels (bit c of byte
    c // 8: channel c), the other channels' codes in channel order, then the outlier channels' codes
    (OUTLIER_BITS); the value codes.

    Format 5 (`variant.scale8`): each (scale, zero) pair as range codes (`scalecodes`; symmetric value scales as
    extremes "sv" [L, H, 1, value groups, 1] and 8-bit codes "svc" [L, H, T, value groups, 1], each scale
    extreme * code / 255), and a layer table may give layers one bit more (`hi_counts[4:6]`, UP_BITS): their keys'
    non-outlier channels (values) keep the mode's bits of each code in "pk" ("pv") like every layer, and put the
    top bits in "pkt" ("pvt"), packed per layer, those layers only.

    Format 6: with `unrope` a first section "rope", fp32 [head_dim / 2 + 1] (`cachestore.codec.rope`); with
    `key_classes` (range codes, no outlier channels) each key group's channel classes "kcls" [L, H, key groups,
    D / 4] (2 bits a channel, low bits first: an index into the mode's KEY_CLASS_BITS) instead of the mask, then the
    key codes in pieces (`key_class_pieces`), one section a width (`key_class_streams`: "pk" the mode's, "pko" the
    other, "pkt" the 1-bit pieces), every layer's, each token's pieces in channel order (int2: the low two bits of
    the 2- and 3-bit channels' codes in "pk", the 4-bit channels' in "pko", the 3-bit channels' top bits in "pkt");
    its layer table may give values one bit more, keys nothing."""
    if mode not in BITS:
        raise CodecError(f"outlier key channels and symmetric values apply to int4/int2 only, not {mode}")
    n_layers, h, t, d = dims
    gk, nk, gv, nv = groups(dims, group)
    bits = BITS[mode]
    counts = (*hi_counts, 0, 0, 0, 0, 0, 0)[:6]
    if any(counts[:4]) or (any(counts) and not variant.scale8) or max(counts[4:]) > n_layers:
        raise CodecError(f"outlier key channels and symmetric values take a layer table of one bit more layers "
                         f"with range codes only, not {counts}")
    nk_up, nv_up = counts[4:]
    sk, zk, sv, zv = _ranges(dims, group, n_layers, n_layers, variant.scale8)
    sections: dict[str, Section] = {}
    if variant.unrope:
        if d % 2:
            raise CodecError(f"keys without their RoPE need an even head_dim, not {d}")
        sections["rope"] = (torch.float32, (d // 2 + 1,))
    sections |= {"sk": sk, "zk": zk, "sv": sv, "zv": zv}
    if variant.sym_values:  # one scale a group, no zero point; as range codes its extreme and a code
        del sections["zv"]
        if variant.scale8:
            sections |= {"sv": (F16, (n_layers, h, 1, nv, 1)), "svc": (torch.uint8, (n_layers, h, t, nv, 1))}
    per_group = d  # key channels per (layer, head, group) at the mode's bits
    if variant.key_classes:
        if variant.outlier_keys or not variant.scale8 or nk_up or not key_classes_fit(mode, d):
            raise CodecError(f"key channel classes apply to int4/int2 with range codes, a head_dim that is a "
                             f"multiple of 64 and no outlier channels or key layers one bit more, not {mode} with "
                             f"head_dim {d}")
        sections["kcls"] = (torch.uint8, (n_layers, h, nk, d // 4))
        for name, width, per_token in key_streams(mode, d, variant.class_version):
            sections[name] = (torch.uint8, (n_layers * ceil_div(h * nk * gk * per_token * width, 8),))
    elif variant.outlier_keys:
        if not outlier_fits(mode, d):
            raise CodecError(f"outlier key channels of {mode} need a head_dim that is a multiple of "
                             f"{OUTLIER_SHARE[mode]}, not {d}")
        c = outlier_channels(mode, d)
        per_group = d - c
        sections["mask"] = (torch.uint8, (n_layers, h, nk, d // 8))
    if not variant.key_classes:
        sections["pk"] = (torch.uint8, (n_layers * ceil_div(h * nk * gk * per_group * bits, 8),))
    if variant.outlier_keys:
        sections["pko"] = (torch.uint8, (n_layers * ceil_div(h * nk * gk * c * OUTLIER_BITS[mode], 8),))
    if nk_up:
        sections["pkt"] = (torch.uint8, (nk_up * ceil_div(h * nk * gk * per_group, 8),))
    sections["pv"] = (torch.uint8, (n_layers * ceil_div(h * t * nv * gv * bits, 8),))
    if nv_up:
        sections["pvt"] = (torch.uint8, (nv_up * ceil_div(h * t * nv * gv, 8),))
    return sections


def _mixed_layout(mode: str, dims: Dims, group: int, counts: tuple[int, ...], s8: bool = False) -> list[Section]:
    if mode not in BITS:
        raise CodecError(f"per-layer bits apply to int4/int2 only, not {mode}")
    n_layers, h, t, d = dims
    nk_hi, nv_hi, nk_alt, nv_alt, nk_up, nv_up = counts
    nk_lo, nv_lo = n_layers - nk_hi - nk_alt - nk_up, n_layers - nv_hi - nv_alt - nv_up
    if min(counts) < 0 or nk_lo < 0 or nv_lo < 0:
        raise CodecError(f"{counts} int8 / other-precision / one-bit-more layers of {n_layers}")
    kbytes, vbytes = layer_code_bytes(mode, dims, group)
    sections = [*_ranges(dims, group, nk_lo, nv_lo, s8),
                (torch.uint8, (nk_lo * kbytes,)), (torch.uint8, (nv_lo * vbytes,)),
                (F16, (nk_hi, h, 1, d)), (F16, (nv_hi, h, t, 1)),
                (torch.int8, (nk_hi, h, t, d)), (torch.int8, (nv_hi, h, t, d))]
    if nk_alt or nv_alt or nk_up or nv_up:  # appended only when used: frames without them keep format 3's first layout
        kalt, valt = layer_code_bytes(ALT_MODE[mode], dims, group)
        sections += [*_ranges(dims, group, nk_alt, nv_alt, s8),
                     (torch.uint8, (nk_alt * kalt,)), (torch.uint8, (nv_alt * valt,))]
    if nk_up or nv_up:
        ktop, vtop = code_bytes(1, dims, group)
        sections += [*_ranges(dims, group, nk_up, nv_up, s8),
                     (torch.uint8, (nk_up * kbytes,)), (torch.uint8, (nv_up * vbytes,)),
                     (torch.uint8, (nk_up * ktop,)), (torch.uint8, (nv_up * vtop,))]
    return sections


def codes_per_layer(dims: Dims, group: int) -> tuple[int, int]:
    """How many key codes and value codes one layer of a grouped frame holds (padded groups included)."""
    gk, nk, gv, nv = groups(dims, group)
    return dims.heads * nk * gk * dims.head_dim, dims.heads * dims.tokens * nv * gv


def layer_code_bytes(mode: str, dims: Dims, group: int) -> tuple[int, int]:
    """Bytes of one layer's packed key codes and value codes in a frame with int8 layers (each layer
    padded to a whole byte)."""
    return code_bytes(BITS[mode], dims, group)


def code_bytes(bits: int, dims: Dims, group: int) -> tuple[int, int]:
    """Bytes of one layer's key codes and value codes of `bits` bits (1, 2 or 4), each padded to a whole byte."""
    keys, values = codes_per_layer(dims, group)
    per_byte = 8 // bits
    return ceil_div(keys, per_byte), ceil_div(values, per_byte)


def codes_split_by_layer(mode: str, dims: Dims, group: int) -> bool:
    """Whether the packed codes of every layer start on a byte (always, but for odd shapes of int4/int2):
    then a frame's layers can be dequantized separately."""
    if mode not in BITS:
        return True
    per_byte = 8 // BITS[mode]
    return all(n % per_byte == 0 for n in codes_per_layer(dims, group))
