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

import torch

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

    def section(self) -> torch.Tensor:
        """The frame's record of it: fp32 [head_dim / 2 + 1], the inverse frequencies, then the pairing's code."""
        return torch.tensor([*self.inv_freq, float(_PAIRINGS.index(self.pairing))], dtype=torch.float32)

    @classmethod
    def from_section(cls, section: torch.Tensor) -> Rope:
        """The inverse of `section`; CodecError for a pairing code or frequency a frame must not hold."""
        values = [float(x) for x in section.float().tolist()]
        code = values[-1]
        if code not in (0.0, 1.0):
            raise CodecError(f"unknown RoPE pairing code {code} in the frame")
        return cls(_PAIRINGS[int(code)], tuple(values[:-1]))


def turn(keys: torch.Tensor, rope: Rope, sign: int) -> torch.Tensor:
    """keys [..., tokens, head_dim] (token t at block position t) turned by sign * t * inv_freq per pair: -1 undoes
    RoPE relative to the first token, +1 redoes it. fp32, a new tensor."""
    tokens, dim = _check(keys, rope)
    cos, sin = _angles(rope, tokens, sign, keys.device)
    x = keys.float()
    if rope.pairing == HALVES:
        a, b = x[..., :dim // 2], x[..., dim // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def turn_into(keys: torch.Tensor, rope: Rope, sign: int) -> None:
    """`keys[...] = turn(keys, rope, sign)` (any float dtype, a strided view is fine), the same values, without the
    stacked fp32 result and its copy: each half of the pairs is written straight into its channels of keys (a
    decoded 8B-geometry block's keys: ~3x faster)."""
    tokens, dim = _check(keys, rope)
    cos, sin = _angles(rope, tokens, sign, keys.device)
    if rope.pairing == HALVES:
        first, second = keys[..., :dim // 2], keys[..., dim // 2:]
    else:
        first, second = keys[..., 0::2], keys[..., 1::2]
    # each half read once into a dense fp32 tensor (fp32 keys: the views themselves; both halves are computed before
    # either is written back)
    a, b = first.float(), second.float()
    lo = (a * cos).sub_(b * sin)
    hi = (b * cos).add_(a * sin)
    first.copy_(lo)
    second.copy_(hi)


def _check(keys: torch.Tensor, rope: Rope) -> tuple[int, int]:
    tokens, dim = keys.shape[-2], keys.shape[-1]
    if dim != rope.head_dim:
        raise CodecError(f"RoPE of head_dim {rope.head_dim} on keys of head_dim {dim}")
    return tokens, dim


@functools.lru_cache(maxsize=64)
def _angles(rope: Rope, tokens: int, sign: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign * sin of t * inv_freq, fp32 [tokens, head_dim / 2], computed in fp64 (kept: they never change)."""
    freq = torch.tensor(rope.inv_freq, dtype=torch.float64, device=device)
    angle = torch.arange(tokens, dtype=torch.float64, device=device).unsqueeze(1) * freq  # [T, D/2]
    return angle.cos().float(), (angle.sin() * sign).float()


def pair_mean(x: torch.Tensor, pairing: str) -> torch.Tensor:
    """x [..., head_dim] with each channel replaced by the mean over its RoPE pair (what RoPE's turning keeps)."""
    dim = x.shape[-1]
    if pairing == HALVES:
        m = (x[..., :dim // 2] + x[..., dim // 2:]) * 0.5
        return torch.cat([m, m], -1)
    m = (x[..., 0::2] + x[..., 1::2]) * 0.5
    return m.repeat_interleave(2, -1)
