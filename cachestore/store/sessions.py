"""Session records in Redis: read (sliding their TTL), compare-and-set writes, delete, fork, and listing by SCAN."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from cachestore.outcome import Outcome, Result
from cachestore.sessions import FIELDS, PUT_SESSION, SessionRecord, from_fields, to_fields
from cachestore.store.base import StoreBase
from cachestore.store.guard import Failed


class SessionStore(StoreBase):
    """The session side of the store."""

    async def read_session(self, tenant: str, session_id: str) -> Result[SessionRecord | None]:
        """The record (FOUND), none (ABSENT: also a garbage record, which is dropped) or UNAVAILABLE."""
        key = self.keys.session(tenant, session_id)

        async def read() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.pexpire(key, self._session_ttl_ms)
            self._counters.add("round_trips")
            return (await pipe.execute())[0]

        raw = await self._guard.run(read, self.settings.op_timeout_s)
        if isinstance(raw, Failed):
            return Result(Outcome.UNAVAILABLE, None)
        if not raw:
            return Result(Outcome.ABSENT, None)
        if self.signer is not None:
            named = {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in raw.items()}
            if not self.signer.open_fields(key, named, FIELDS):
                self._reject(key, "a session record not signed under its key by an accepted frame key")
                return Result(Outcome.ABSENT, None)
        record = from_fields(raw, tenant, session_id)
        if record is None:
            self._counters.add("bad_records")
            fmt = raw.get(b"format", b"1")
            if fmt == b"1" or not fmt.isdigit():  # garbage, not a newer format: drop it so the id heals
                await self._guard.run(lambda: self._client.delete(key), self.settings.op_timeout_s)
            return Result(Outcome.ABSENT, None)
        return Result(Outcome.FOUND, record)

    async def write_session(
        self, record: SessionRecord, expected_version: int | None
    ) -> Result[SessionRecord | None]:
        """Compare-and-set (`expected_version` None: create only if absent): STORED (the record as stored),
        CONFLICT (another writer won, or the id is taken) or UNAVAILABLE (Redis failed: `dropped_writes` counts
        it)."""
        key = self.keys.session(record.tenant, record.session_id)
        now = time.time()
        expected = "" if expected_version is None else str(int(expected_version))
        fields = to_fields(record, now)
        if self.signer is not None:
            fields += ["mac", self.signer.seal_fields(key, fields)]

        async def write() -> Any:
            self._counters.add("round_trips")
            return await self._client.eval(PUT_SESSION, 1, key, expected, self._session_ttl_ms, repr(now), *fields)

        result = await self._guard.run(write, self.settings.op_timeout_s, write=True)
        if isinstance(result, Failed):
            return Result(Outcome.UNAVAILABLE, None)
        version, created = int(result[0]), result[1]
        if version < 0:
            self._counters.add("cas_conflicts")
            return Result(Outcome.CONFLICT, None)
        return Result(Outcome.STORED, replace(record, version=version, created_at=float(created), updated_at=now))

    async def delete_session(self, tenant: str, session_id: str) -> bool:
        key = self.keys.session(tenant, session_id)
        result = await self._guard.run(lambda: self._client.delete(key), self.settings.op_timeout_s)
        return not isinstance(result, Failed) and int(result) > 0

    async def fork_session(self, tenant: str, src_id: str, dst_id: str) -> Result[SessionRecord | None]:
        """A new session sharing the parent's blocks; only the record is copied. STORED (the new record), ABSENT
        (no parent), CONFLICT (the new id is taken) or UNAVAILABLE."""
        parent = await self.read_session(tenant, src_id)
        if parent.value is None:
            return parent
        return await self.write_session(parent.value.forked(dst_id), expected_version=None)

    async def list_sessions(self, tenant: str | None = None, limit: int = 10_000) -> list[tuple[str, str]]:
        """(tenant, session id) pairs found by SCAN, sorted; at most `limit` of them."""
        pattern = self.keys.session_pattern(tenant)

        async def scan() -> list[tuple[str, str]]:
            found: set[tuple[str, str]] = set()
            async for raw in self._client.scan_iter(match=pattern, count=1000):
                parsed = self.keys.parse_session(raw.decode() if isinstance(raw, bytes) else str(raw))
                if parsed is not None:
                    found.add(parsed)
                if len(found) >= limit:
                    break
            return sorted(found)

        return await self._admin(scan)
