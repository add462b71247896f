"""Verify a namespace (frames, records, TTLs, the budget index) and repair it; purge a model; evict to a size."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from cachestore import budget
from cachestore.boundary import unpack_boundary
from cachestore.codec import verify_frame
from cachestore.errors import CodecError, RetiredFrame
from cachestore.inspect import BlockKey, Progress, classify, parse_block_key, scan_batches, text
from cachestore.keys import ENTRY_KINDS, INDEX_KEYS, KeySpace
from cachestore.sessions import FIELDS, from_fields
from cachestore.settings import StoreSettings, index_ttl_ms
from cachestore.signing import TRAILER_SIZE, Signer, signed_by
from cachestore.tails import unpack_ids, unpack_tail

# the largest frame verify accepts: far above any real block (SmolLM2: 64 tokens ~ 1.5 M elements)
VERIFY_MAX_ELEMENTS = 1 << 31
BLOCK_BATCH = 16  # blocks fetched per pipeline: bounds memory at 16 x max_value_bytes


@dataclass(frozen=True)
class Finding:
    """One problem `verify` found; `fixed` says whether --fix repaired it."""

    key: str
    problem: str  # corrupt_block | retired_block | unreachable_block | unindexed_block | bad_session | no_ttl
    #               | stale_index | dead_block (its chain is broken: a parent is gone, no lookup reaches it)
    #               | counter_drift | unknown_key | bad_signature (a frame key is set: signed by neither key,
    #               unsigned, or moved or altered) | signed_value (no frame key: verify cannot read it; never fixed)
    detail: str
    fixed: bool = False


@dataclass
class VerifyReport:
    keys_scanned: int = 0
    blocks_ok: int = 0
    sessions_ok: int = 0
    index_entries: int = 0
    signed_by: dict[str, int] = field(default_factory=dict)  # with a frame key: valid values by key (current, previous)
    findings: list[Finding] = field(default_factory=list)

    @property
    def problems(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for f in self.findings:
            counts[f.problem] += 1
        return dict(sorted(counts.items()))

    def as_dict(self) -> dict[str, Any]:
        return {"keys_scanned": self.keys_scanned, "blocks_ok": self.blocks_ok, "sessions_ok": self.sessions_ok,
                "index_entries": self.index_entries, "signed_by": dict(sorted(self.signed_by.items())),
                "problems": self.problems,
                "findings": [asdict(f) for f in self.findings]}


class _Verifier:
    def __init__(self, client: Any, keys: KeySpace, fix: bool, block_ttl_ms: int, session_ttl_ms: int,
                 signer: Signer | None = None) -> None:
        self.client, self.keys, self.fix, self.signer = client, keys, fix, signer
        self.block_ttl_ms, self.session_ttl_ms = block_ttl_ms, session_ttl_ms
        self.index_ttl_ms = index_ttl_ms(block_ttl_ms)
        self.report = VerifyReport()
        self.by_shard: dict[int, list[str]] = defaultdict(list)  # valid blocks, to check against the index
        self.dropped: dict[int, list[str]] = defaultdict(list)  # blocks deleted by --fix, to unindex
        self.shard_tags = {s.lru[s.lru.rfind("{"):] for s in keys.all_shards()}

    def found(self, key: str, problem: str, detail: str, fixed: bool = False) -> None:
        self.report.findings.append(Finding(key, problem, detail, fixed))

    async def run(self, progress: Progress | None) -> VerifyReport:
        async for batch in scan_batches(self.client, f"{self.keys.namespace}:*", progress, size=BLOCK_BATCH):
            self.report.keys_scanned += len(batch)
            kinds = {k: classify(self.keys, k) for k in batch}
            await self._blocks([k for k in batch if kinds[k] in ("block", "tail", "ids", "boundary")])
            await self._sessions([k for k in batch if kinds[k] == "session"])
            for key in (k for k in batch if kinds[k] in ("index", "other")):
                if kinds[key] == "other" or key[key.rfind("{"):] not in self.shard_tags:
                    self.found(key, "unknown_key", "not a key kvstash writes with these settings "
                                                   "(another --index-shards?); left alone")
        await self._index()
        await self._dead()
        return self.report

    async def _dead(self) -> None:
        """Blocks whose chain is broken (held, unreachable); --fix deletes them and drops their index entries."""
        dead = await budget.dead_entries(self.client, self.keys)
        for index, found in dead.keys_by_shard.items():
            for key in found:
                self.found(key, "dead_block", "a block before it in its chain is gone: no lookup reaches it",
                           self.fix)
            if self.fix:
                pipe = self.client.pipeline(transaction=False)
                for key in found:
                    pipe.execute_command("UNLINK", key)
                await pipe.execute()
                await self._repair_shard(index, [], found, False)

    async def _blocks(self, batch: list[str]) -> None:
        if not batch:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in batch:
            pipe.get(key)
            pipe.pttl(key)
        results = await pipe.execute()
        fixes = self.client.pipeline(transaction=False)
        for i, key in enumerate(batch):
            value, pttl = results[2 * i], int(results[2 * i + 1])
            if value is None:
                continue  # expired or evicted since SCAN saw it
            parsed = parse_block_key(self.keys, key)
            problem = self._signature_problem(key, value)
            if problem is None:
                problem = self._block_problem(parsed, self._body(value))
            if problem is not None:
                fixable = self.fix and problem[0] != "signed_value"
                self.found(key, problem[0], problem[1], fixable)
                if problem[0] == "signed_value":
                    continue
                if fixable:
                    fixes.execute_command("UNLINK", key)  # ClusterPipeline.unlink is a coroutine
                    if parsed is not None:
                        self.dropped[parsed.shard].append(key)
                continue
            assert parsed is not None
            self.report.blocks_ok += 1
            self.by_shard[parsed.shard].append(key)
            if pttl == -1:
                self.found(key, "no_ttl", "block without a TTL", self.fix)
                if self.fix:
                    fixes.pexpire(key, self.block_ttl_ms)
        if self.fix:
            await fixes.execute()

    def _signature_problem(self, key: str, value: bytes) -> tuple[str, str] | None:
        """Whether `value` is signed under `key` by the current or the previous frame key (counted in `signed_by`);
        without a key, whether it carries a signature at all (then verify cannot read it and leaves it alone)."""
        kid = signed_by(value)
        if self.signer is None:
            if kid is None or self._block_problem(parse_block_key(self.keys, key), value) is None:
                return None  # unsigned (or an unsigned value that happens to end like a trailer)
            return "signed_value", f"signed (key id {kid.hex()}): set KVSTASH_FRAME_KEY to verify it; left alone"
        return self._check_signature(key, kid, self.signer.open(key, value) is not None)

    def _check_signature(self, key: str, kid: bytes | None, ok: bool) -> tuple[str, str] | None:
        assert self.signer is not None
        if ok:
            which = "current" if kid == self.signer.key_id else "previous"
            self.report.signed_by[which] = self.report.signed_by.get(which, 0) + 1
            return None
        if kid is None:
            return "bad_signature", "not signed (no MAC trailer): a pod with the frame key treats it as a miss"
        if not self.signer.accepts(kid):
            return "bad_signature", f"signed by key id {kid.hex()}, neither the current nor the previous frame key"
        return "bad_signature", (f"its MAC under key id {kid.hex()} does not verify for {key}: moved from another "
                                 "key or altered")

    def _body(self, value: bytes) -> bytes:
        return value if self.signer is None else value[:-TRAILER_SIZE]

    @staticmethod
    def _block_problem(parsed: BlockKey | None, value: bytes) -> tuple[str, str] | None:
        if parsed is None:
            return "unreachable_block", "malformed block key name"
        if not parsed.reachable:
            return "unreachable_block", f"hash tag does not match shard {parsed.shard} of its hash"
        try:
            if parsed.kind == "tail":
                verify_frame(unpack_tail(value)[1], max_elements=VERIFY_MAX_ELEMENTS)
            elif parsed.kind == "ids":
                unpack_ids(value)
            elif parsed.kind == "bnd":
                frame = unpack_boundary(value).frame
                if frame:
                    verify_frame(frame, max_elements=VERIFY_MAX_ELEMENTS)
            else:
                verify_frame(value, max_elements=VERIFY_MAX_ELEMENTS)
        except CodecError as exc:  # a retired format (an older release wrote it) is no sign of damage: named apart
            what = "retired" if isinstance(exc, RetiredFrame) else "corrupt"
            return f"{what}_{'block' if parsed.kind == 'blk' else parsed.kind}", str(exc)
        return None

    async def _sessions(self, batch: list[str]) -> None:
        if not batch:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in batch:
            pipe.hgetall(key)
            pipe.pttl(key)
        results = await pipe.execute()
        fixes = self.client.pipeline(transaction=False)
        for i, key in enumerate(batch):
            raw, pttl = results[2 * i], int(results[2 * i + 1])
            if not raw:
                continue
            problem = self._session_signature(key, raw) or self._session_problem(key, raw)
            if problem is not None:
                self.found(key, "bad_signature" if problem.startswith("signature:") else "bad_session",
                           problem.removeprefix("signature: "), self.fix)
                if self.fix:
                    fixes.execute_command("UNLINK", key)  # ClusterPipeline.unlink is a coroutine
                continue
            self.report.sessions_ok += 1
            if pttl == -1:
                self.found(key, "no_ttl", "session without a TTL", self.fix)
                if self.fix:
                    fixes.pexpire(key, self.session_ttl_ms)
        if self.fix:
            await fixes.execute()

    def _session_signature(self, key: str, raw: dict[Any, Any]) -> str | None:
        if self.signer is None:
            return None
        named = {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in raw.items()}
        trailer = named.get(b"mac")
        kid = signed_by(trailer) if trailer is not None else None
        problem = self._check_signature(key, kid, self.signer.open_fields(key, named, FIELDS))
        return None if problem is None else "signature: " + problem[1].replace("no MAC trailer", "no mac field")

    def _session_problem(self, key: str, raw: dict[Any, Any]) -> str | None:
        parsed = self.keys.parse_session(key)
        if parsed is None:
            return "malformed session key name"
        record = from_fields(raw, *parsed)
        if record is None:
            return "record fails validation (fields missing, malformed or inconsistent)"
        if record.partial:
            try:
                verify_frame(record.partial, max_elements=VERIFY_MAX_ELEMENTS)
            except CodecError as exc:
                return f"partial block: {exc}"
        return None

    async def _index(self) -> None:
        """Valid blocks missing from their shard's index; index entries whose block is gone; counter drift."""
        for index, shard in enumerate(self.keys.all_shards()):
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(shard.size)
            pipe.zrange(shard.lru, 0, -1)
            pipe.get(shard.bytes)
            sizes_raw, lru_raw, counter = await pipe.execute()
            sizes = {text(k): int(v) for k, v in (sizes_raw or {}).items()}
            members = set(sizes) | {text(m) for m in lru_raw or []}
            self.report.index_entries += len(members)
            unindexed = [k for k in self.by_shard.get(index, []) if k not in sizes]
            for key in unindexed:
                self.found(key, "unindexed_block", "block not in the budget index (its bytes are not "
                                                   "accounted, LRU eviction cannot see it)", self.fix)
            candidates = sorted(members)
            exists: list[Any] = []
            if candidates:
                pipe = self.client.pipeline(transaction=False)
                for key in candidates:
                    pipe.exists(key)
                exists = await pipe.execute()
            stale = [k for k, e in zip(candidates, exists, strict=True) if not int(e)]
            for key in stale:
                if key not in self.dropped.get(index, []):
                    self.found(key, "stale_index", f"indexed in {shard.size} but the block is gone", self.fix)
            gone_now = set(stale)
            live = sum(v for k, v in sizes.items() if k not in gone_now)
            drift = int(counter or 0) - live
            if drift and not stale:
                self.found(shard.bytes, "counter_drift", f"counter says {int(counter or 0)} bytes, "
                                                         f"the index holds {live}", self.fix)
            if self.fix:
                await self._repair_shard(index, unindexed, stale + self.dropped.get(index, []), bool(drift))

    async def _repair_shard(self, index: int, unindexed: list[str], gone: list[str], recount: bool) -> None:
        shard = self.keys.shard(index)
        for i in range(0, len(unindexed), 256):
            chunk = unindexed[i:i + 256]
            await budget.adopt(self.client, shard, chunk, self.index_ttl_ms)
        gone = sorted(set(gone))
        if gone or recount:
            for i in range(0, max(len(gone), 1), 256):
                chunk = gone[i:i + 256]
                last = i + 256 >= len(gone)
                await self.client.eval(budget.CHECK, INDEX_KEYS + len(chunk), *shard.all(), *chunk,
                                       "1" if last else "0", self.index_ttl_ms)


