"""Export a session (record plus its blocks) to a portable, versioned JSON file and import it elsewhere.

The file (UTF-8 JSON, one object):

    format        "kvstash-session"
    version       1
    exported_at   seconds since the epoch
    fingerprint   the ModelFingerprint fields (model_id, tokenizer_digest, dtype, num_layers, kv_heads,
                  head_dim, block_tokens, codec); its short() is the session's `model`
    session       tenant, session_id, model, version, created_at, updated_at (decimal text, as in Redis),
                  token_ids (list of ints), messages (list of objects), partial (base64 frame or "")
    blocks        base64 frames of the leading full blocks of token_ids, in order (a prefix: blocks
                  Redis no longer held are left out and will be recomputed)
    boundary      optional, a sliding-window or hybrid model's boundary record at the end of token_ids
                  (base64, `cachestore/boundary.py`), present when Redis held it and every block

Block keys are not in the file: they depend on the tenant's salt, which may differ between
deployments. Import recomputes them from the token ids under the target's chain root, so a file
can only ever place blocks on the chain of its own tokens. Every field is validated before
anything is written; every frame passes verify_frame and must have the fingerprint's shape.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from cachestore.boundary import BoundaryRecord, unpack_boundary
from cachestore.codec import verify_frame
from cachestore.codec.frame import FrameHeader
from cachestore.errors import CodecError, KvstashError, StoreError
from cachestore.hashing import BlockHash, ModelFingerprint, chain_hashes, root_hash
from cachestore.inspect import read_session
from cachestore.jsondepth import MAX_JSON_DEPTH, nesting_depth
from cachestore.keys import KeySpace
from cachestore.sessions import MAX_MESSAGES_BYTES, MAX_TOKENS, SessionRecord, to_fields
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore

FORMAT = "kvstash-session"
VERSION = 1
MAX_FILE_BYTES = 4 << 30
_TOP = {"format", "version", "exported_at", "fingerprint", "session", "blocks"}
_SESSION = {"tenant", "session_id", "model", "version", "created_at", "updated_at", "token_ids", "messages",
            "partial"}

RESTORE_SESSION = """
-- KEYS[1] the session hash
-- ARGV[1] 'replace' to overwrite an existing record, ARGV[2] ttl (ms), ARGV[3..] field, value pairs
-- returns 1 if written, 0 if the record exists and ARGV[1] is not 'replace'
if ARGV[1] ~= 'replace' and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[1])
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class TransferError(KvstashError):
    """A session file is malformed, or does not fit the target deployment."""


@dataclass(frozen=True)
class Chain:
    """Where one tenant's blocks of one model setup live: the fingerprint and the chain root."""

    fingerprint: ModelFingerprint
    root: BlockHash

    @classmethod
    def of(cls, fingerprint: ModelFingerprint, tenant_salt: bytes) -> Chain:
        return cls(fingerprint, root_hash(fingerprint, tenant_salt))

    @property
    def model_key(self) -> str:
        return self.fingerprint.short()

    def hashes(self, token_ids: list[int]) -> list[BlockHash]:
        return chain_hashes(token_ids, self.fingerprint.block_tokens, self.root)


@dataclass(frozen=True)
class SessionExport:
    fingerprint: ModelFingerprint
    record: SessionRecord
    blocks: list[bytes]  # frames of the leading full blocks, in order
    boundary: bytes = b""  # the boundary record at the end of the session's tokens (sliding-window, hybrid models)

    @property
    def full_blocks(self) -> int:
        return len(self.record.token_ids) // self.fingerprint.block_tokens


async def collect(client: Any, keys: KeySpace, tenant: str, session_id: str, chain: Chain) -> SessionExport | None:
    """The session and the longest present, valid prefix of its blocks; None if there is no such session."""
    record, raw, _ = await read_session(client, keys, tenant, session_id)
    if not raw:
        return None
    if record is None:
        raise StoreError(f"session {tenant}/{session_id} is malformed in Redis (run `kvstash admin verify`)")
    if record.model != chain.model_key:
        raise TransferError(f"session {tenant}/{session_id} belongs to model {record.model}; the given model "
                            f"settings give {chain.model_key} (check --model, --codec, --block-tokens)")
    frames: list[bytes] = []
    hashes = chain.hashes(record.token_ids)
    for start in range(0, len(hashes), 16):
        pipe = client.pipeline(transaction=False)
        for h in hashes[start:start + 16]:
            pipe.get(keys.block(chain.model_key, h)[1])
        for value in await pipe.execute():
            if not isinstance(value, bytes) or not _valid_block(value, chain.fingerprint):
                return SessionExport(chain.fingerprint, record, frames)
            frames.append(value)
    boundary = b""
    value = await client.get(keys.boundary(chain.model_key, hashes[-1] if hashes else chain.root)[1])
    if isinstance(value, bytes):
        try:
            _boundary_of(value, record.token_ids, chain.fingerprint)
            boundary = value
        except CodecError:
            pass  # left out: the importing side prefills from the last boundary it can rebuild
    return SessionExport(chain.fingerprint, record, frames, boundary)


