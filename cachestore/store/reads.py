"""How a block read is put together: its keys and commands, the frames the local tier holds, where each reply lands,
what came back (opened under a frame key), and the counters a lookup moves."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from cachestore import budget
from cachestore.hashing import BlockHash
from cachestore.keys import check_model
from cachestore.outcome import Outcome, Result
from cachestore.signing import TRAILER_SIZE
from cachestore.store.base import StoreBase
from cachestore.store.guard import Failed
from cachestore.wire import Scatter, Target

F = TypeVar("F", bytes, bytes | memoryview | Scatter)
Keyed = list[tuple[int, str]]  # (index shard, key name) of each block


def _land(frame: bytes, target: Target) -> bytes | Target:
    """A frame from the local tier, in its lookup buffer when it fits (as if it had landed there)."""
    if len(frame) != len(target):
        return frame
    if isinstance(target, Scatter):
        target.fill(frame)
    else:
        target[:] = frame
    return target


class Sealed(Scatter):
    """Where a signed value lands: its body in the caller's buffer (or `Scatter`) as if unsigned, its trailer in a
    buffer of its own. The caller's Scatter's own `filled`, if it has one, sees each piece of the body as it lands;
    once the trailer has landed (the last piece), the value is checked there and then (`verdict`), while its body is
    still in the cache and the values after it are still on the wire."""

    __slots__ = ("target", "trailer", "verdict")

    def __init__(self, target: Target, check: Callable[[Sequence[memoryview], memoryview], bool]) -> None:
        self.target = target
        self.trailer = trailer = memoryview(bytearray(TRAILER_SIZE))
        self.verdict: bool | None = None  # None until the trailer lands
        inner = target.pieces if isinstance(target, Scatter) else [target]
        reported = target.filled if isinstance(target, Scatter) else None

        def filled(piece: memoryview) -> None:
            if piece is trailer:
                self.verdict = check(self.body, trailer)
            elif reported is not None:
                reported(piece)

        super().__init__([*inner, trailer], filled)

    @property
    def reports_pieces(self) -> bool:
        """As its body's target: a signed value is received as it would be unsigned (its trailer reported alone)."""
        return isinstance(self.target, Scatter) and self.target.reports_pieces

    @property
    def body(self) -> list[memoryview]:
        return self.pieces[:-1]


