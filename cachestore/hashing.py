"""Deterministic chained prefix hashes of token blocks, and the model fingerprint.

Every hash is BLAKE2b over explicitly encoded bytes (token ids as little-endian
uint32, strings as UTF-8 with length prefixes), so the same tokens give the same
hash in every process, on every machine, under every PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NewType

import numpy as np

from cachestore.errors import ConfigError

HASH_BYTES = 16
BlockHash = NewType("BlockHash", bytes)

_ROOT_PERSON = b"kvstash-root-v1"
_BLOCK_PERSON = b"kvstash-blk-v1"
_FP_PERSON = b"kvstash-fp-v1"
_MAX_TOKEN_ID = 2**32 - 1


def _blake(person: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=person)
    for part in parts:
        h.update(part)
    return h.digest()


def _field(value: str | int) -> bytes:
    """Length-prefixed encoding, so ("ab", "c") and ("a", "bc") never collide."""
    raw = str(value).encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that makes a stored KV block valid for one model and codec only."""

    model_id: str  # weights digest or a declared revision
    tokenizer_digest: str
    dtype: str  # the model's compute dtype, e.g. "float32"
    num_layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    codec: str  # the codec spec, e.g. "int8+lz4/g64"

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "block_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"fingerprint field {name} must be positive")

    def digest(self) -> bytes:
        fields = asdict(self)
        return _blake(_FP_PERSON, *(_field(k) + _field(fields[k]) for k in sorted(fields)))

    def short(self) -> str:
        """A 16-hex-character id, readable in Redis key names."""
        return self.digest()[:8].hex()


def root_hash(fingerprint: ModelFingerprint, tenant_salt: bytes = b"") -> BlockHash:
    """The parent of a tenant's first block: no two models or tenants share a chain."""
    return BlockHash(_blake(_ROOT_PERSON, fingerprint.digest(), _field(len(tenant_salt)), tenant_salt))


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as fixed-width little-endian uint32 bytes; rejects ids out of range."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError("token ids must be a flat sequence")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray, block_tokens: int, root: BlockHash
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`; block i's hash covers blocks 0..i."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    raw = encode_tokens(token_ids)
    step = 4 * block_tokens
    hashes: list[BlockHash] = []
    parent = bytes(root)
    for start in range(0, len(raw) - step + 1, step):
        parent = _blake(_BLOCK_PERSON, parent, raw[start : start + step])
        hashes.append(BlockHash(parent))
    return hashes
