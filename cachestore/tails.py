"""Tails and reply ids: the two small values that make every resent token a hit for stateless clients.

A *tail* holds the tokens after the last full block of a sequence a pod computed, with their KV, under
the chain hash of the full blocks before them. A *reply-ids* record holds the token ids a pod generated
for a reply, under a digest of the reply's text, so a client that sends the text back gets the very ids
(and so the cached KV) instead of a re-tokenization. Both are untrusted when read back: every length is
checked before anything is allocated, and a checksum covers the whole value.

    offset  size  field
         0     4  magic            b"KVTL" (tail) or b"KVID" (reply ids)
         4     1  version          1
         5     3  reserved         zero
         8     4  n_tokens         little-endian u32, at most MAX_TOKENS
        12     8  checksum         xxh3_64 of bytes 0..11, the token ids and the rest
        20  4*n   token ids        little-endian u32
         .     .  rest             tail: the KV frame of those tokens (cachestore.codec.frame); ids: nothing
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import xxhash

from cachestore.errors import CodecError
from cachestore.hashing import BlockHash

TAIL_MAGIC = b"KVTL"
IDS_MAGIC = b"KVID"
VERSION = 1
MAX_TOKENS = 1 << 16  # a tail is shorter than a block; a reply shorter than any context kvstash serves
_HEAD = struct.Struct("<4sB3xIQ")  # magic, version, n_tokens, checksum


def _checksum(head12: bytes, ids: bytes, rest: bytes | memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(head12)
    digest.update(ids)
    digest.update(rest)
    return int(digest.intdigest())


def _pack(magic: bytes, token_ids: list[int], rest: bytes) -> bytes:
    if len(token_ids) > MAX_TOKENS:
        raise CodecError(f"at most {MAX_TOKENS} token ids in a tail or reply record")
    ids = np.asarray(token_ids, dtype="<u4").tobytes()
    head12 = _HEAD.pack(magic, VERSION, len(token_ids), 0)[:12]
    return _HEAD.pack(magic, VERSION, len(token_ids), _checksum(head12, ids, rest)) + ids + rest


def _unpack(magic: bytes, value: bytes) -> tuple[list[int], memoryview]:
    if len(value) < _HEAD.size:
        raise CodecError("value shorter than its header")
    got_magic, version, n, checksum = _HEAD.unpack_from(value, 0)
    if got_magic != magic:
        raise CodecError(f"magic {got_magic!r}, expected {magic!r}")
    if version != VERSION:
        raise CodecError(f"version {version}, this pod reads {VERSION}")
    if n > MAX_TOKENS or _HEAD.size + 4 * n > len(value):
        raise CodecError(f"{n} token ids do not fit a value of {len(value)} bytes")
    view = memoryview(value)
    ids = view[_HEAD.size:_HEAD.size + 4 * n]
    rest = view[_HEAD.size + 4 * n:]
    if _checksum(bytes(view[:12]), bytes(ids), rest) != checksum:
        raise CodecError("checksum mismatch")
    return np.frombuffer(ids, dtype="<u4").astype(np.int64).tolist(), rest


def pack_tail(token_ids: list[int], frame: bytes) -> bytes:
    """A tail value: the tokens and the KV frame [layers, 2, kv_heads, len(token_ids), head_dim]."""
    if not token_ids or not frame:
        raise CodecError("a tail holds at least one token and its frame")
    return _pack(TAIL_MAGIC, token_ids, frame)


def unpack_tail(value: bytes) -> tuple[list[int], bytes]:
    """(token ids, KV frame) of a tail; CodecError for anything else."""
    ids, frame = _unpack(TAIL_MAGIC, value)
    if not ids or not frame:
        raise CodecError("an empty tail")
    return ids, bytes(frame)


def pack_ids(token_ids: list[int]) -> bytes:
    return _pack(IDS_MAGIC, token_ids, b"")


def unpack_ids(value: bytes) -> list[int]:
    ids, rest = _unpack(IDS_MAGIC, value)
    if len(rest):
        raise CodecError("bytes after the token ids of a reply record")
    return ids


def reply_digest(root: BlockHash, text: str) -> BlockHash:
    """Key of a reply's ids: the tenant's chain root (model, codec, block size, salt) and the exact text."""
    raw = text.encode("utf-8")
    h = hashlib.blake2b(digest_size=16, person=b"kvstash-reply-v1")
    h.update(bytes(root))
    h.update(struct.pack("<Q", len(raw)))
    h.update(raw)
    return BlockHash(h.digest())
