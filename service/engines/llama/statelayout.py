"""The sections of a llama.cpp sequence state (pinned llama-cpp-python 0.3.36): KV caches and recurrent states.

`llama_state_seq_get_data(_ext)` writes u32 magic 0xaf143cd8, i32 seq_id, then what the context's memory writes,
one section after another (all little-endian):

| memory (llama.cpp source)         | sections, in order            | with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY |
|-----------------------------------|-------------------------------|-----------------------------------------|
| llama_kv_cache (full attention)   | kv                            | kv (the flag is ignored)                |
| llama_kv_cache_iswa (Gemma, gpt-oss) | kv (full layers), kv (SWA layers) | kv (SWA layers)                  |
| llama_memory_hybrid (LFM2, Granite 4) | kv (attention layers), recurrent | recurrent                          |
| llama_memory_hybrid_iswa          | kv, kv (SWA), recurrent       | kv (SWA), recurrent                     |
| llama_memory_recurrent (Mamba)    | recurrent                     | recurrent                               |

A kv section is `service.engines.llama.llamastate`'s table from n_stream on: per stream a u32 cell count, the sequence's
stream then its cells (i32 pos, u32 n_seq_id, i32 seq_id), u32 v_trans, u32 n_layer and each of its layers' K, then
V; n_layer counts that cache's layers only. A SWA cache writes only the cells a next token can still attend to:
position p with pos_max - p < n_swa. No layer says which model layer it is.

A recurrent section is u32 cell_count (1 for one sequence), per cell i32 pos (the last position folded in) and
u32 n_seq_id = 0, u32 s_trans (0), u32 n_layer (all of the model's layers), then for each recurrent layer only
i32 type, u64 row bytes and cell_count rows of R (the conv state), then for each the same of S (the SSM state;
0 bytes a row where a layer has none, as LFM2's short convolutions). It is one fixed-size state that holds everything
up to pos: it cannot be cut back to an earlier position. A layer with a second conv row (PLE) writes an extra u64
and rows with no type before it: such a state is refused (its sections do not end where the blob does).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from service.engines.llama.llamastate import MAGIC, StateLayoutError, StateReader

KV, RECURRENT = "kv", "recurrent"
_KV_CELL = 12  # i32 pos, u32 n_seq_id (= 1), i32 seq_id
_RECURRENT_CELL = 8  # i32 pos, u32 n_seq_id (= 0 for a single sequence's state)


@dataclass(frozen=True)
class Rows:
    """One layer's rows of one tensor: ggml type, bytes a row, where the rows start (cells x row bytes follow)."""

    ggml_type: int
    row_bytes: int
    at: int


@dataclass(frozen=True)
class KvSection:
    """One KV cache's part of a state: `start`..`end` in the blob, its cells' positions (in cell order), each of its
    layers' K and V. A transposed V's `row_bytes` is its channel count times its element bytes."""

    start: int
    end: int
    n_stream: int
    positions: tuple[int, ...]
    v_trans: bool
    k: tuple[Rows, ...]
    v: tuple[Rows, ...]
    stream: int = 0  # the stream holding the cells (the others hold none)

    @property
    def n_layer(self) -> int:
        return len(self.k)


def cut_kv(blob: bytes | bytearray | memoryview, section: KvSection, count: int) -> bytes:
    """`section` of `blob` holding only its first `count` positions: the KV section llama.cpp writes of the same
    sequence `count` tokens long, for a full-attention cache whose cells are in position order and V kept as rows
    (flash attention). A boundary state is such a cut, then the window and recurrent sections taken at the
    boundary."""
    if section.v_trans:
        raise StateLayoutError("V is stored transposed: a cut is no run of its rows")
    if not 0 < count <= len(section.positions) or section.positions[:count] != tuple(range(count)):
        raise StateLayoutError(f"the first {count} positions of a section of positions "
                               f"{section.positions[:1]}..{section.positions[-1:]} are not 0..{count - 1}")
    view = memoryview(blob).cast("B")
    counts = [count if i == section.stream else 0 for i in range(section.n_stream)]
    cells_at = section.start + 4 + 4 * (section.stream + 1)
    out = [struct.pack(f"<I{section.stream + 1}I", section.n_stream, *counts[:section.stream + 1]),
           bytes(view[cells_at:cells_at + _KV_CELL * count]),
           struct.pack("<II", int(section.v_trans), section.n_layer)]
    for rows in section.k + section.v:
        out.append(struct.pack("<iQ", rows.ggml_type, rows.row_bytes))
        out.append(bytes(view[rows.at:rows.at + count * rows.row_bytes]))
    out.append(struct.pack(f"<{section.n_stream - section.stream - 1}I", *counts[section.stream + 1:]))
    return b"".join(out)


