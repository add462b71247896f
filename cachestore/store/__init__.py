"""BlockStore: blocks by chained prefix hash, tails and session records in Redis, async, never raising on Redis
trouble.

Its parts, one concern each: `guard` (the breaker, time bound and failure counters every call goes through),
`base` (settings, clients, frame key), `reads` and `cluster` (how a block read is put together, per node on a
Cluster), `reader` (block and entry reads), `blocks` (writes under the budget) and `sessions` (session records).
Block and session reads and writes answer with a `Result` (`cachestore.outcome`): what happened is a value.
"""

from __future__ import annotations

from cachestore.store.blocks import BlockWriter
from cachestore.store.reader import BlockReader
from cachestore.store.sessions import SessionStore

__all__ = ["BlockStore"]


class BlockStore(BlockReader, BlockWriter, SessionStore):
    """The Redis side of kvstash. Reads miss and writes drop on any Redis error; nothing raises.

    Only caller mistakes raise: a frame over max_value_bytes (ValueTooLarge), a malformed
    tenant / session id / model id (keys.InvalidName), mismatched argument lengths.
    Admin calls (usage, reconcile, list_sessions, clear_namespace) raise StoreError instead.
    """
