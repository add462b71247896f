"""Every Redis key name kvstash uses, in one place (documented for operators in ops/KEYS.md).

    <ns>:blk:<model16>:<hash32hex>:{<ns>:sNN}   one encoded block (a single frame value)
    <ns>:tail:<model16>:<hash32hex>:{<ns>:sNN}  the tokens after the last full block of a computed
                                                sequence and their KV, under that block's hash
    <ns>:ids:<model16>:<digest32hex>:{<ns>:sNN} the token ids a pod generated for a reply's text
    <ns>:idx:lru:{<ns>:sNN}                     ZSET block key -> last access (ms since epoch)
    <ns>:idx:size:{<ns>:sNN}                    HASH block key -> bytes accounted for it
    <ns>:idx:bytes:{<ns>:sNN}                   STRING bytes accounted in shard NN
    <ns>:sess:<tenant>:<session_id>             HASH one session record

A block's shard NN comes from its hash, and the `{<ns>:sNN}` hash tag puts the block (or tail, or
reply ids: the budget accounts for all three alike) and its shard's three index keys in one cluster
slot, so a Lua script touching them runs on
Redis Cluster. Blocks spread over `index_shards` slots, so no single slot is the hot spot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachestore.errors import StoreError
from cachestore.hashing import HASH_BYTES, BlockHash

# The one definition of what a session id and a tenant may be: key validation, request validation, the
# pod's settings and its OpenAPI schema all use these.
SESSION_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"
SESSION_ID_RULE = "session ids are 1-128 characters of A-Z a-z 0-9 . _ -"
TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
_NAME_RE = re.compile(SESSION_ID_PATTERN)
_TENANT_RE = re.compile(TENANT_PATTERN)
TENANT_RE = _TENANT_RE
_MODEL_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
ENTRY_KINDS = ("blk", "tail", "ids")  # values the budget accounts for, all `<ns>:<kind>:<model16>:<hex>:{tag}`


class InvalidName(StoreError, ValueError):
    """A tenant, session id or model id is not a valid key component (HTTP 400)."""


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not _NAME_RE.match(session_id):
        raise InvalidName(SESSION_ID_RULE)
    return session_id


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
        raise InvalidName("tenant must match [A-Za-z0-9._-]{1,64}")
    return tenant


def check_model(model: str) -> str:
    if not isinstance(model, str) or not _MODEL_RE.match(model):
        raise InvalidName("model id must match [A-Za-z0-9._-]{1,64}")
    return model


@dataclass(frozen=True)
class ShardKeys:
    """The three index keys of one shard (same hash slot as its blocks)."""

    lru: str
    size: str
    bytes: str

    def all(self) -> list[str]:
        return [self.lru, self.size, self.bytes]


class KeySpace:
    """Key names of one namespace."""

    def __init__(self, namespace: str, shards: int) -> None:
        self.namespace = namespace
        self.shards = shards
        self._tags = [f"{{{namespace}:s{i:02d}}}" for i in range(shards)]
        self._shard_keys = [
            ShardKeys(f"{namespace}:idx:lru:{t}", f"{namespace}:idx:size:{t}", f"{namespace}:idx:bytes:{t}")
            for t in self._tags
        ]

    def shard_of(self, block_hash: BlockHash) -> int:
        if len(block_hash) != HASH_BYTES:
            raise InvalidName(f"a block hash has {HASH_BYTES} bytes, got {len(block_hash)}")
        return int.from_bytes(block_hash[:4], "big") % self.shards

    def block(self, model: str, block_hash: BlockHash, kind: str = "blk") -> tuple[int, str]:
        """(shard, key) of a block; `model` is ModelFingerprint.short(). `kind` "tail" names the tail
        after the block `block_hash` ends (or after the chain root), "ids" a reply's generated ids."""
        if kind not in ENTRY_KINDS:
            raise InvalidName(f"entry kind must be one of {', '.join(ENTRY_KINDS)}")
        shard = self.shard_of(block_hash)
        return shard, f"{self.namespace}:{kind}:{model}:{block_hash.hex()}:{self._tags[shard]}"

    def tail(self, model: str, parent: BlockHash) -> tuple[int, str]:
        return self.block(model, parent, "tail")

    def reply_ids(self, model: str, digest: BlockHash) -> tuple[int, str]:
        return self.block(model, digest, "ids")

    def shard(self, shard: int) -> ShardKeys:
        return self._shard_keys[shard]

    def all_shards(self) -> list[ShardKeys]:
        return list(self._shard_keys)

    def session(self, tenant: str, session_id: str) -> str:
        return f"{self.namespace}:sess:{check_tenant(tenant)}:{check_session_id(session_id)}"

    def session_pattern(self, tenant: str | None = None) -> str:
        if tenant is None:
            return f"{self.namespace}:sess:*"
        return f"{self.namespace}:sess:{check_tenant(tenant)}:*"

    def parse_session(self, key: str) -> tuple[str, str] | None:
        prefix = f"{self.namespace}:sess:"
        if not key.startswith(prefix):
            return None
        tenant, _, session_id = key[len(prefix):].partition(":")
        if not _TENANT_RE.match(tenant) or not _NAME_RE.match(session_id):
            return None
        return tenant, session_id

    def block_pattern(self) -> str:
        return f"{self.namespace}:blk:*"

    def entry_patterns(self) -> list[str]:
        """SCAN patterns of every value the budget accounts for: blocks, tails, reply ids."""
        return [f"{self.namespace}:{kind}:*" for kind in ENTRY_KINDS]
