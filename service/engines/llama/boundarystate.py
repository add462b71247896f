"""Boundary states: what a sliding-window or hybrid sequence needs at a position beside its full-attention KV."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from service.engines.llama.llamastate import MAGIC, StateLayoutError
from service.engines.llama.statelayout import KV, RECURRENT, KvSection, ModelLayout, read_sections


def boundary_kinds(layout: ModelLayout) -> tuple[str, ...]:
    """The sections after the full-attention KV section of a layout's state (what a boundary record holds): the
    sliding-window KV, the recurrent state, or both; () for full attention only."""
    return ((KV,) if layout.sliding_count else ()) + ((RECURRENT,) if layout.recurrent_count else ())


def _one_stream(view: memoryview, section: KvSection) -> bytes:
    """A KV section rewritten as of a context of one stream: llama.cpp restores a sequence's cells into its own
    stream whichever stream wrote them, but wants as many streams as its context has (`with_streams`)."""
    count = len(section.positions)
    if not count:
        return struct.pack("<II", 1, 0)
    cells_at = section.start + 4 + 4 * (section.stream + 1)
    end = section.end - 4 * (section.n_stream - section.stream - 1)
    return struct.pack("<II", 1, count) + bytes(view[cells_at:end])


def split_state(blob: bytes | bytearray | memoryview, kinds: Sequence[str]) -> tuple[int, bytes]:
    """Where a state's full-attention KV section ends, and the sections after it with each KV section of one stream
    (a boundary state, portable between contexts of any number of sequences); `kinds` as `section_kinds`."""
    view = memoryview(blob).cast("B")
    sections = read_sections(view, kinds)
    rest = [_one_stream(view, s) if isinstance(s, KvSection) else bytes(view[s.start:s.end]) for s in sections[1:]]
    return sections[0].end, b"".join(rest)


def check_boundary(state: bytes, layout: ModelLayout, position: int, v_trans: bool) -> str | None:
    """Why a boundary state read back (untrusted) is not one this layout writes at `position`, or None: its sections
    as `boundary_kinds`, the window's layers, rows and cells (positions max(0, P - n_swa) .. P - 1), the recurrent
    state's layers, size and position (P - 1)."""
    try:
        sections = read_sections(struct.pack("<Ii", MAGIC, 0) + state, boundary_kinds(layout))
    except StateLayoutError as exc:
        return str(exc)
    for section in sections:
        if isinstance(section, KvSection):
            window = set(range(max(0, position - layout.n_swa), position))
            rows = tuple(r.row_bytes for r in section.k)
            if section.n_stream != 1 or section.v_trans != v_trans or rows != layout.kv_row_bytes[layout.full:]:
                return f"a window of {section.n_layer} layers, rows {rows}, v_trans={int(section.v_trans)}"
            if len(section.positions) != len(window) or set(section.positions) != window:
                return f"a window of {len(section.positions)} cells, not the {len(window)} before {position}"
        elif (section.positions != (position - 1,) or section.model_layers != layout.n_layer
              or len(section.r) != layout.recurrent_count or section.state_bytes != layout.recurrent_bytes):
            return (f"a recurrent state at {section.positions} of {len(section.r)} layers, {section.state_bytes} "
                    f"bytes; expected position {position - 1}")
    return None


def with_streams(state: bytes, kinds: Sequence[str], n_stream: int) -> list[bytes | memoryview]:
    """A boundary state (`split_state`) to set after the full-attention KV of its position, as pieces to write one
    after another (no joined copy: the window's fillers are most of it): each KV section widened to `n_stream`
    streams, its cells in the first (llama.cpp moves them to the destination sequence's own stream), and its window
    put in the cells the engine's own sequence keeps it in (`_kept_in_place`)."""
    view = memoryview(struct.pack("<Ii", MAGIC, 0) + state)
    out: list[bytes | memoryview] = []
    for section in read_sections(view, kinds):
        if isinstance(section, KvSection):
            out += [struct.pack("<I", n_stream), *_kept_in_place(view, section), bytes(4 * (n_stream - 1))]
        else:
            out.append(view[section.start:section.end])
    return out


def _kept_in_place(view: memoryview, section: KvSection) -> list[bytes | memoryview]:
    """A one-stream window section (u32 cell count on: no stream count) whose cells of positions P - n_swa .. P - 1
    follow filler cells of positions 0 .. P - n_swa - 1, their K and V zero.

    A sequence llama.cpp decodes from its first token keeps its sliding-window layers' cells in a cache as large as
    the full-attention one (llama-server's --swa-full; llama_context_default_params): the cell of position p is cell
    p, and cells past the window stay, masked. A state holds only the window, which a restore would place in cells
    0 .. n_swa - 1: attention then sums the same values in other tiles and thread chunks (it tiles and splits a
    cache by cell index), and the rounding, so a near-tie greedy reply, differs from what the engine continues from
    its own cache. Masked, the fillers are skipped or weigh exactly zero (zero K and V are finite), so restored
    with them each window cell is where the engine keeps it and every sum runs as in memory."""
    count = len(section.positions)
    first = section.positions[0] if count else 0
    body = view[section.start + 8:section.end]  # past the stream count and the cell count
    if not count or section.positions != tuple(range(first, first + count)):
        return [struct.pack("<I", count), body]
    cells_end = section.start + 8 + 12 * count
    fill = np.zeros((first, 3), dtype="<i4")
    fill[:, 0], fill[:, 1] = np.arange(first), 1  # position, one sequence (0: llama.cpp restores into its own)
    out: list[bytes | memoryview] = [struct.pack("<I", first + count), fill.tobytes(),
                                     view[section.start + 8:cells_end + 8]]  # the window's cells, v_trans, n_layer
    zeros = memoryview(bytes(first * max(r.row_bytes for r in section.k + section.v)))  # one, sliced per layer
    for rows, transposed in [(k, False) for k in section.k] + [(v, section.v_trans) for v in section.v]:
        out.append(view[rows.at - 12:rows.at])  # i32 type, u64 row bytes (transposed: u32 element bytes, channels)
        if transposed:  # a row of `count` elements per channel
            channels = struct.unpack_from("<I", view, rows.at - 4)[0]
            row = rows.row_bytes // channels * count
            placed = np.zeros((channels, first * rows.row_bytes // channels + row), dtype=np.uint8)
            placed[:, -row:] = np.frombuffer(view, np.uint8, channels * row, rows.at).reshape(channels, row)
            out.append(placed.data)
        else:
            out += [zeros[:first * rows.row_bytes], view[rows.at:rows.at + count * rows.row_bytes]]
    return out
