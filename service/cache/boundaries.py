"""Which boundary records a prompt can resume from, and which records a generation leaves (cachestore.boundary).

A sliding-window or hybrid model resumes only at a boundary P some pod stopped at: its full blocks before P and a
record at P. The lookup reads the record under the chain root and under every block hash of the prompt in one round
trip (`record_parents`); `candidates` keeps those whose tokens the prompt continues, longest first. A generation
leaves a record at the end of its prompt and at the end of its sequence (`records_of`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachestore.boundary import BoundaryRecord, unpack_boundary
from cachestore.errors import CodecError
from cachestore.hashing import BlockHash


@dataclass(frozen=True)
class Candidate:
    """A record the prompt continues: the boundary P, the full blocks before it, the record, its bytes."""

    position: int
    blocks: int
    record: BoundaryRecord
    nbytes: int


def record_parents(root: BlockHash, hashes: Sequence[BlockHash]) -> list[BlockHash]:
    """The parents a record of the prompt may lie under: the chain root (no full block before it), then each block."""
    return [root, *hashes]


def candidates(values: Sequence[bytes | None], prompt_ids: Sequence[int], usable: int, block_tokens: int,
               on_corrupt: Callable[[str], None]) -> list[Candidate]:
    """The records (values under `record_parents`, in order) the prompt's first `usable` tokens continue, longest
    first; a record that does not parse, or names another position than its key's, is reported and skipped."""
    found = []
    for blocks, value in enumerate(values):
        if value is None:
            continue
        try:
            record = unpack_boundary(value)
        except CodecError as exc:
            on_corrupt(f"boundary record: {exc}")
            continue
        start = blocks * block_tokens
        n = len(record.token_ids)
        if record.position != start + n or n >= block_tokens:
            on_corrupt(f"boundary record at {record.position} of {n} tokens under block {blocks}")
            continue
        if record.position > usable or list(prompt_ids[start:record.position]) != record.token_ids:
            continue  # a boundary of another continuation
        if record.position == 0:
            continue
        found.append(Candidate(record.position, blocks, record, len(value)))
    return sorted(found, key=lambda c: -c.position)


@dataclass(frozen=True)
class RecordWrite:
    """A record to write: the boundary P, the tokens after the full blocks before P, the engine's state at P."""

    parent_blocks: int
    position: int
    tokens: list[int]
    state: bytes


def records_of(boundaries: Sequence[tuple[int, bytes]], seq_ids: Sequence[int], kv_from: int,
               block_tokens: int) -> list[RecordWrite]:
    """The records a generation leaves: one per boundary state whose tokens after its full blocks it holds KV of."""
    out = []
    for position, state in boundaries:
        blocks = position // block_tokens
        if not state or not 0 < position <= len(seq_ids) or blocks * block_tokens < kv_from:
            continue
        out.append(RecordWrite(blocks, position, list(seq_ids[blocks * block_tokens:position]), state))
    return out
