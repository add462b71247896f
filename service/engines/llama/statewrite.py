"""kvstash KV arrays -> llama.cpp's sequence-state bytes (the layout service.engines.llama.llamastate reads): a
state assembled from an array, or laid out for a hit to fill in place (a float16 view of its K and V, its rows as
pieces), and V put in place where it is stored transposed. numpy throughout (an array from torch is read on the
host): llama.cpp's engines and the sidecar run without torch."""

from __future__ import annotations

import struct

import numpy as np

from cachestore.codec import kernels
from cachestore.codec.arrays import Array, to_host
from cachestore.codec.q8 import q8_rows
from service.engines.llama.llamastate import (
    CELL,
    GGML_TYPE_F16,
    GGML_TYPE_Q8_0,
    MAGIC,
    StateGeometry,
    StateLayoutError,
    first_k,
    layer_bytes,
    state_size,
)


def _write_layout(buf: bytearray, n: int, geo: StateGeometry, seq_id: int) -> list[tuple[int, int]]:
    """Everything of a state of `n` cells but its K and V (magic, cells, each layer's header, the empty streams) into
    buf's first state_size(n) bytes; returns each layer's (K offset, V offset) of its data."""
    L, E = geo.num_layers, geo.row_elements
    kind, row = geo.kv_type, geo.row_bytes
    view = memoryview(buf)
    struct.pack_into("<IiI", buf, 0, MAGIC, seq_id, geo.n_stream)
    struct.pack_into("<I", buf, 12, n)  # the first stream holds the cells (the context puts them in its own)
    pos = 16
    meta = np.frombuffer(view, dtype=np.int32, count=3 * n, offset=pos).reshape(n, 3)
    meta[:, 0] = np.arange(n, dtype=np.int32)
    meta[:, 1] = 1
    meta[:, 2] = seq_id
    pos += CELL.size * n
    struct.pack_into("<II", buf, pos, int(geo.v_trans), L)
    pos += 8
    k_at = []
    for _ in range(L):
        struct.pack_into("<iQ", buf, pos, kind, row)
        k_at.append(pos + 12)
        pos += layer_bytes(n, geo)
    v_at = []
    for _ in range(L):
        if geo.v_trans:
            struct.pack_into("<iII", buf, pos, GGML_TYPE_F16, 2, E)
        else:
            struct.pack_into("<iQ", buf, pos, kind, row)
        v_at.append(pos + 12)
        pos += layer_bytes(n, geo)
    view[pos:pos + 4 * (geo.n_stream - 1)] = bytes(4 * (geo.n_stream - 1))  # the other streams: cell_count 0
    pos += 4 * (geo.n_stream - 1)
    assert pos == state_size(n, geo) and k_at[0] == first_k(n)
    return list(zip(k_at, v_at, strict=True))


def _buffer(n: int, geo: StateGeometry, into: bytearray | None) -> bytearray:
    size = state_size(n, geo)
    if into is not None and len(into) < size:
        raise StateLayoutError(f"a state of {n} tokens needs {size} bytes, the buffer has {len(into)}")
    return into if into is not None else bytearray(size)