@dataclass(frozen=True)
class RecurrentSection:
    """A recurrent memory's part of a state: its cells' positions, the model's layer count, each recurrent layer's
    R (conv) rows and S (SSM) rows."""

    start: int
    end: int
    positions: tuple[int, ...]
    model_layers: int
    r: tuple[Rows, ...]
    s: tuple[Rows, ...]

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent state of one cell over all its layers."""
        return sum(rows.row_bytes for rows in self.r + self.s)


Section = KvSection | RecurrentSection


class _Cursor(StateReader):
    def rows(self, cells: int, what: str) -> Rows:
        kind, row = self.unpack("<iQ")
        if row > 1 << 30:
            raise StateLayoutError(f"{what}: {row} bytes a row")
        return Rows(kind, row, self.take(cells * row))


def _kv_section(c: _Cursor) -> KvSection:
    start = c.pos
    n_stream = c.u32()
    if not 0 < n_stream <= 4096:
        raise StateLayoutError(f"a KV section of {n_stream} streams")
    positions: tuple[int, ...] = ()
    stream = 0
    v_trans = False
    k: tuple[Rows, ...] = ()
    v: tuple[Rows, ...] = ()
    for index in range(n_stream):
        cells = c.u32()
        if not cells:
            continue
        if positions:
            raise StateLayoutError("a sequence with cells in two streams")
        stream = index
        meta = struct.unpack_from(f"<{3 * cells}i", c.blob, c.take(cells * _KV_CELL))
        if any(n != 1 for n in meta[1::3]):
            raise StateLayoutError("a cell shared by several sequences in a single-sequence state")
        positions = tuple(meta[0::3])
        trans, n_layer = c.unpack("<II")
        v_trans = bool(trans)
        k = tuple(c.rows(cells, f"layer {i} K") for i in range(n_layer))
        if v_trans:
            v_list = []
            for i in range(n_layer):
                kind, el, embd = c.unpack("<iII")
                if not 0 < el <= 8 or not 0 < embd <= 1 << 20:
                    raise StateLayoutError(f"layer {i} transposed V: {el}-byte elements, {embd} channels")
                v_list.append(Rows(kind, el * embd, c.take(el * embd * cells)))
            v = tuple(v_list)
        else:
            v = tuple(c.rows(cells, f"layer {i} V") for i in range(n_layer))
    return KvSection(start, c.pos, n_stream, positions, v_trans, k, v, stream)


def _recurrent_section(c: _Cursor) -> RecurrentSection:
    start = c.pos
    cells = c.u32()
    if cells > 1:
        raise StateLayoutError(f"a recurrent section of {cells} cells; one sequence has one")
    meta = struct.unpack_from(f"<{2 * cells}i", c.blob, c.take(cells * _RECURRENT_CELL))
    if any(meta[1::2]):
        raise StateLayoutError("a recurrent cell naming sequences in a single-sequence state")
    if not cells:
        return RecurrentSection(start, c.pos, (), 0, (), ())
    s_trans, model_layers = c.unpack("<II")
    if s_trans:
        raise StateLayoutError("a transposed recurrent S state")
    # every recurrent layer has an R and an S tensor (S of 0 bytes a row where it has no SSM state, as LFM2's short
    # convolutions): all R headers and rows, then all S, as many; their count is not written but follows from where
    # the rows end: the recurrent section ends the state
    rows: list[Rows] = []
    while c.pos < len(c.blob) and len(rows) < 2 * model_layers:
        rows.append(c.rows(cells, f"recurrent rows {len(rows)}"))
    half = len(rows) // 2
    if len(rows) % 2 or not half:
        raise StateLayoutError(f"a recurrent section of {len(rows)} row sets: not an R and an S per layer")
    return RecurrentSection(start, c.pos, tuple(meta[0::2]), model_layers, tuple(rows[:half]), tuple(rows[half:]))


def read_sections(blob: bytes | bytearray | memoryview, kinds: Sequence[str]) -> tuple[Section, ...]:
    """The sections of a sequence state, which must be of `kinds` (KV, RECURRENT) in that order and fill the blob.
    """
    view = memoryview(blob).cast("B")
    c = _Cursor(view)
    magic, _seq = c.unpack("<Ii")
    if magic != MAGIC:
        raise StateLayoutError(f"sequence state magic {magic:#x}, expected {MAGIC:#x}")
    sections: list[Section] = []
    for kind in kinds:
        if kind == KV:
            sections.append(_kv_section(c))
        elif kind == RECURRENT:
            sections.append(_recurrent_section(c))
        else:
            raise StateLayoutError(f"no section kind {kind!r}")
    if c.pos != len(view):
        raise StateLayoutError(f"{len(view) - c.pos} unexpected bytes after the sections {', '.join(kinds)}")
    return tuple(sections)


# Which layers slide where a GGUF says no more than the window: llama.cpp's default `load_swa_pattern(ml, n,
# dense_first)` of each architecture (src/models/*.cpp of the pinned source). Layer il slides unless
# il % n == n - 1 (dense_first: unless il % n == 0).
SWA_PATTERNS = {"gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False), "gpt-oss": (2, False),
                "cohere2": (4, False), "exaone4": (4, False), "olmo2": (4, False), "llama4": (4, False)}


def _pattern(n_layer: int, n_pattern: int, dense_first: bool) -> tuple[int, ...]:
    if dense_first:
        return tuple(il for il in range(n_layer) if n_pattern == 0 or il % n_pattern != 0)
    return tuple(il for il in range(n_layer) if n_pattern == 0 or il % n_pattern < n_pattern - 1)


def sliding_layers(arch: str, n_layer: int, pattern: object) -> tuple[int, ...] | None:
    """The layers with a sliding window, from the GGUF's `<arch>.attention.sliding_window_pattern` (`pattern`: a
    list of booleans, a period, or None) else the architecture's default; None where neither says."""
    dense_first = SWA_PATTERNS.get(arch, (0, False))[1]
    if isinstance(pattern, list):
        return tuple(il for il, slides in enumerate(pattern[:n_layer]) if slides)
    if isinstance(pattern, int) and not isinstance(pattern, bool):
        return _pattern(n_layer, pattern, dense_first)
    if arch in SWA_PATTERNS:
        return _pattern(n_layer, *SWA_PATTERNS[arch])
    return None