def _boundary_of(value: bytes, tokens: list[int], fp: ModelFingerprint) -> BoundaryRecord:
    """The boundary record `value` holds, which must be at the end of `tokens`; CodecError otherwise."""
    record = unpack_boundary(value)
    full = len(tokens) // fp.block_tokens * fp.block_tokens
    if record.position != len(tokens) or record.token_ids != tokens[full:]:
        raise CodecError(f"a boundary record at {record.position}, not at the end of {len(tokens)} tokens")
    if record.frame:
        _check_frame(record.frame, fp, len(record.token_ids), "boundary")
    return record


def _valid_block(frame: bytes, fp: ModelFingerprint) -> bool:
    try:
        _check_frame(frame, fp, fp.block_tokens, "block")
    except CodecError:
        return False
    return True


def _check_frame(frame: bytes, fp: ModelFingerprint, tokens: int | None, what: str) -> FrameHeader:
    header = verify_frame(frame)
    if (header.layers, header.kv_heads, header.head_dim) != (fp.num_layers, fp.kv_heads, fp.head_dim):
        raise CodecError(f"{what} frame has layers/heads/dim {header.layers}/{header.kv_heads}/{header.head_dim}, "
                         f"the model has {fp.num_layers}/{fp.kv_heads}/{fp.head_dim}")
    if tokens is not None and header.tokens != tokens:
        raise CodecError(f"{what} frame holds {header.tokens} tokens, expected {tokens}")
    return header


def to_document(export: SessionExport, exported_at: float | None = None) -> bytes:
    r = export.record
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "exported_at": time.time() if exported_at is None else exported_at,
        "fingerprint": asdict(export.fingerprint),
        "session": {
            "tenant": r.tenant, "session_id": r.session_id, "model": r.model, "version": r.version,
            "created_at": repr(float(r.created_at)), "updated_at": repr(float(r.updated_at)),
            "token_ids": list(r.token_ids), "messages": r.messages,
            "partial": base64.b64encode(r.partial).decode("ascii"),
        },
        "blocks": [base64.b64encode(f).decode("ascii") for f in export.blocks],
    }
    if export.boundary:
        doc["boundary"] = base64.b64encode(export.boundary).decode("ascii")
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise TransferError(f"invalid session file: {message}")