def assemble_state(kv: Array, geo: StateGeometry, seq_id: int = 0, into: bytearray | None = None) -> bytearray:
    """The sequence state holding `kv` [layers, 2, kv_heads, tokens, head_dim] at positions 0..tokens-1: the
    first state_size(tokens) bytes of `into` (any earlier content is overwritten; a fresh 47 MB bytearray
    costs ~17 ms of zeroing and page faults at 2048 tokens), else of a new bytearray of exactly that size."""
    L, H, D, E = geo.num_layers, geo.kv_heads, geo.head_dim, geo.row_elements
    if kv.ndim != 5 or tuple(kv.shape[:3]) != (L, 2, H) or kv.shape[4] != D:
        raise StateLayoutError(f"kv {tuple(kv.shape)} does not fit [{L}, 2, {H}, tokens, {D}]")
    n = int(kv.shape[3])
    buf = _buffer(n, geo, into)
    if geo.kv_type == GGML_TYPE_Q8_0:
        _write_layout(buf, n, geo, seq_id)
        write_q8_rows(buf, n, geo, 0, kv)
        return buf
    kv = to_host(kv)  # numpy (a torch tensor's values on the host)
    src = kv if kv.dtype == np.float16 else kv.astype(np.float32)
    view = memoryview(buf)
    for layer, (k_at, v_at) in enumerate(_write_layout(buf, n, geo, seq_id)):
        rows = np.frombuffer(view, dtype=np.float16, count=n * E, offset=k_at).reshape(n, H, D)
        np.copyto(rows.transpose(1, 0, 2), src[layer, 0], casting="same_kind")  # [H, n, D]
        if geo.v_trans:
            chans = np.frombuffer(view, dtype=np.float16, count=n * E, offset=v_at).reshape(H, D, n)
            if not kernels.transposed_into(chans, kv[layer, 1]):  # fp16 only
                np.copyto(chans.transpose(0, 2, 1), src[layer, 1], casting="same_kind")
        else:
            rows = np.frombuffer(view, dtype=np.float16, count=n * E, offset=v_at).reshape(n, H, D)
            np.copyto(rows.transpose(1, 0, 2), src[layer, 1], casting="same_kind")
    return buf


