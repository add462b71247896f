"""llama.cpp's sequence-state bytes <-> kvstash KV arrays (numpy), for the pinned llama.cpp (llama-cpp-python 0.3.36).

`llama_state_seq_get_data` / `set_data` exchange one sequence of the KV cache as (all little-endian):

| field                  | type          | notes                                                     |
|------------------------|---------------|-----------------------------------------------------------|
| magic                  | u32           | 0xaf143cd8                                                |
| seq_id                 | i32           | ignored on read (the destination sequence is an argument) |
| n_stream               | u32           | 1 for a unified cache, else n_seq_max                     |
| per stream: cell_count | u32           | 0 for every stream but the sequence's own, which goes on: |
| cells                  | cell_count x  | i32 pos, u32 n_seq_id (= 1), i32 seq_id                   |
| v_trans                | u32           | 1 when V is stored transposed (no flash attention)        |
| n_layer                | u32           |                                                           |
| per layer: K           | i32 type, u64 row bytes, cell_count rows of kv_heads*head_dim |                |
| per layer: V (rows)    | as K, when v_trans = 0                                    |                |
| per layer: V (transp.) | i32 type, u32 element bytes, u32 n_embd_v_gqa,                  |                |
|                        | then n_embd_v_gqa rows of cell_count elements             |                |
| (the next streams)     | u32 cell_count = 0 each                                   |                |

K and V of type F16 (llama.cpp's default) or Q8_0 (`--cache-type-k/v q8_0`, which needs flash attention, so V is
never transposed) are read and written; a row of Q8_0 is kv_heads * head_dim / 32 blocks of an fp16 scale and 32 int8
codes (`cachestore.codec.q8.q8_rows`). Any other layout is a `StateLayoutError`: a llama.cpp upgrade that changes this
must fail the golden test, never silently corrupt a cache. Parsing copies the tensors exactly once (into the output;
only the positions asked for); so does assembling. Q8_0 is parsed into float32, which holds each code times its scale
exactly, so assembling the parsed tensor writes back the very bytes llama.cpp wrote.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from cachestore.codec.q8 import Q8_BLOCK, Q8_BYTES, q8_rows_into
from cachestore.errors import ConfigError, KvstashError

MAGIC = 0xAF143CD8
GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8
KV_TYPES = {"f16": GGML_TYPE_F16, "q8_0": GGML_TYPE_Q8_0}  # the cache types kvstash reads, by llama.cpp's names


def check_kv_type(name: str) -> None:
    """ConfigError unless `name` is a cache type kvstash reads (`KV_TYPES`), for an engine that runs one."""
    if name not in KV_TYPES:
        raise ConfigError(f"llama.cpp KV cache type {name!r}: kvstash reads {', '.join(KV_TYPES)}")


def parsed_dtype(kv_type: int) -> np.dtype:
    """What `parse_state` returns of a cache of `kv_type`: float16 of F16, float32 of Q8_0 (its values exactly)."""
    return np.dtype(np.float32 if kv_type == GGML_TYPE_Q8_0 else np.float16)


def cache_tag(kv_type: int) -> str:
    """What an engine's fingerprint adds for a cache of `kv_type`: nothing for F16, "/kv-q8_0" for Q8_0 (another
    cache computes other K and V, and flash attention other logits)."""
    return "" if kv_type == GGML_TYPE_F16 else "/kv-" + next(n for n, code in KV_TYPES.items() if code == kv_type)
# Bump when the layout above changes: it is part of the llama.cpp engine's fingerprint.
LAYOUT_VERSION = 1
CELL = struct.Struct("<iIi")  # pos, n_seq_id, seq_id (one sequence per cell)


class StateLayoutError(KvstashError):
    """Sequence-state bytes that do not follow the layout this module reads."""


class CellCountError(StateLayoutError):
    """A sequence state of another length than its caller knows the sequence to be."""


@dataclass(frozen=True)
class StateGeometry:
    """What a sequence state must look like for one model and context."""

    num_layers: int
    kv_heads: int
    head_dim: int
    v_trans: bool
    n_stream: int = 1
    kv_type: int = GGML_TYPE_F16  # of K and V alike

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPES.values():
            raise StateLayoutError(f"K and V of ggml type {self.kv_type}; kvstash reads F16 (1) and Q8_0 (8)")
        if self.kv_type == GGML_TYPE_Q8_0 and (self.v_trans or self.head_dim % Q8_BLOCK):
            raise StateLayoutError(f"a Q8_0 cache keeps V as rows (flash attention) and blocks of {Q8_BLOCK} "
                                   f"channels within a head; this one has v_trans={int(self.v_trans)}, head_dim "
                                   f"{self.head_dim}")

    @property
    def row_elements(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one cell's K (or V) row."""
        if self.kv_type == GGML_TYPE_Q8_0:
            return self.row_elements // Q8_BLOCK * Q8_BYTES
        return 2 * self.row_elements

    @property
    def dtype(self) -> np.dtype:
        """What `parse_state` returns (`parsed_dtype`)."""
        return parsed_dtype(self.kv_type)


