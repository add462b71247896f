"""The payload layout of each codec mode: its options (`Variant`), per-layer bits (`HiLayers`), and the dtype and
shape of every section, in payload order."""

from __future__ import annotations

from typing import NamedTuple

from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.frame import (
    OUTLIER_BITS,
    OUTLIER_SHARE,
    key_class_shifts,
    key_class_streams,
    key_classes,
    key_classes_fit,
    outlier_channels,
    outlier_fits,
)
from cachestore.codec.q8 import Q8_BLOCK, Q8_BYTES
from cachestore.errors import CodecError

F16 = "float16"

Section = tuple[str, tuple[int, ...]]  # (dtype name, shape)


class Variant(NamedTuple):
    """Options of the grouped modes (int4/int2); all off is the original KIVI-style codec."""

    rot_values: bool = False  # block-Hadamard rotation of values along head_dim (format 2, in the frame)
    clip: bool = False  # encoder-side range clipping (decoders need not know)
    outlier_keys: bool = False  # each key group's widest channels at higher precision (in the frame)
    sym_values: bool = False  # values quantized symmetrically: a scale, no zero point (in the frame)
    scale8: bool = False  # group ranges as 8-bit codes between their block's extremes (format 5, in the frame)
    key_classes: bool = False  # each key group's channels at class bits by importance (format 6, int4 7)
    unrope: bool = False  # keys stored with RoPE undone within their block (format 6, in the frame)

    @property
    def split(self) -> bool:
        """Whether frames of this variant take `split_layout` (always with `scale8`)."""
        return self.outlier_keys or self.sym_values or self.key_classes


PLAIN = Variant()


class HiLayers(NamedTuple):
    """A split frame's per-layer bits (sorted, distinct; none by default): the layers whose keys / values take one bit
    more than the mode (`UP_BITS`: 5 in an int4 frame, 3 in an int2 frame). Every other layer's half takes the
    mode's bits."""

    up_keys: tuple[int, ...] = ()
    up_values: tuple[int, ...] = ()

    @property
    def counts(self) -> tuple[int, int]:
        """How many layers' keys and values take one bit more."""
        return (len(self.up_keys), len(self.up_values))


NO_HI = HiLayers()


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