def state_view(n: int, geo: StateGeometry, seq_id: int = 0, into: bytearray | None = None,
               v_as_rows: bool = False) -> tuple[bytearray, np.ndarray] | None:
    """A sequence state of `n` cells whose K and V are left to fill: the buffer (its first state_size(n) bytes, the
    rest written as `assemble_state` writes it) and a float16 [layers, 2, kv_heads, n, head_dim] view of its K and V.
    A hit dequantized into the view is a state as it is: none is assembled (a copy of the whole KV, 9.5 ms at 2048
    SmolLM2 tokens). None when V is quantized (Q8_0), or stored transposed (no single view has both layouts) unless
    `v_as_rows`: then each layer's V is viewed as rows where the state holds it transposed, and is the state's only
    once `transpose_v` has put it in place (a region of the same size: one copy of V instead of K and V)."""
    if (geo.v_trans and not v_as_rows) or geo.kv_type != GGML_TYPE_F16:
        return None
    buf = _buffer(n, geo, into)
    k0 = _write_layout(buf, n, geo, seq_id)[0][0]
    flat = np.frombuffer(buf, dtype=np.float16, count=state_size(n, geo) // 2)
    kv = np.lib.stride_tricks.as_strided(flat[k0 // 2:], (geo.num_layers, 2, geo.kv_heads, n, geo.head_dim),
                                         tuple(2 * step for step in state_view_strides(n, geo)))
    return buf, kv


def transpose_v(buf: bytearray, n: int, geo: StateGeometry) -> None:
    """Each layer's V of a state of `n` cells in `buf` (`state_view(..., v_as_rows=True)`), written there as rows
    [n, channels], put in place as the state of a V stored transposed holds it: [channels, n] (through a one-layer
    scratch, V's regions being the same size either way)."""
    if not geo.v_trans or geo.kv_type != GGML_TYPE_F16:
        raise StateLayoutError("only V stored transposed is put in place")
    L, E = geo.num_layers, geo.row_elements
    view = memoryview(buf)
    layer = layer_bytes(n, geo)
    v0 = first_k(n) + L * layer
    scratch = np.empty((1, n, E), dtype=np.float16)
    for at in range(v0, v0 + L * layer, layer):
        region = np.frombuffer(view, dtype=np.float16, count=n * E, offset=at)
        np.copyto(scratch.reshape(-1), region)
        if not kernels.transposed_into(region.reshape(1, E, n), scratch):
            np.copyto(region.reshape(E, n), scratch[0].T)


def lay_out(buf: bytearray, n: int, geo: StateGeometry, seq_id: int = 0) -> bytearray:
    """A state of `n` cells in `buf` whose K and V are left to fill (`row_pieces`, `write_q8_rows`): everything else
    written as `assemble_state` writes it."""
    _write_layout(_buffer(n, geo, buf), n, geo, seq_id)
    return buf


def state_pieces(buf: bytearray, n: int, geo: StateGeometry, count: int) -> list[memoryview | bytes]:
    """The state of the first `count` cells of a state of `n` cells in `buf` (laid out: `lay_out`, `state_view`), as
    pieces to write one after another: byte for byte `assemble_state` of their K and V, with no copy of it (the cells'
    metadata and each layer's header and rows are views of `buf`)."""
    if geo.v_trans:
        raise StateLayoutError("V is stored transposed: a state's first cells are no run of its bytes")
    if not 0 < count <= n:
        raise StateLayoutError(f"the first {count} cells of a state of {n}")
    view, layer, row = memoryview(buf), layer_bytes(n, geo), geo.row_bytes
    head = bytes(view[:12]) + struct.pack("<I", count)
    k0 = first_k(n)
    v0 = k0 + geo.num_layers * layer
    cells_end = 16 + CELL.size * count
    pieces: list[memoryview | bytes] = [head, view[16:cells_end], bytes(view[16 + CELL.size * n:k0 - 12])]
    for first in (k0, v0):
        pieces += [view[at - 12:at + count * row] for at in range(first, first + geo.num_layers * layer, layer)]
    pieces.append(bytes(4 * (geo.n_stream - 1)))  # the other streams: cell_count 0
    return pieces


def row_pieces(buf: bytearray, n: int, geo: StateGeometry, start: int, count: int) -> list[memoryview]:
    """Where cells [start, start + count) of a state of `n` cells (`state_view`'s layout) hold their K and V: per
    layer its K rows, then its V rows, each a writable view of `buf` (the payload order of a token-rows frame,
    `CodecSpec.rows`). V stored transposed has no such rows: StateLayoutError."""
    if geo.v_trans:
        raise StateLayoutError("V is stored transposed: its cells are no rows")
    if not 0 <= start <= start + count <= n:
        raise StateLayoutError(f"cells [{start}, {start + count}) of a state of {n}")
    row, view = geo.row_bytes, memoryview(buf)
    layer, k0 = layer_bytes(n, geo), first_k(n)
    v0 = k0 + geo.num_layers * layer
    return [view[at + start * row:at + (start + count) * row]
            for i in range(geo.num_layers) for at in (k0 + i * layer, v0 + i * layer)]


def state_view_strides(n: int, geo: StateGeometry) -> tuple[int, int, int, int, int]:
    """The strides (fp16 elements) of `state_view`'s [layers, 2, kv_heads, n, head_dim]: each layer's K rows and V
    rows follow a 12-byte header; all K come first, then all V."""
    layer = layer_bytes(n, geo) // 2
    return layer, geo.num_layers * layer, geo.head_dim, geo.row_elements, 1


def write_q8_rows(buf: bytearray, n: int, geo: StateGeometry, start: int, kv: Array) -> None:
    """kv [layers, 2, kv_heads, count, head_dim] quantized into cells [start, start + count) of the Q8_0 state of `n`
    cells in `buf` (laid out already: `lay_out`), by `q8_rows`, which reproduces the bytes of a parsed state exactly.
    (An F16 state is written by `assemble_state`, or through `state_view`.)"""
    if geo.kv_type != GGML_TYPE_Q8_0:
        raise StateLayoutError(f"write_q8_rows writes Q8_0 rows, not ggml type {geo.kv_type}")
    count = int(kv.shape[3])
    if not count:
        return
    for i, piece in enumerate(row_pieces(buf, n, geo, start, count)):
        layer, half = divmod(i, 2)
        np.frombuffer(piece, dtype=np.uint8)[:] = to_host(q8_rows(kv[layer, half].swapaxes(0, 1))).reshape(-1)