class ReadParts(StoreBase):
    """The pieces every block read (async, blocking, chunked, per Cluster node) is made of."""

    def _queue_fetch(self, pipe: Any, keyed: Keyed, start: int, count: bool = True) -> None:
        """One round trip: slide the TTL of what is held locally, GETEX the rest, touch their LRU index (a node's
        share of a Cluster read is not a round trip of its own: `count=False`)."""
        for _, key in keyed[:start]:
            pipe.pexpire(key, self._block_ttl_ms)  # held locally: only slide the TTL
        for _, key in keyed[start:]:
            pipe.getex(key, px=self._block_ttl_ms)
        if self.settings.budget_enabled:
            self._touch(pipe, keyed)
        if count:
            self._counters.add("round_trips")

    def _touch(self, pipe: Any, keyed: Keyed) -> None:
        """Queue the budget's touch of `keyed`'s entries, one script call per index shard, all at one time (a chain
        spread over shards keeps its order)."""
        by_shard: dict[int, list[str]] = defaultdict(list)
        for shard, key in keyed:
            by_shard[shard].append(key)
        now = self.clock_ms()
        for shard, keys in by_shard.items():
            budget.touch(pipe, self.keys.shard(shard), keys, self._index_ttl_ms, self.policy, now)

    def _fetch_pipeline(self, client: Any, keyed: Keyed, start: int) -> Any:
        pipe = client.pipeline(transaction=False)
        self._queue_fetch(pipe, keyed, start)
        return pipe

    def _landing_request(
        self, pipe: Any, keyed: Keyed, start: int, into: Sequence[Target],
    ) -> tuple[list[tuple[Any, ...]], list[Target | None]]:
        """The queued commands and a buffer per reply: none for the PEXPIREs of locally held frames (they come
        first), then the GETEXs' buffers (with room for the trailer after each, under a frame key)."""
        targets: list[Target | None] = [None] * start
        if self.signer is None:
            targets += into[start:len(keyed)]
        else:
            targets += [Sealed(t, partial(self.signer.check, key)) for t, (_, key) in zip(into[start:len(keyed)],
                                                                                         keyed[start:], strict=False)]
        return [a for a, _ in pipe.command_stack], targets

    def _begin_fetch(self, model: str, hashes: Sequence[BlockHash]) -> tuple[Keyed, list[bytes]]:
        """The keys of `hashes`, and the frames of their longest prefix the local tier holds."""
        check_model(model)
        keyed = [self.keys.block(model, h) for h in hashes]
        frames: list[bytes] = []
        if not keyed:
            return keyed, frames
        if self._local is not None:
            for _, key in keyed:
                frame = self._local.get(key)
                if frame is None:
                    break
                frames.append(frame)
        self._counters.add_all(lookups=1, local_hits=len(frames))
        return keyed, frames

    def _begin_landing(
        self, model: str, hashes: Sequence[BlockHash], into: Sequence[Target] | None,
    ) -> tuple[Keyed, list[bytes | Target]]:
        """`_begin_fetch`, the local frames copied into their buffers when `into` gives them (as if they had landed)."""
        keyed, frames = self._begin_fetch(model, hashes)
        if into is None:
            return keyed, list(frames)
        return keyed, [_land(frame, target) for frame, target in zip(frames, into, strict=False)]

    def _end_fetch(self, keyed: Keyed, frames: list[F], remote: list[F] | Failed) -> Result[list[F]]:
        """The local frames followed by those Redis returned (`remote`), counted."""
        if not keyed:
            return Result(Outcome.ABSENT, [])
        failed = isinstance(remote, Failed)
        if not isinstance(remote, Failed):
            frames.extend(self._opened(keyed[len(frames):], remote))
        found, wanted = len(frames), len(keyed)
        kind = "misses" if found == 0 else "partial_hits" if found < wanted else "hits"
        self._counters.add_all(**{kind: 1}, blocks_read=found, bytes_read=sum(len(f) for f in frames))
        if frames:
            return Result(Outcome.FOUND, frames)
        return Result(Outcome.UNAVAILABLE if failed else Outcome.ABSENT, frames)

    def _fetched(self, keyed: Keyed, start: int, results: list[Any]) -> list[Any]:
        """The values of the longest answered prefix of `results` (past the locally held ones' replies), its
        touches' stale entries counted."""
        found: list[Any] = []
        errors = 0
        for value in results[start:len(keyed)]:
            if not isinstance(value, bytes | memoryview | Scatter) or not value:
                errors = int(isinstance(value, Exception))
                break
            found.append(value)
        stale = sum(1 for r in results[len(keyed):] if isinstance(r, int) and r > 0)
        self._counters.add_all(errors=errors, stale_removed=stale)
        return found

    def _opened(self, keyed: Sequence[tuple[int, str]], values: list[Any]) -> list[Any]:
        """The bodies of `values` (read under `keyed`) up to the first that is not signed under its key with an
        accepted frame key (all of them when the store has none); each is kept by the local tier."""
        found: list[Any] = []
        for (_, key), value in zip(keyed, values, strict=False):
            body = self._open_value(key, value)
            if body is None:
                break
            found.append(body)
            if self._local is not None:  # a landed frame's buffer is reused later: the local tier keeps a copy
                self._local.put(key, body if isinstance(body, bytes) else body.tobytes())
        return found

    def _open_value(self, key: str, value: Any) -> Any:
        """A value's body, as it would have been stored without a frame key (a landed one: the caller's target), or
        None (counted) when its signature does not verify."""
        if self.signer is None:
            return value
        if isinstance(value, Sealed):
            verdict = value.verdict
            if verdict is None:  # not reported as it landed
                verdict = self.signer.check(key, value.body, value.trailer)
            if verdict:
                return value.target
        elif isinstance(value, bytes | memoryview):
            body = self.signer.open(key, value)
            if body is not None:
                return body
        self._reject(key, "not signed under its key by an accepted frame key")
        return None