def _b64(value: Any, what: str) -> bytes:
    _need(isinstance(value, str), f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TransferError(f"invalid session file: {what} is not valid base64") from exc


def _time(value: Any, what: str) -> float:
    _need(isinstance(value, str) and len(value) < 40, f"{what} must be a decimal string")
    try:
        number = float(value)
    except ValueError as exc:
        raise TransferError(f"invalid session file: {what} is not a number") from exc
    _need(math.isfinite(number) and number >= 0, f"{what} must be a finite, non-negative number")
    return number


def _fingerprint(value: Any) -> ModelFingerprint:
    names = {f.name: f.type for f in fields(ModelFingerprint)}
    _need(isinstance(value, dict) and set(value) == set(names), "fingerprint fields")
    for name, kind in names.items():
        want = int if kind in (int, "int") else str
        _need(type(value[name]) is want, f"fingerprint.{name} must be {want.__name__}")
        if want is str:
            _need(0 < len(value[name]) <= 256, f"fingerprint.{name} length")
        else:
            _need(0 < value[name] < 1 << 20, f"fingerprint.{name} range")
    try:
        return ModelFingerprint(**value)
    except KvstashError as exc:
        raise TransferError(f"invalid session file: {exc}") from exc


def parse_document(data: bytes, *, max_value_bytes: int = StoreSettings.max_value_bytes) -> SessionExport:
    """Validate a session file completely (it is untrusted input) and return what it holds."""
    _need(len(data) <= MAX_FILE_BYTES, f"larger than {MAX_FILE_BYTES} bytes")
    _need(nesting_depth(data) <= MAX_JSON_DEPTH, f"nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransferError(f"invalid session file: not JSON ({exc})") from exc
    _need(isinstance(doc, dict) and doc.get("format") == FORMAT, f"not a {FORMAT} file")
    _need(doc.get("version") == VERSION, f"unsupported version {doc.get('version')!r} (this reader knows {VERSION})")
    _need(_TOP <= set(doc) <= _TOP | {"boundary"}, f"top-level fields must be {sorted(_TOP)} (and boundary)")
    fp = _fingerprint(doc["fingerprint"])
    s = doc["session"]
    _need(isinstance(s, dict) and set(s) == _SESSION, f"session fields must be {sorted(_SESSION)}")
    tokens = s["token_ids"]
    _need(isinstance(tokens, list) and len(tokens) <= MAX_TOKENS, f"token_ids must be a list of <= {MAX_TOKENS}")
    _need(all(type(t) is int and 0 <= t < 1 << 32 for t in tokens), "token ids must be integers in [0, 2**32)")
    messages = s["messages"]
    _need(isinstance(messages, list) and all(isinstance(m, dict) for m in messages), "messages must be objects")
    _need(len(json.dumps(messages, ensure_ascii=False)) <= MAX_MESSAGES_BYTES, "messages too large")
    _need(type(s["version"]) is int and 1 <= s["version"] < 1 << 62, "session version must be a positive int")
    _need(s["model"] == fp.short(), "session.model does not match the fingerprint")
    try:
        record = SessionRecord(tenant=s["tenant"], session_id=s["session_id"], model=s["model"],
                               token_ids=tokens, messages=messages, partial=_b64(s["partial"], "partial"),
                               version=s["version"], created_at=_time(s["created_at"], "created_at"),
                               updated_at=_time(s["updated_at"], "updated_at"))
    except KvstashError as exc:
        raise TransferError(f"invalid session file: {exc}") from exc
    blocks = doc["blocks"]
    full = len(tokens) // fp.block_tokens
    _need(isinstance(blocks, list) and len(blocks) <= full, f"at most {full} blocks for {len(tokens)} tokens")
    frames = [_b64(b, f"block {i}") for i, b in enumerate(blocks)]
    try:
        for i, frame in enumerate(frames):
            _need(len(frame) <= max_value_bytes, f"block {i} exceeds max_value_bytes={max_value_bytes}")
            _check_frame(frame, fp, fp.block_tokens, f"block {i}")
        if record.partial:
            _need(len(record.partial) <= max_value_bytes, "partial block too large")
            header = _check_frame(record.partial, fp, None, "partial")
            _need(header.tokens <= len(tokens) - full * fp.block_tokens, "partial block covers too many tokens")
        boundary = _b64(doc.get("boundary", ""), "boundary")
        _need(len(boundary) <= max_value_bytes, "boundary record too large")
        if boundary:
            _need(len(frames) == full, "a boundary record needs every block before it")
            _boundary_of(boundary, tokens, fp)
    except CodecError as exc:
        raise TransferError(f"invalid session file: {exc}") from exc
    return SessionExport(fp, record, frames, boundary)


@dataclass(frozen=True)
class RestoreResult:
    blocks_written: int  # new blocks written (blocks already present are left as they are)
    blocks_present: int  # of the file's blocks, how many Redis holds after the import
    session_written: bool


async def restore(store: BlockStore, export: SessionExport, chain: Chain, *, replace: bool = False) -> RestoreResult:
    """Write the blocks (budget-accounted, under the target's chain) and then the session record as it was."""
    if chain.fingerprint != export.fingerprint:
        diff = [f.name for f in fields(ModelFingerprint)
                if getattr(chain.fingerprint, f.name) != getattr(export.fingerprint, f.name)]
        raise TransferError(f"the file's model fingerprint differs from the target's in {', '.join(diff)}")
    record = export.record
    key = store.keys.session(record.tenant, record.session_id)
    client = store.client
    if not replace and await client.exists(key):
        raise StoreError(f"session {record.tenant}/{record.session_id} already exists (use --replace)")
    hashes = chain.hashes(record.token_ids)[:len(export.blocks)]
    written = 0
    for start in range(0, len(hashes), 16):
        result = await store.store_blocks(chain.model_key, hashes[start:start + 16], export.blocks[start:start + 16],
                                          record.tenant, start,  # the session's tenant's: under its quota
                                          hashes[start - 1] if start else None)
        if result.unavailable:
            raise StoreError(f"Redis at {store.settings.masked_url} refused the block writes")
        written += result.value
    if export.boundary and len(hashes) == len(record.token_ids) // chain.fingerprint.block_tokens:
        parent = hashes[-1] if hashes else chain.root
        if not await store.put_entries([store.keys.boundary(chain.model_key, parent)], [export.boundary],
                                       record.tenant):
            raise StoreError(f"Redis at {store.settings.masked_url} refused the boundary record")
    present = 0
    if hashes:
        pipe = client.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(store.keys.block(chain.model_key, h)[1])
        present = sum(int(n) for n in await pipe.execute())
    pairs = ["version", str(record.version), "created_at", repr(float(record.created_at)),
             *to_fields(record, record.updated_at)]
    done = await client.eval(RESTORE_SESSION, 1, key, "replace" if replace else "",
                             store.settings.session_ttl_s * 1000, *pairs)
    if not int(done):
        raise StoreError(f"session {record.tenant}/{record.session_id} already exists (use --replace)")
    return RestoreResult(written, present, True)