def recurrent_layers(n_layer: int, head_count_kv: object) -> tuple[int, ...] | None:
    """The layers of a hybrid model with a recurrent state: those with no KV heads (`<arch>.attention.head_count_kv`
    as a per-layer list, as LFM2, Granite 4 and Nemotron-H write it); None where the GGUF does not say."""
    if isinstance(head_count_kv, list) and len(head_count_kv) == n_layer:
        return tuple(il for il, heads in enumerate(head_count_kv) if heads == 0)
    return None


def layer_ranges(layers: Sequence[int]) -> str:
    """0,1,2,3,4,6 -> "0-4,6"."""
    out: list[str] = []
    for il in layers:
        if out and out[-1].split("-")[-1] == str(il - 1):
            out[-1] = out[-1].split("-")[0] + f"-{il}"
        else:
            out.append(str(il))
    return ",".join(out) or "none"


def _layers(layers: Sequence[int]) -> str:
    return ("layer " if len(layers) == 1 else "layers ") + layer_ranges(layers)


@dataclass(frozen=True)
class ModelLayout:
    """Which kind of memory each layer of a model keeps in llama.cpp, as its sequence state shows it: full-attention
    KV for every position, sliding-window KV for the last `n_swa` positions, or one recurrent state of
    `recurrent_bytes` a sequence. Layers llama.cpp keeps but the GGUF does not name are None."""

    arch: str
    n_layer: int
    full: int  # layers of full-attention KV (the first KV section)
    n_swa: int = 0
    sliding: tuple[int, ...] | None = ()
    sliding_count: int = 0
    recurrent: tuple[int, ...] | None = ()
    recurrent_count: int = 0
    recurrent_bytes: int = 0  # R + S of every recurrent layer, one sequence
    kv_row_bytes: tuple[int, ...] = ()  # K row bytes of each KV layer, full then sliding

    @property
    def full_attention_only(self) -> bool:
        return not self.sliding_count and not self.recurrent_count

    def tag(self) -> str:
        """What an engine's fingerprint adds: nothing for full attention only (so those fingerprints stay), else
        the window and the sliding layers, the recurrent layers and their state's size, and each KV layer's row."""
        if self.full_attention_only:
            return ""
        parts = [f"/layout:{self.arch}:{self.n_layer}"]
        if self.sliding_count:
            parts.append(f"/swa{self.n_swa}:{layer_ranges(self.sliding) if self.sliding is not None else '?'}"
                         f"x{self.sliding_count}")
        if self.recurrent_count:
            parts.append(f"/rec:{layer_ranges(self.recurrent) if self.recurrent is not None else '?'}"
                         f"x{self.recurrent_count}:{self.recurrent_bytes}B")
        parts.append("/rows:" + ",".join(str(b) for b in self.kv_row_bytes))
        return "".join(parts)

    def describe(self) -> str:
        """One line naming the layout: "gemma3, 6 layers: 5 sliding-window (window 32; layers 0-4),
        1 full-attention"."""
        kinds = []
        if self.sliding_count:
            where = f"; {_layers(self.sliding)}" if self.sliding is not None else ""
            kinds.append(f"{self.sliding_count} sliding-window (window {self.n_swa}{where})")
        if self.recurrent_count:
            where = f"{_layers(self.recurrent)}; " if self.recurrent is not None else ""
            kinds.append(f"{self.recurrent_count} recurrent ({where}{self.recurrent_bytes:,} bytes of state a "
                         f"sequence)")
        kinds.append(f"{self.full} full-attention")
        return f"{self.arch}, {self.n_layer} layers: {', '.join(kinds)}"


