"""Attention over a hit's KV where it landed (int8, int4, fp16 or exact), without dequantizing it first.

The first forward step over a hit needs each layer's cached tokens once, for one attention. Dequantizing them
first (into the context, or a one-layer scratch) writes four bytes of fp32 for every byte (int8), half byte (int4)
or two bytes (fp16) that came off the wire, and reads them back: on 2-core VMs that was most of what a hit's step
cost beyond the floor's step over a context already in memory. Here the
attention reads the codes themselves (`kernels.attention_scores`, `kernels.attention_values`): each dequantized
element is the value cachestore.codec.dequant computes, used once in a register and never stored. Tokens outside the
landed runs (frames that came as bytes, a session's tail, the new tokens) are read from the context as usual, and
one softmax runs over all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachestore.codec import kernels
from cachestore.codec.arrays import Array, device_of, from_host, namespace, reshape_view, softmax
from cachestore.codec.frame import FrameHeader
from cachestore.codec.layout import Dims, groups

MODES = ("int8", "int4", "fp16", "exact")  # with no transform, exact in fp16 or fp32: what they read


@dataclass(frozen=True)
class Half:
    """One layer's keys or values of a run of frames, as the kernels take them: codes (or fp16 / fp32 values), fp16
    scale for int8 and int4, offset for int4, and the rows (keys) or columns (values) a scale covers."""
    codes: Array
    scale: Array | None
    zero: Array | None
    group: int


@dataclass(frozen=True)
class Landed:
    """One layer of a run of landed frames: its first token, its frames and tokens a frame, keys and values."""
    start: int
    frames: int
    tokens: int
    keys: Half
    values: Half

    @property
    def stop(self) -> int:
        return self.start + self.frames * self.tokens


def supports(header: FrameHeader) -> bool:
    """Whether frames of this kind can be attended over in their codes (on this CPU, under this setting)."""
    if not kernels.enabled() or header.mode not in MODES or header.transform or header.rows:
        return False
    if header.mode == "exact" and header.dtype not in ("float32", "float16"):
        return False
    if header.head_dim % 16 or not 0 < header.head_dim <= 256:
        return False
    if header.mode == "int4":
        _, _, gv, nv = groups_of(header)
        return gv % 16 == 0 and gv * nv == header.head_dim
    return True


def groups_of(header: FrameHeader) -> tuple[int, int, int, int]:
    """(key group, key groups, value group, value groups) of an int4 frame (cachestore.codec.layout.groups)."""
    return groups(Dims(header.layers, header.kv_heads, header.tokens, header.head_dim), header.group_size)


def landed(header: FrameHeader, frames: int, start: int, parts: Sequence[Array]) -> Landed:
    """A run's layer from its payload sections (`FrameRun.layer_parts`; frames of a kind `supports`)."""
    n, h, t, d = frames, header.kv_heads, header.tokens, header.head_dim
    if header.mode in ("fp16", "exact"):
        (kv,) = parts  # [frames, 2, kv_heads, tokens, head_dim]
        return Landed(start, n, t, Half(kv[:, 0], None, None, t), Half(kv[:, 1], None, None, d))
    if header.mode == "int8":
        key_scale, value_scale, key_codes, value_codes = parts
        return Landed(start, n, t, Half(key_codes, key_scale, None, t), Half(value_codes, value_scale, None, d))
    key_scale, key_zero, value_scale, value_zero, key_codes, value_codes = parts
    gk, nk, gv, nv = groups_of(header)
    xp = namespace(key_scale)
    return Landed(start, n, t,
                  Half(key_codes, xp.reshape(key_scale, (n, h, nk, d)), xp.reshape(key_zero, (n, h, nk, d)), gk),
                  Half(value_codes, xp.reshape(value_scale, (n, h, t, nv)), xp.reshape(value_zero, (n, h, t, nv)), gv))


def attention(query: Array, runs: Sequence[Landed], keys: Array, values: Array, mask: Array | None,
              scaling: float) -> Array | None:
    """Attention of `query` [q_heads, n, D] (the new tokens', positions S .. S + n - 1) over `keys` and `values`
    [kv_heads, S + n, D] (one layer of the context), where the tokens of each landed run are read from its codes and
    the context's tokens there are never read. q_heads is a multiple of kv_heads (grouped query heads share a kv
    head, in order). `mask`: None (causal) or broadcastable to [q_heads, n, S + n], bool (True: attend) or added to
    the scores. Returns [q_heads, n, D] in fp32, or None where no kernel applies (nothing computed)."""
    xp = namespace(query)
    kv_heads, total, dim = keys.shape
    q_heads, n, _ = query.shape
    if q_heads % kv_heads or values.shape != keys.shape or total < n:
        raise ValueError(f"query {tuple(query.shape)} against keys {tuple(keys.shape)} and values "
                         f"{tuple(values.shape)}")
    rows = kv_heads, q_heads // kv_heads * n
    q = xp.reshape(xp.astype(query, xp.float32) * scaling, (*rows, dim))  # heads h*g .. h*g + g - 1 share kv head h
    scores = xp.empty((*rows, total), dtype=xp.float32, device=device_of(query))
    for run in runs:
        if not 0 <= run.start <= run.stop <= total - n:
            raise ValueError(f"a landed run at tokens [{run.start}, {run.stop}) of a context of {total - n}")
        k = run.keys
        if not kernels.attention_scores(reshape_view(scores[:, :, run.start:run.stop], (*rows, run.frames, run.tokens)),
                                        q, k.codes, k.scale, k.zero, k.group):
            return None
    read = _gaps([(run.start, run.stop) for run in runs], total)
    for start, stop in read:
        scores[:, :, start:stop] = xp.matmul(q, xp.matrix_transpose(keys[:, start:stop]))
    by_query = reshape_view(scores, (q_heads, n, total))
    if mask is not None and mask.dtype == xp.bool:
        by_query[...] = xp.where(xp.reshape(mask, (-1, n, total)), by_query, -float("inf"))
    elif mask is not None:
        by_query += xp.reshape(mask, (-1, n, total))
    elif n > 1:  # causal: the new token i sees the context and the new tokens up to itself
        later = from_host(np.triu(np.ones((n, n), dtype=bool), 1), xp, device_of(query))
        tail = by_query[:, :, total - n:]
        tail[...] = xp.where(later, -float("inf"), tail)
    weights = softmax(scores, -1)
    out = xp.zeros((*rows, dim), dtype=xp.float32, device=device_of(query))
    for run in runs:
        v = run.values
        if not kernels.attention_values(out, reshape_view(weights[:, :, run.start:run.stop],
                                                          (*rows, run.frames, run.tokens)),
                                        v.codes, v.scale, v.zero, v.group):
            raise RuntimeError("the value kernel refused what the key kernel took")
    for start, stop in read:
        out += xp.matmul(weights[:, :, start:stop], values[:, start:stop])
    return xp.reshape(out, (q_heads, n, dim))


def _gaps(spans: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """[0, total) less the (disjoint) spans."""
    gaps, at = [], 0
    for start, stop in [*sorted(spans), (total, total)]:
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    return gaps
