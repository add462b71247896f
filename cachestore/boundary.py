"""Boundary records: what a sliding-window or hybrid model needs beside its full-attention blocks to resume at P.

A record sits at a *replayable boundary* P (the end of a prompt, the end of a reply) under the chain hash of the
full blocks before P, as a tail does. It holds the tokens after those blocks up to P (fewer than a block), their
full-attention KV as a frame (`cachestore.codec.frame`; none when P ends a block), and the engine's state at P that
blocks cannot rebuild: the sliding-window layers' KV of the last `n_swa` positions, the recurrent state. That state
is opaque here; the engine that reads it checks it against its own layout before it uses it. Untrusted when read
back: every length is checked before anything is allocated, and a checksum covers the whole value.

    offset  size  field
         0     4  magic            b"KVBD"
         4     1  version          1
         5     3  reserved         zero
         8     4  n_tokens         little-endian u32, fewer than a block (at most MAX_TOKENS)
        12     4  position         u32 P: the boundary (full blocks before it, then the n_tokens)
        16     4  frame_len        u32 bytes of the KV frame (0 when n_tokens is 0)
        20     4  state_len        u32 bytes of the engine's state (at least 1)
        24     8  checksum         xxh3_64 of bytes 0..23, the token ids, the frame and the state
        32  4*n   token ids        little-endian u32
         .     .  frame            the full-attention KV of those tokens
         .     .  state            the engine's window / recurrent state at P
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from cachestore.errors import CodecError

MAGIC = b"KVBD"
VERSION = 1
MAX_TOKENS = 1 << 16
MAX_POSITION = (1 << 31) - 1
_HEAD = struct.Struct("<4sB3xIIIIQ")  # magic, version, n_tokens, position, frame_len, state_len, checksum
_UNSUMMED = 24  # the header's bytes before its checksum


@dataclass(frozen=True)
class BoundaryRecord:
    """One record: the boundary P, the tokens after the last full block before it, their KV frame, the state."""

    position: int
    token_ids: list[int]
    frame: bytes
    state: bytes


def _checksum(head: bytes | memoryview, *parts: bytes | memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(head)
    for part in parts:
        digest.update(part)
    return int(digest.intdigest())


def pack_boundary(record: BoundaryRecord) -> bytes:
    n = len(record.token_ids)
    if n > MAX_TOKENS or not n <= record.position <= MAX_POSITION:
        raise CodecError(f"a boundary record of {n} tokens at position {record.position}")
    if bool(n) != bool(record.frame) or not record.state:
        raise CodecError("a boundary record holds a frame exactly when it holds tokens, and a state")
    ids = np.asarray(record.token_ids, dtype="<u4").tobytes()
    fields = (MAGIC, VERSION, n, record.position, len(record.frame), len(record.state))
    head = _HEAD.pack(*fields, 0)[:_UNSUMMED]
    checksum = _checksum(head, ids, record.frame, record.state)
    return _HEAD.pack(*fields, checksum) + ids + record.frame + record.state


def unpack_boundary(value: bytes | memoryview) -> BoundaryRecord:
    """The record a value holds; CodecError for anything else (every length checked first)."""
    if len(value) < _HEAD.size:
        raise CodecError("value shorter than a boundary record's header")
    magic, version, n, position, frame_len, state_len, checksum = _HEAD.unpack_from(value, 0)
    if magic != MAGIC:
        raise CodecError(f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CodecError(f"boundary record version {version}, this pod reads {VERSION}")
    if n > MAX_TOKENS or not n <= position <= MAX_POSITION or bool(n) != bool(frame_len) or not state_len:
        raise CodecError(f"a boundary record of {n} tokens at {position}, a {frame_len}-byte frame, "
                         f"a {state_len}-byte state")
    if _HEAD.size + 4 * n + frame_len + state_len != len(value):
        raise CodecError(f"a boundary record's fields do not add up to its {len(value)} bytes")
    view = memoryview(value)
    at_frame = _HEAD.size + 4 * n
    at_state = at_frame + frame_len
    ids, frame, state = view[_HEAD.size:at_frame], view[at_frame:at_state], view[at_state:]
    if _checksum(view[:_UNSUMMED], ids, frame, state) != checksum:
        raise CodecError("checksum mismatch")
    return BoundaryRecord(position, np.frombuffer(ids, dtype="<u4").astype(np.int64).tolist(), bytes(frame),
                          bytes(state))