class StateReader:
    """A cursor over a sequence state's bytes (here and in `statelayout`)."""

    def __init__(self, blob: memoryview, pos: int = 0) -> None:
        self.blob, self.pos = blob, pos

    def take(self, nbytes: int) -> int:
        """Reserve `nbytes` and return where they start; refuses to run past the end."""
        if nbytes < 0 or self.pos + nbytes > len(self.blob):
            raise StateLayoutError(f"sequence state truncated: need {nbytes} bytes at {self.pos} of {len(self.blob)}")
        start, self.pos = self.pos, self.pos + nbytes
        return start

    def unpack(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.blob, self.take(size))

    def u32(self) -> int:
        return int(self.unpack("<I")[0])


def _f16(blob: memoryview, offset: int, count: int) -> np.ndarray:
    return np.frombuffer(blob, dtype=np.float16, count=count, offset=offset)


@dataclass(frozen=True)
class StateFacts:
    """What a context's own state says about its layout (read once at start-up)."""

    n_stream: int
    v_trans: bool
    num_layers: int
    row_elements: int  # kv_heads * head_dim of layer 0's K
    kv_type: int = GGML_TYPE_F16  # of layer 0's K


def read_facts(blob: bytes | bytearray | memoryview) -> StateFacts | None:
    """The layout facts of a state (None for a state with no cells): used at start-up to check
    that the running llama.cpp writes what this module reads."""
    r = StateReader(memoryview(blob).cast("B"))
    magic, _seq = r.unpack("<Ii")
    if magic != MAGIC:
        raise StateLayoutError(f"sequence state magic {magic:#x}, expected {MAGIC:#x}")
    n_stream = r.u32()
    for _ in range(n_stream):
        cells = r.u32()
        if cells:
            r.take(cells * CELL.size)
            v_trans, n_layer = r.unpack("<II")
            k_type, k_row = r.unpack("<iQ")
            if k_type == GGML_TYPE_F16 and k_row % 2 == 0:
                return StateFacts(n_stream, bool(v_trans), n_layer, k_row // 2, k_type)
            if k_type == GGML_TYPE_Q8_0 and k_row % Q8_BYTES == 0:
                return StateFacts(n_stream, bool(v_trans), n_layer, k_row // Q8_BYTES * Q8_BLOCK, k_type)
            raise StateLayoutError(f"K cache of ggml type {k_type}, {k_row} bytes a row; kvstash reads F16 (type 1) "
                                   f"and Q8_0 (type 8)")
    return None


def parse_state(blob: bytes | bytearray | memoryview, geo: StateGeometry, start: int = 0,
                end: int | None = None, cells: int | None = None) -> np.ndarray:
    """KV of one sequence as `geo.dtype` [layers, 2, kv_heads, tokens, head_dim], tokens ordered by position; with
    `start`/`end`, only positions [start, end) (clipped to the sequence), the only ones copied. The whole state is
    validated either way, and with `cells` it must hold exactly that many tokens (whatever range is copied).

    The cells must hold positions 0..tokens-1 (each once): a sequence kvstash can cut into blocks.
    """
    view = memoryview(blob).cast("B")
    r = StateReader(view)
    magic, _seq = r.unpack("<Ii")
    if magic != MAGIC:
        raise StateLayoutError(f"sequence state magic {magic:#x}, expected {MAGIC:#x}")
    n_stream = r.u32()
    if n_stream != geo.n_stream:
        raise StateLayoutError(f"sequence state has {n_stream} streams, the context {geo.n_stream}")
    n_cells, streams_left = 0, n_stream
    while streams_left and not n_cells:  # empty streams come first, then the sequence's own
        n_cells, streams_left = r.u32(), streams_left - 1
    if cells is not None and n_cells != cells:
        raise CellCountError(f"holds KV of {n_cells}")
    L, H, D = geo.num_layers, geo.kv_heads, geo.head_dim
    stop = n_cells if end is None else min(max(end, 0), n_cells)
    first = min(max(start, 0), stop)
    out = np.empty((L, 2, H, stop - first, D), dtype=geo.dtype)  # [layers, 2, kv_heads, tokens, head_dim]
    if n_cells == 0:
        return out
    meta = np.frombuffer(view, dtype=np.int32, count=3 * n_cells, offset=r.take(n_cells * CELL.size))
    meta = meta.reshape(n_cells, 3)
    if (meta[:, 1] != 1).any():
        raise StateLayoutError("a cell shared by several sequences in a single-sequence state")
    pos = meta[:, 0]
    order: np.ndarray | slice = slice(first, stop)  # the cells of positions first..stop-1
    if not np.array_equal(pos, np.arange(n_cells, dtype=np.int32)):
        by_position = np.argsort(pos, kind="stable")
        if not np.array_equal(pos[by_position], np.arange(n_cells, dtype=np.int32)):
            raise StateLayoutError("cell positions are not 0..n-1: not a plain prefix of one sequence")
        order = by_position[first:stop]
    v_trans, n_layer = r.unpack("<II")
    if n_layer != L or bool(v_trans) != geo.v_trans:
        raise StateLayoutError(f"state of {n_layer} layers, v_trans={v_trans}; expected {L}, {int(geo.v_trans)}")
    if geo.kv_type == GGML_TYPE_Q8_0:
        _parse_q8(view, r, geo, n_cells, order, out)
    else:
        _parse_f16(view, r, geo, n_cells, order, out)
    for _ in range(streams_left):
        if r.u32():
            raise StateLayoutError("a sequence with cells in two streams")
    if r.pos != len(view):
        raise StateLayoutError(f"{len(view) - r.pos} unexpected bytes after the sequence state")
    return out


def _row_header(r: StateReader, geo: StateGeometry, layer: int, half: str) -> None:
    kind, row = r.unpack("<iQ")
    if kind != geo.kv_type or row != geo.row_bytes:
        raise StateLayoutError(f"layer {layer}: {half} of type {kind}, {row} bytes a row; expected type "
                               f"{geo.kv_type}, {geo.row_bytes}")


def _parse_q8(view: memoryview, r: StateReader, geo: StateGeometry, n_cells: int, order: np.ndarray | slice,
              out: np.ndarray) -> None:
    """Every layer's K, then V, Q8_0 rows dequantized into out [layers, 2, kv_heads, tokens, head_dim] (float32)."""
    for half, name in enumerate(("K", "V")):
        for layer in range(geo.num_layers):
            _row_header(r, geo, layer, name)
            at = r.take(n_cells * geo.row_bytes)
            rows = np.frombuffer(view, dtype=np.uint8, count=n_cells * geo.row_bytes, offset=at)  # read only
            rows = rows.reshape(n_cells, geo.kv_heads, geo.row_bytes // geo.kv_heads)[order]  # [tokens, H, blocks]
            q8_rows_into(out[layer, half].swapaxes(0, 1), rows)


def _parse_f16(view: memoryview, r: StateReader, geo: StateGeometry, n_cells: int, order: np.ndarray | slice,
               out: np.ndarray) -> None:
    L, H, D, E = geo.num_layers, geo.kv_heads, geo.head_dim, geo.row_elements
    for layer in range(L):
        _row_header(r, geo, layer, "K")
        rows = _f16(view, r.take(n_cells * 2 * E), n_cells * E).reshape(n_cells, H, D)
        _place(out[layer, 0], rows.transpose(1, 0, 2), order)  # [H, cells, D]
    for layer in range(L):
        if geo.v_trans:
            v_type, v_el, v_embd = r.unpack("<iII")
            if v_type != GGML_TYPE_F16 or v_el != 2 or v_embd != E:
                raise StateLayoutError(f"layer {layer}: transposed V of type {v_type}, {v_el}-byte elements, "
                                       f"{v_embd} channels; expected F16, 2, {E}")
            chans = _f16(view, r.take(E * n_cells * 2), E * n_cells).reshape(H, D, n_cells)
            _place(out[layer, 1], chans.transpose(0, 2, 1), order)  # [H, cells, D]
        else:
            _row_header(r, geo, layer, "V")
            rows = _f16(view, r.take(n_cells * 2 * E), n_cells * E).reshape(n_cells, H, D)
            _place(out[layer, 1], rows.transpose(1, 0, 2), order)


def _place(dst: np.ndarray, src: np.ndarray, order: np.ndarray | slice) -> None:
    """dst[H, tokens, D] = the cells `order` picks of src[H, cells, D] (a slice when they are in position order)."""
    if isinstance(order, slice):
        np.copyto(dst, src[:, order])
    else:
        np.take(src, order, axis=1, out=dst)


def layer_bytes(tokens: int, geo: StateGeometry) -> int:
    """Bytes of one layer's K (or V) in a state of `tokens` cells: a 12-byte header (both V layouts), then the cells."""
    return 12 + geo.row_bytes * tokens


def first_k(tokens: int) -> int:
    """Where layer 0's K cells start in a state of `tokens` cells (in the first stream: `_write_layout`)."""
    return 16 + CELL.size * tokens + 8 + 12


def state_size(tokens: int, geo: StateGeometry) -> int:
    """Bytes of the state of `tokens` cells."""
    return 12 + 4 * geo.n_stream + CELL.size * tokens + 8 + 2 * geo.num_layers * layer_bytes(tokens, geo)