# Every order of sections a memory of the pinned llama.cpp writes (the table above), for a state of unknown origin
# (a slot file): one fills a state exactly, the others run short or past its end
SECTION_ORDERS = ((KV,), (KV, KV), (KV, RECURRENT), (KV, KV, RECURRENT), (RECURRENT,))


def infer_sections(blob: bytes | bytearray | memoryview) -> tuple[Section, ...]:
    """The sections of a state, of whichever of SECTION_ORDERS fills it; StateLayoutError where none does."""
    errors = []
    for kinds in SECTION_ORDERS:
        try:
            return read_sections(blob, kinds)
        except StateLayoutError as exc:
            errors.append(f"{'+'.join(kinds)}: {exc}")
    raise StateLayoutError("a state of no layout kvstash knows (" + "; ".join(errors) + ")")


def section_kinds(n_swa: int, hybrid: bool, recurrent: bool) -> tuple[str, ...]:
    """The sections a full (not PARTIAL_ONLY) state of such a model holds, in order (the table above)."""
    if recurrent:
        return (RECURRENT,)
    return (KV,) + ((KV,) if n_swa > 0 else ()) + ((RECURRENT,) if hybrid else ())


def model_layout(arch: str, n_layer: int, n_swa: int, sections: Sequence[Section],
                 sliding: tuple[int, ...] | None, recurrent: tuple[int, ...] | None) -> ModelLayout:
    """The layout of a model from a state of one decoded sequence (`read_sections` of `section_kinds`) and what its
    GGUF says of its layers; StateLayoutError where the two disagree."""
    kv = [s for s in sections if isinstance(s, KvSection)]
    rec = [s for s in sections if isinstance(s, RecurrentSection)]
    full = kv[0].n_layer if kv and (n_swa <= 0 or len(kv) == 2) else 0
    swa = kv[-1].n_layer if n_swa > 0 and kv else 0
    n_rec = len(rec[0].r) if rec else 0
    if sliding is not None and len(sliding) != swa:
        raise StateLayoutError(f"{arch}: the GGUF names {len(sliding)} sliding-window layers, the state holds {swa}")
    if recurrent is not None and len(recurrent) != n_rec:
        raise StateLayoutError(f"{arch}: the GGUF names {len(recurrent)} recurrent layers, the state holds {n_rec}")
    if full + swa + n_rec != n_layer:
        raise StateLayoutError(f"{arch}: {full} full-attention + {swa} sliding + {n_rec} recurrent layers in the "
                               f"state, {n_layer} in the model")
    return ModelLayout(
        arch=arch, n_layer=n_layer, full=full, n_swa=max(n_swa, 0) if swa else 0,
        sliding=sliding if swa else (), sliding_count=swa,
        recurrent=recurrent if n_rec else (), recurrent_count=n_rec,
        recurrent_bytes=rec[0].state_bytes if rec else 0,
        kv_row_bytes=tuple(rows.row_bytes for s in kv for rows in s.k),
    )