async def verify(client: Any, keys: KeySpace, *, fix: bool = False,
                 block_ttl_ms: int = StoreSettings.block_ttl_s * 1000,
                 session_ttl_ms: int = StoreSettings.session_ttl_s * 1000,
                 progress: Progress | None = None, signer: Signer | None = None) -> VerifyReport:
    """Check every key of the namespace; with `fix`, delete corrupt or unreachable blocks and bad
    session records, give TTL-less keys their TTL, adopt unindexed blocks into the budget index,
    drop stale index entries and recount the shard counters. With `signer` (the pods' frame keys), every value
    must be signed under its key by the current or the previous key; the others are `bad_signature` (a pod would
    treat them as misses; --fix deletes them). Without one, signed values are reported and left alone."""
    return await _Verifier(client, keys, fix, block_ttl_ms, session_ttl_ms, signer).run(progress)



@dataclass(frozen=True)
class PurgeResult:
    blocks: int
    block_bytes: int
    sessions: int


async def _entry_batches(client: Any, keys: KeySpace, model: str, progress: Progress | None) -> Any:
    for kind in ENTRY_KINDS:
        async for batch in scan_batches(client, f"{keys.namespace}:{kind}:{model}:*", progress):
            yield batch


async def purge_model(client: Any, keys: KeySpace, model: str, progress: Progress | None = None,
                      block_ttl_ms: int = StoreSettings.block_ttl_s * 1000) -> PurgeResult:
    """Delete every block, tail, reply record and session record of one model fingerprint
    (ModelFingerprint.short())."""
    blocks = freed = 0
    async for batch in _entry_batches(client, keys, model, progress):
        by_shard: dict[int, list[str]] = defaultdict(list)
        pipe = client.pipeline(transaction=False)
        for key in batch:
            parsed = parse_block_key(keys, key)
            if parsed is not None and parsed.model == model:
                pipe.execute_command("UNLINK", key)
                by_shard[parsed.shard].append(key)
        blocks += sum(int(n) for n in await pipe.execute())
        for index, gone in by_shard.items():  # CHECK drops the entries of the blocks just unlinked
            _, stale, _ = await client.eval(budget.CHECK, INDEX_KEYS + len(gone), *keys.shard(index).all(), *gone,
                                            "0", index_ttl_ms(block_ttl_ms))
            freed += int(stale)
    sessions = 0
    async for batch in scan_batches(client, keys.session_pattern(), progress):
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.hget(key, "model")
        owned = [k for k, m in zip(batch, await pipe.execute(), strict=True) if m is not None and text(m) == model]
        if owned:
            pipe = client.pipeline(transaction=False)
            for key in owned:
                pipe.execute_command("UNLINK", key)
            sessions += sum(int(n) for n in await pipe.execute())
    return PurgeResult(blocks, freed, sessions)


async def evict_to(client: Any, keys: KeySpace, target_bytes: int,
                   reap_dead: bool = True) -> tuple[int, budget.EvictionResult, int]:
    """Evict the lowest-scored blocks (the eviction policy's order) until the namespace holds at most `target_bytes`;
    `reap_dead` (a chained policy's, as the pods evict): the blocks written on an evicted one go with it.

    Returns (bytes held before, what was evicted, bytes held after), as the budget index counts them."""
    before = sum(await budget.shard_totals(client, keys))
    result = await budget.evict(client, keys, before - target_bytes, max_rounds=20, reap_dead=reap_dead) \
        if before > target_bytes else budget.EvictionResult()
    after = sum(await budget.shard_totals(client, keys))
    return before, result, after
