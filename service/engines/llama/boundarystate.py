"""Boundary states: what a sliding-window or hybrid sequence needs at a position beside its full-attention KV."""

from __future__ import annotations

import struct
from collections.abc import Sequence

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


def with_streams(state: bytes, kinds: Sequence[str], n_stream: int) -> bytes:
    """A boundary state (`split_state`) with each KV section widened to `n_stream` streams, its cells in the first
    (llama.cpp moves them to the destination sequence's own stream)."""
    view = memoryview(struct.pack("<Ii", MAGIC, 0) + state)
    out = []
    for section in read_sections(view, kinds):
        if isinstance(section, KvSection) and n_stream > 1:
            out += [struct.pack("<I", n_stream), bytes(view[section.start + 4:section.end]),
                    bytes(4 * (n_stream - 1))]
        else:
            out.append(bytes(view[section.start:section.end]))
    return b"".join(out)
