"""Session records: a Redis HASH per (tenant, session id), written with compare-and-set.

Fields (plain, readable in redis-cli / RedisInsight):

    format       "1"
    tenant, session_id, model
    n_tokens     decimal count of token ids
    token_ids    base64 of the token ids as little-endian uint32 (compact; n_tokens checks it)
    messages     the conversation as JSON (a list of objects)
    partial      the encoded KV frame of the tokens after the last full block (binary)
    version      decimal, +1 on every successful write
    created_at, updated_at   seconds since the epoch (decimal)
    mac          with a frame key only: the 36-byte trailer of cachestore.signing over the key name and the
                 fields above but version and created_at (FIELDS)
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass, field, replace
from typing import Any

from cachestore import jsondepth
from cachestore.errors import StoreError
from cachestore.keys import check_model, check_session_id, check_tenant

FORMAT = "1"
MAX_TOKENS = 1 << 20
MAX_MESSAGES_BYTES = 16 << 20

PUT_SESSION = """
-- KEYS[1] the session hash
-- ARGV[1] expected version ('' = the record must not exist yet), ARGV[2] ttl (ms),
-- ARGV[3] created_at to use when creating, ARGV[4..] field, value pairs (without version)
-- returns {new version, created_at}, or {-1, ''} if the compare-and-set lost
local current = redis.call('HGET', KEYS[1], 'version')
if ARGV[1] == '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return {-1, ''} end
elseif current ~= ARGV[1] then
  return {-1, ''}
end
local version = 1
if current then version = tonumber(current) + 1 end
local created = redis.call('HGET', KEYS[1], 'created_at') or ARGV[3]
redis.call('DEL', KEYS[1])
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'version', version, 'created_at', created, unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {version, created}
"""


@dataclass
class SessionRecord:
    """What a pod needs to resume a session: its tokens, conversation and partial block."""

    tenant: str
    session_id: str
    model: str
    token_ids: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    partial: bytes = b""
    version: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        check_session_id(self.session_id)
        check_model(self.model)

    def forked(self, session_id: str) -> SessionRecord:
        """A copy under a new id: same tokens and blocks, fresh version and timestamps."""
        return replace(self, session_id=check_session_id(session_id), version=0, created_at=0.0, updated_at=0.0)


def encode_tokens_b64(token_ids: list[int]) -> str:
    if len(token_ids) > MAX_TOKENS:
        raise StoreError(f"a session holds at most {MAX_TOKENS} tokens")
    try:
        return base64.b64encode(struct.pack(f"<{len(token_ids)}I", *token_ids)).decode("ascii")
    except struct.error as exc:
        raise StoreError("session token ids must be integers in [0, 2**32)") from exc


def to_fields(record: SessionRecord, now: float) -> list[Any]:
    """Field/value pairs for PUT_SESSION (version and created_at are set by the script)."""
    return [
        "format", FORMAT,
        "tenant", record.tenant,
        "session_id", record.session_id,
        "model", record.model,
        "n_tokens", str(len(record.token_ids)),
        "token_ids", encode_tokens_b64(record.token_ids),
        "messages", json.dumps(record.messages, ensure_ascii=False, separators=(",", ":")),
        "partial", bytes(record.partial),
        "updated_at", repr(float(now)),
    ]


FIELDS = ("format", "tenant", "session_id", "model", "n_tokens", "token_ids", "messages", "partial", "updated_at")
# the fields `to_fields` writes, in its order: what a frame key's `mac` field signs (version and created_at are the
# script's)


def _text(raw: dict[bytes, bytes], name: str) -> str:
    return raw[name.encode()].decode("utf-8")


def from_fields(raw: dict[Any, Any], tenant: str, session_id: str) -> SessionRecord | None:
    """Parse a session hash strictly; anything malformed gives None (the caller counts it)."""
    try:
        raw = {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in raw.items()}
        if _text(raw, "format") != FORMAT:
            return None
        if _text(raw, "tenant") != tenant or _text(raw, "session_id") != session_id:
            return None
        n_tokens = int(_text(raw, "n_tokens"))
        if not 0 <= n_tokens <= MAX_TOKENS:
            return None
        packed = base64.b64decode(raw[b"token_ids"], validate=True)
        if len(packed) != 4 * n_tokens:
            return None
        messages_raw = raw[b"messages"]
        if len(messages_raw) > MAX_MESSAGES_BYTES:
            return None
        messages = jsondepth.loads(messages_raw)  # too deep: a JSONDecodeError, a ValueError (malformed)
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        partial = raw[b"partial"]
        if not isinstance(partial, bytes):
            return None
        version = int(_text(raw, "version"))
        if version < 1:
            return None
        return SessionRecord(
            tenant=tenant,
            session_id=session_id,
            model=_text(raw, "model"),
            token_ids=list(struct.unpack(f"<{n_tokens}I", packed)),
            messages=messages,
            partial=partial,
            version=version,
            created_at=float(_text(raw, "created_at")),
            updated_at=float(_text(raw, "updated_at")),
        )
    except (KeyError, ValueError, UnicodeDecodeError, binascii.Error, struct.error, TypeError):
        return None