def layout(mode: str, dims: Dims, group: int, dtype: str, hi_counts: tuple[int, ...] = (0, 0),
           variant: Variant | None = None) -> list[Section]:
    """The (dtype, shape) of each payload section of `mode`, in payload order (`split_layout` for a split variant,
    whose `hi_counts` are `HiLayers.counts`)."""
    n_layers, h, t, d = dims
    if variant is not None and variant.split:
        return list(split_layout(mode, dims, group, variant, hi_counts).values())
    if mode == "exact":
        return [(dtype, (n_layers, 2, h, t, d))]
    if mode == "fp16":
        return [(F16, (n_layers, 2, h, t, d))]
    if mode == "int8":
        qshape = (n_layers, h, t, d)
        return [(F16, (n_layers, h, 1, d)), (F16, (n_layers, h, t, 1)),
                ("int8", qshape), ("int8", qshape)]
    if mode == "q8":  # token rows, layers first: [layers, 2, tokens, kv_heads, head_dim / 32 blocks of Q8_BYTES]
        if d % Q8_BLOCK:
            raise CodecError(f"q8 quantizes blocks of {Q8_BLOCK} channels of one head: head_dim {d} is no multiple")
        return [("uint8", (n_layers * 2 * t * h * (d // Q8_BLOCK) * Q8_BYTES,))]
    if mode in BITS:
        gk, nk, gv, nv = groups(dims, group)
        per_byte = 8 // BITS[mode]
        kbytes = ceil_div(n_layers * h * nk * gk * d, per_byte)
        vbytes = ceil_div(n_layers * h * t * nv * gv, per_byte)
        return [*_ranges(dims, group, False), ("uint8", (kbytes,)), ("uint8", (vbytes,))]
    raise CodecError(f"unknown mode {mode!r}")


def _ranges(dims: Dims, group: int, s8: bool) -> list[Section]:
    """The scale and zero point sections of the keys and values: fp16 [L, H, key groups, 1, D] twice and [L, H, T,
    value groups, 1] twice, or with `s8` each pair as (extremes, codes)."""
    n, h, t, d = dims
    _, nk, _, nv = groups(dims, group)
    kshape, vshape = (n, h, nk, 1, d), (n, h, t, nv, 1)
    if not s8:
        return [(F16, kshape), (F16, kshape), (F16, vshape), (F16, vshape)]
    return [(F16, (n, h, nk, 2, 1)), ("uint8", (n, h, nk, 2, d)),
            (F16, (n, h, 1, nv, 2)), ("uint8", (n, h, t, nv, 2))]


def key_streams(mode: str, head_dim: int) -> list[tuple[str, int, int]]:
    """(section, width, pieces a token) of each key code section of a KEY_CLASSES frame, in `key_class_streams`
    order: "pk" the mode's width, "pkt" the 1-bit pieces, "pko" the other."""
    counts = key_classes(mode, head_dim)
    return [("pk" if w == BITS[mode] else "pkt" if w == 1 else "pko", w,
             sum(n for n, shift in zip(counts, key_class_shifts(mode, w), strict=True) if shift is not None))
            for w in key_class_streams(mode)]


def split_layout(mode: str, dims: Dims, group: int, variant: Variant,
                 hi_counts: tuple[int, ...] = (0, 0)) -> dict[str, Section]:
    """The sections of a split frame (formats 5 to 7) by name, in payload order, every one layers first (packed codes
    are padded to a whole byte per layer, so a frame's layers dequantize apart).

    With `unrope` a first section "rope", fp32 [head_dim / 2 + 1] (`cachestore.codec.rope`). The keys' ranges as
    range codes (`scalecodes`): extremes "sk" [L, H, key groups, 2, 1] and codes "zk" [L, H, key groups, 2, D]. With
    `outlier_keys` a bit mask "mask" [L, H, key groups, D / 8] of each key group's outlier channels (bit c of byte
    c // 8: channel c), the other channels' codes "pk" in channel order, then the outlier channels' codes "pko"
    (OUTLIER_BITS). With `key_classes` each key group's channel classes "kcls" [L, H, key groups, D / 4] (2 bits a
    channel, low bits first: an index into the mode's KEY_CLASS_BITS), then the key codes in pieces
    (`key_class_pieces`), one section a width (`key_class_streams`: "pk" the mode's, "pko" the other, "pkt" the
    1-bit pieces), every layer's, each token's pieces in channel order. Otherwise the key codes "pk". The values'
    ranges: extremes "sv" [L, H, 1, value groups, 2] and codes "zv" [L, H, T, value groups, 2], or with
    `sym_values` (one scale a group, no zero point) the extreme "sv" [L, H, 1, value groups, 1] and 8-bit codes "svc"
    [L, H, T, value groups, 1], each scale extreme * code / 255; the value codes "pv".

    A layer table may give layers one bit more (`hi_counts`, UP_BITS; keys not with `key_classes`): their key codes
    (values) keep the mode's bits of each code in "pk" ("pv") like every layer, and put the top bits in "pkt"
    ("pvt"), packed per layer, those layers only."""
    if mode not in BITS or not variant.scale8:
        raise CodecError(f"outlier key channels, key classes and symmetric values apply to int4/int2 with range "
                         f"codes only, not {mode}")
    n_layers, h, t, d = dims
    gk, nk, gv, nv = groups(dims, group)
    bits = BITS[mode]
    nk_up, nv_up = (*hi_counts, 0, 0)[:2]
    if max(nk_up, nv_up) > n_layers:
        raise CodecError(f"{hi_counts} layers one bit more of {n_layers}")
    sk, zk, sv, zv = _ranges(dims, group, True)
    sections: dict[str, Section] = {}
    if variant.unrope:
        if d % 2:
            raise CodecError(f"keys without their RoPE need an even head_dim, not {d}")
        sections["rope"] = ("float32", (d // 2 + 1,))
    sections |= {"sk": sk, "zk": zk, "sv": sv, "zv": zv}
    if variant.sym_values:  # one scale a group, no zero point: its extreme and a code
        del sections["zv"]
        sections |= {"sv": (F16, (n_layers, h, 1, nv, 1)), "svc": ("uint8", (n_layers, h, t, nv, 1))}
    per_group = d  # key channels per (layer, head, group) at the mode's bits
    if variant.key_classes:
        if variant.outlier_keys or nk_up or not key_classes_fit(mode, d):
            raise CodecError(f"key channel classes apply to a head_dim that is a multiple of 64 and no outlier "
                             f"channels or key layers one bit more, not {mode} with head_dim {d}")
        sections["kcls"] = ("uint8", (n_layers, h, nk, d // 4))
        for name, width, per_token in key_streams(mode, d):
            sections[name] = ("uint8", (n_layers * ceil_div(h * nk * gk * per_token * width, 8),))
    elif variant.outlier_keys:
        if not outlier_fits(mode, d):
            raise CodecError(f"outlier key channels of {mode} need a head_dim that is a multiple of "
                             f"{OUTLIER_SHARE[mode]}, not {d}")
        c = outlier_channels(mode, d)
        per_group = d - c
        sections["mask"] = ("uint8", (n_layers, h, nk, d // 8))
    if not variant.key_classes:
        sections["pk"] = ("uint8", (n_layers * ceil_div(h * nk * gk * per_group * bits, 8),))
    if variant.outlier_keys:
        sections["pko"] = ("uint8", (n_layers * ceil_div(h * nk * gk * c * OUTLIER_BITS[mode], 8),))
    if nk_up:
        sections["pkt"] = ("uint8", (nk_up * ceil_div(h * nk * gk * per_group, 8),))
    sections["pv"] = ("uint8", (n_layers * ceil_div(h * t * nv * gv * bits, 8),))
    if nv_up:
        sections["pvt"] = ("uint8", (nv_up * ceil_div(h * t * nv * gv, 8),))
    return sections


def codes_split_by_layer(mode: str, dims: Dims, group: int) -> bool:
    """Whether the packed codes of every layer start on a byte (always, but for odd shapes of int4/int2):
    then a frame's layers can be dequantized separately."""
    if mode not in BITS:
        return True
    gk, nk, gv, nv = groups(dims, group)
    per_byte = 8 // BITS[mode]
    return all(n % per_byte == 0 for n in (dims.heads * nk * gk * dims.head_dim, dims.heads * dims.tokens * nv * gv))
