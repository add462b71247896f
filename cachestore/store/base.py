"""What every part of the block store shares: its settings, clients, guard, key space, local tier and frame key."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis.asyncio.cluster
import redis.cluster

from cachestore.breaker import CircuitBreaker
from cachestore.errors import StoreError
from cachestore.eviction import POLICIES, now_ms
from cachestore.keys import KeySpace
from cachestore.localtier import LocalTier
from cachestore.redisclient import make_client
from cachestore.settings import StoreSettings
from cachestore.signing import TRAILER_SIZE, Signer
from cachestore.stats import Counters, StoreStats
from cachestore.store.guard import Failed, Guard
from cachestore.wire import landable

T = TypeVar("T")
NODE_READERS = 8  # threads reading a lookup's shares from a Cluster's nodes at once (besides the lookup's own)
REJECTED_KEYS = 4096  # keys remembered as holding a rejected value, so that the next write replaces it


class StoreBase:
    """The state the store's parts (reader, blocks, sessions) work on, and the plumbing they share."""

    def __init__(self, settings: StoreSettings, on_rejected: Callable[[str, str], None] | None = None,
                 clock_ms: Callable[[], int] = now_ms) -> None:
        """`on_rejected(reason, detail)` is told of each value read back that is discarded ("mac": not signed under
        its key name by an accepted frame key), beside the `rejected_mac` counter. `clock_ms`: the time the budget's
        scores are made of (a trace replay gives its own)."""
        self.settings = settings
        self.policy = POLICIES[settings.eviction_policy]
        self.clock_ms = clock_ms
        self.signer = Signer(settings.frame_key, settings.frame_key_previous) if settings.signed else None
        self._overhead = TRAILER_SIZE if self.signer is not None else 0  # bytes a value's signature adds
        self._on_rejected = on_rejected
        self._rejected: OrderedDict[str, None] = OrderedDict()  # keys whose value was rejected: rewritten, not NX
        self._rejected_lock = threading.Lock()
        self.keys = KeySpace(settings.namespace, settings.index_shards)
        self._client = make_client(settings)
        self._cluster = isinstance(self._client, redis.asyncio.cluster.RedisCluster)
        self._blocking: Any = None  # the reader threads' blocking client, made on first use (fetch_blocking)
        self._blocking_lock = threading.Lock()
        self._landable = False  # whether the blocking client can receive values into buffers
        self._by_node = False  # a Cluster client: values land per node, every node's share read at once
        self._node_readers: ThreadPoolExecutor | None = None
        self._chunk_readers: ThreadPoolExecutor | None = None
        self._counters = Counters()
        self._guard = Guard(CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s), self._counters)
        self._local = LocalTier(settings.local_tier_bytes) if settings.local_tier_bytes else None
        self._put_lock = asyncio.Lock()
        self._block_ttl_ms = settings.block_ttl_s * 1000
        self._index_ttl_ms = settings.index_ttl_ms
        self._session_ttl_ms = settings.session_ttl_s * 1000

    @property
    def client(self) -> Any:
        """The underlying redis.asyncio client (for admin tools and tests)."""
        return self._client

    @property
    def breaker_state(self) -> str:
        return self._guard.state

    def stats(self) -> StoreStats:
        return self._counters.snapshot(self._guard.state, self._guard.breaker.times_opened)

    async def ping(self) -> bool:
        result = await self._guard.run(self._client.ping, self.settings.op_timeout_s)
        return result is True

    async def close(self) -> None:
        await self._client.aclose()
        with self._blocking_lock:
            blocking, self._blocking = self._blocking, None
        if blocking is not None:
            await asyncio.to_thread(blocking.close)
        for readers in (self._chunk_readers, self._node_readers):
            if readers is not None:
                readers.shutdown(wait=False, cancel_futures=True)

    async def _admin(self, call: Callable[[], Awaitable[T]]) -> T:
        """An admin call: Redis trouble raises StoreError instead of being a miss."""
        result = await self._guard.run(call, self.settings.write_timeout_s)
        if isinstance(result, Failed):
            raise StoreError(f"Redis at {self.settings.masked_url} is unavailable (breaker {self.breaker_state})")
        return result

    def _blocking_client(self) -> Any:
        with self._blocking_lock:
            if self._blocking is None:
                self._blocking = make_client(self.settings, asynchronous=False)
                self._landable = landable(self._blocking)
                self._by_node = isinstance(self._blocking, redis.cluster.RedisCluster)
                if self._by_node:  # the chunk threads wait on the node threads, never the other way round
                    self._node_readers = ThreadPoolExecutor(NODE_READERS, thread_name_prefix="kvstash-node")
                    self._chunk_readers = ThreadPoolExecutor(NODE_READERS, thread_name_prefix="kvstash-chunk")
            return self._blocking

    # -- a frame key: values sealed on write, opened on read --------------------------------

    def _seal(self, key: str, value: bytes) -> bytes:
        return value if self.signer is None else self.signer.seal(key, value)

    def _reject(self, key: str, detail: str) -> None:
        with self._rejected_lock:  # the next write of this key replaces the value (a rotated-out key's, a forger's)
            self._rejected[key] = None
            self._rejected.move_to_end(key)
            while len(self._rejected) > REJECTED_KEYS:
                self._rejected.popitem(last=False)
        self._counters.add("rejected_mac")
        if self._on_rejected is not None:
            self._on_rejected("mac", f"{key}: {detail}")

    def _replaces(self, key: str) -> bool:
        """Whether a block write replaces what `key` holds: its value was rejected (signed by neither key, or
        moved or altered), and so was the rest of its chain, never read after it. Otherwise a present block is left
        as it is (the same KV, content-addressed)."""
        if not self._rejected:
            return False
        with self._rejected_lock:
            return self._rejected.pop(key, 0) is None
