"""Keys with RoPE undone within their block (`/unrope`, frame format 6).

A model's cached keys carry the rotary position embedding: each pair of channels of a head is turned by an angle
that grows with the token's position, at its own frequency. Within a 64-token block the fast pairs turn through
several full circles, so a channel's values over the block's tokens spread far wider than the key itself does,
and per-channel quantization (keys, as KIVI quantizes them) spends its levels on that spread. Turned back
relative to the block's first token before quantizing, every token of the block carries the same rotation (its
first token's), the channel keeps the key's own range, and decoding turns the tokens forward again. No absolute
position is needed: a block's tokens are consecutive positions, whatever the first one is.

The engine declares its model's RoPE (`service.engines.base.KvLayout.rope`): the pairing of channels (transformers
pairs channel i with i + head_dim / 2; llama.cpp's LLAMA rope pairs 2i with 2i + 1 over permuted weights) and the
inverse frequencies of the pairs. The frame records both (`section`), so a decoder needs no model.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachestore.codec.arrays import Array, device_of, from_host, namespace
from cachestore.errors import CodecError

HALVES, ADJACENT = "halves", "adjacent"  # channel i with i + head_dim / 2, or 2i with 2i + 1
_PAIRINGS = (HALVES, ADJACENT)  # their codes in a frame: the index


@dataclass(frozen=True)
class Rope:
    """A model's rotary position embedding as its keys carry it: every layer alike, the whole head rotated."""

    pairing: str
    inv_freq: tuple[float, ...]  # radians a position, per pair (head_dim / 2 of them), as fp32 holds them

    def __post_init__(self) -> None:
        # rounded to fp32 as the frame records them, so the encoder turns by what the decoder reads back
        object.__setattr__(self, "inv_freq", tuple(struct.unpack(f"<{len(self.inv_freq)}f",
                                                                 struct.pack(f"<{len(self.inv_freq)}f",
                                                                             *self.inv_freq))))
        if self.pairing not in _PAIRINGS:
            raise CodecError(f"unknown RoPE pairing {self.pairing!r}; one of {', '.join(_PAIRINGS)}")
        if not self.inv_freq or not all(math.isfinite(f) and 0.0 < f <= 4.0 for f in self.inv_freq):
            raise CodecError("RoPE inverse frequencies must be finite, in (0, 4]")

    @property
    def head_dim(self) -> int:
        return 2 * len(self.inv_freq)

    def section(self, like: Array | None = None) -> Array:
        """The frame's record of it: fp32 [head_dim / 2 + 1], the inverse frequencies, then the pairing's code (an
        array of `like`'s kind and device; numpy by default)."""
        record = np.array([*self.inv_freq, float(_PAIRINGS.index(self.pairing))], dtype=np.float32)
        return record if like is None else from_host(record, namespace(like), device_of(like))

    @classmethod
    def from_section(cls, section: Array) -> Rope:
        """The inverse of `section`; CodecError for a pairing code or frequency a frame must not hold."""
        xp = namespace(section)
        values = [float(x) for x in xp.reshape(xp.astype(section, xp.float32), (-1,)).tolist()]
        code = values[-1]
        if code not in (0.0, 1.0):
            raise CodecError(f"unknown RoPE pairing code {code} in the frame")
        return cls(_PAIRINGS[int(code)], tuple(values[:-1]))


def turn(keys: Array, rope: Rope, sign: int) -> Array:
    """keys [..., tokens, head_dim] (token t at block position t) turned by sign * t * inv_freq per pair: -1 undoes
    RoPE relative to the first token, +1 redoes it. fp32, a new array."""
    tokens, dim = _check(keys, rope)
    xp = namespace(keys)
    cos, sin = _angles_for(keys, rope, tokens, sign)
    x = xp.astype(keys, xp.float32)
    if rope.pairing == HALVES:
        a, b = x[..., :dim // 2], x[..., dim // 2:]
        return xp.concat([a * cos - b * sin, b * cos + a * sin], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return xp.reshape(xp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1), x.shape)


def turn_into(keys: Array, rope: Rope, sign: int) -> None:
    """`keys[...] = turn(keys, rope, sign)` (any float dtype, a strided view is fine), the same values, without the
    stacked fp32 result and its copy: each half of the pairs is written straight into its channels of keys (a
    decoded 8B-geometry block's keys: ~3x faster)."""
    tokens, dim = _check(keys, rope)
    xp = namespace(keys)
    cos, sin = _angles_for(keys, rope, tokens, sign)
    if rope.pairing == HALVES:
        first, second = keys[..., :dim // 2], keys[..., dim // 2:]
    else:
        first, second = keys[..., 0::2], keys[..., 1::2]
    # each half read once into a dense fp32 array (both halves are computed before either is written back)
    a, b = xp.astype(first, xp.float32), xp.astype(second, xp.float32)
    lo = a * cos
    lo -= b * sin
    hi = b * cos
    hi += a * sin
    first[...] = lo
    second[...] = hi


def _check(keys: Array, rope: Rope) -> tuple[int, int]:
    tokens, dim = keys.shape[-2], keys.shape[-1]
    if dim != rope.head_dim:
        raise CodecError(f"RoPE of head_dim {rope.head_dim} on keys of head_dim {dim}")
    return tokens, dim


@functools.lru_cache(maxsize=64)
def _angles(rope: Rope, tokens: int, sign: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sign * sin of t * inv_freq, fp32 [tokens, head_dim / 2], computed in double precision by Python's math
    library (kept: they never change), so numpy and torch on any device turn by the same bits."""
    cos = [[math.cos(t * f) for f in rope.inv_freq] for t in range(tokens)]
    sin = [[math.sin(t * f) * sign for f in rope.inv_freq] for t in range(tokens)]
    return np.array(cos, dtype=np.float32).reshape(tokens, -1), np.array(sin, dtype=np.float32).reshape(tokens, -1)


_ON_DEVICE: dict[tuple[Rope, int, int, str], tuple[Any, Any]] = {}


def _angles_for(keys: Array, rope: Rope, tokens: int, sign: int) -> tuple[Any, Any]:
    """`_angles` as arrays of keys' kind and device."""
    device = device_of(keys)
    if device is None:
        return _angles(rope, tokens, sign)
    at = (rope, tokens, sign, str(device))
    if at not in _ON_DEVICE:
        if len(_ON_DEVICE) > 64:
            _ON_DEVICE.clear()
        xp = namespace(keys)
        cos, sin = _angles(rope, tokens, sign)
        _ON_DEVICE[at] = (from_host(cos, xp, device), from_host(sin, xp, device))
    return _ON_DEVICE[at]


def pair_mean(x: Array, pairing: str) -> Array:
    """x [..., head_dim] with each channel replaced by the mean over its RoPE pair (what RoPE's turning keeps)."""
    xp = namespace(x)
    dim = x.shape[-1]
    if pairing == HALVES:
        m = (x[..., :dim // 2] + x[..., dim // 2:]) * 0.5
        return xp.concat([m, m], axis=-1)
    m = (x[..., 0::2] + x[..., 1::2]) * 0.5
    return xp.reshape(xp.stack([m, m], axis=-1), x.shape)
