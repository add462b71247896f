"""What the cache contributed to one request: a value every lookup returns and generation and write-back read."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from cachestore.codec.arrays import Array
from service.engines.gate import LayerGate


@dataclass
class CacheView:
    """What the cache contributed to one request."""

    kv: Array | None  # [layers, 2, kv_heads, cached_tokens, head_dim]
    cached_tokens: int
    hit_blocks: int  # leading full blocks found in Redis
    status: str  # "hit" | "partial" | "miss" | "bypass" | "recompute" (Redis held blocks; prefilling them was faster)
    fetched_bytes: int = 0
    buffer: Array | None = None  # the pooled buffer `kv` is a view of; back to the pool after generation
    salt: bytes | None = None  # the tenant's salt when the cache is writable: the prompt's blocks go early
    tenant: str | None = None  # whose entries the write-back stores (its quota applies); None: the namespace's
    early_blocks: int = 0  # blocks [hit_blocks, early_blocks) were queued while the reply was generated
    stored_blocks: int = 0  # leading blocks known to be in Redis though not read (a recompute plan): not rewritten
    ready: LayerGate | None = None  # layers of `kv` still being dequantized: the engine waits per layer
    landing: Array | None = None  # the pooled buffer the frames were received into, read by `ready`'s work
    rehydrating: asyncio.Future[Any] | None = None  # the threads writing into `buffer` and `landing`, until done
    boundary: bytes | None = None  # a sliding-window or hybrid model's state at the end of `kv` (a boundary record)

    @property
    def held_blocks(self) -> int:
        """Leading blocks Redis holds already (read, or known to be there): a write-back starts after them."""
        return max(self.hit_blocks, self.stored_blocks)

    def complete(self) -> Array | None:
        """`kv` with every layer in place (blocks the calling thread until then); engines wait on `ready`."""
        if self.ready is not None:
            self.ready.wait_all()
        return self.kv


def bypass() -> CacheView:
    """The view of a request the cache took no part in (no store, Redis failing or out of time)."""
    return CacheView(None, 0, 0, "bypass")
