"""llama-server slot files (`POST /slots/{id}?action=save|restore`) <-> token ids and KV tensors.

A slot file is what `llama_state_seq_save_file` writes for the pinned llama.cpp (all little-endian):

| field            | type             | notes                                                             |
|------------------|------------------|-------------------------------------------------------------------|
| magic            | u32              | 0x67677371 'ggsq' (LLAMA_STATE_SEQ_MAGIC)                         |
| version          | u32              | 3 (LLAMA_STATE_SEQ_VERSION)                                       |
| n_packed         | u32              | i32 words of the packed token list that follow                    |
| packed tokens    | n_packed x i32   | llama-server's server_tokens state, below                         |
| sequence state   | the rest         | llamastate's layout without its 8-byte magic + seq_id prefix      |

llama-server packs its token list as: i32 -1 (LLAMA_TOKEN_NULL, the marker), u32 1 (its state version),
u32 n, n x i32 tokens, u32 0 (no media chunks). Files with media, another version or trailing bytes are
refused (`SlotFileError`), so a change upstream fails the golden test instead of restoring wrong KV.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachestore.codec.arrays import Array
from service.engines.llama import llamastate, statewrite

MAGIC = 0x67677371  # 'ggsq'
VERSION = 3
TOKENS_MARKER = -1  # LLAMA_TOKEN_NULL: the packed (not plain) token list
TOKENS_VERSION = 1  # SERVER_TOKENS_STATE_VERSION
_HEADER = struct.Struct("<III")
_STATE_PREFIX = struct.Struct("<Ii")  # llamastate's magic + seq_id, absent from files


class SlotFileError(llamastate.StateLayoutError):
    """A slot file that does not follow the layout this module reads."""


@dataclass(frozen=True)
class SlotFile:
    """One saved slot: its tokens and their KV [layers, 2, kv_heads, tokens, head_dim] float16, from token `kv_from`
    on (all of them unless a reader asked for less)."""

    tokens: list[int]
    kv: Array
    kv_from: int = 0
    boundary: bytes = b""  # a sliding-window or hybrid model's boundary state at the end of `tokens`


def _packed_tokens(words: np.ndarray) -> list[int]:
    if len(words) == 0 or int(words[0]) != TOKENS_MARKER:
        return [int(t) for t in words]  # the plain list older servers wrote (still accepted upstream)
    if len(words) < 4 or int(words[1]) != TOKENS_VERSION:
        raise SlotFileError(f"slot tokens state version {int(words[1]) if len(words) > 1 else None}; "
                            f"kvstash reads {TOKENS_VERSION}")
    n = int(words[2])
    if n < 0 or len(words) != n + 4:
        raise SlotFileError(f"slot token list of {n} tokens in {len(words)} words")
    if int(words[3 + n]) != 0:
        raise SlotFileError("slot holds media chunks; kvstash caches text only")
    return [int(t) for t in words[3 : 3 + n]]


def _state(view: memoryview) -> tuple[list[int], bytearray]:
    """The tokens of a slot file and its sequence state with llamastate's 8-byte prefix put back."""
    if len(view) < _HEADER.size:
        raise SlotFileError(f"slot file of {len(view)} bytes")
    magic, version, n_packed = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise SlotFileError(f"slot file magic {magic:#x} version {version}; expected {MAGIC:#x} version {VERSION}")
    state_at = _HEADER.size + 4 * n_packed
    if state_at > len(view):
        raise SlotFileError(f"slot file truncated: {n_packed} token words, {len(view)} bytes")
    tokens = _packed_tokens(np.frombuffer(view, dtype=np.int32, count=n_packed, offset=_HEADER.size))
    state = bytearray(_STATE_PREFIX.size + len(view) - state_at)
    _STATE_PREFIX.pack_into(state, 0, llamastate.MAGIC, 0)
    state[_STATE_PREFIX.size :] = view[state_at:]
    return tokens, state


def facts(data: bytes | bytearray | memoryview) -> llamastate.StateFacts:
    """The layout facts of a saved slot (it must hold tokens): checked once when the sidecar starts."""
    _tokens, state = _state(memoryview(data).cast("B"))
    found = llamastate.read_facts(state)
    if found is None:
        raise SlotFileError("the saved slot holds no KV cells")
    return found


def state_of(data: bytes | bytearray | memoryview) -> bytearray:
    """The sequence state a slot file holds, as `llama_state_seq_get_data` writes it (magic and seq_id first)."""
    return _state(memoryview(data).cast("B"))[1]


def parse(data: bytes | bytearray | memoryview, geo: llamastate.StateGeometry, start: int = 0) -> SlotFile:
    """Tokens and KV of a slot file's bytes, the KV of tokens `start`.. only; the KV must cover exactly its tokens."""
    tokens, state = _state(memoryview(data).cast("B"))
    start = min(max(0, start), len(tokens))
    try:  # [layers, 2, kv_heads, tokens - start, head_dim]
        kv = llamastate.parse_state(state, geo, start, cells=len(tokens))
    except llamastate.CellCountError as exc:
        raise SlotFileError(f"slot file lists {len(tokens)} tokens but {exc}") from None
    return SlotFile(tokens, kv, start)


def read(path: Path, geo: llamastate.StateGeometry, start: int = 0) -> SlotFile:
    return parse(path.read_bytes(), geo, start)


def _head(tokens: list[int]) -> list[memoryview | bytes]:
    """A slot file's header and token words."""
    n = len(tokens)
    packed = np.empty(n + 4, dtype=np.int32)
    packed[0], packed[1], packed[2], packed[3 + n] = TOKENS_MARKER, TOKENS_VERSION, n, 0
    packed[3 : 3 + n] = tokens
    return [_HEADER.pack(MAGIC, VERSION, n + 4), packed.tobytes()]


def assemble(tokens: list[int], kv: Array, geo: llamastate.StateGeometry) -> list[memoryview | bytes]:
    """The pieces of the slot file holding `kv` [layers, 2, kv_heads, len(tokens), head_dim] for `tokens`,
    byte for byte what llama-server itself saves; written one after another (no joined copy of the KV)."""
    if kv.shape[3] != len(tokens):
        raise SlotFileError(f"{len(tokens)} tokens but KV of {kv.shape[3]}")
    state = statewrite.assemble_state(kv, geo)
    return [*_head(tokens), memoryview(state)[_STATE_PREFIX.size :]]


def from_state(tokens: list[int], state: bytearray, cells: int,
               geo: llamastate.StateGeometry) -> list[memoryview | bytes]:
    """The pieces of the slot file of `tokens` whose KV are the first len(tokens) cells of the sequence state of
    `cells` cells in `state` (a context lent: lending), as `assemble` writes it, with no copy of the
    KV: the state's own rows are written."""
    pieces = statewrite.state_pieces(state, cells, geo, len(tokens))
    return [*_head(tokens), pieces[0][_STATE_PREFIX.size :], *pieces[1:]]


def write(path: Path, tokens: list[int], kv: Array, geo: llamastate.StateGeometry) -> int:
    """Write the slot file for `tokens` and their `kv` to `path`; returns its size in bytes."""
    return write_pieces(path, assemble(tokens, kv, geo))


def write_pieces(path: Path, pieces: list[memoryview | bytes]) -> int:
    """Write a slot file's pieces (`assemble`, `from_state`) to `path`; returns its size in bytes."""
    with path.open("wb") as fh:
        for piece in pieces:
            fh.write(piece)
    return sum(len(p) for p in pieces)
