"""What the cache contributed to one request: a value every lookup returns and generation and write-back read.

The view itself never changes once a lookup returns it (a new value is made with `dataclasses.replace`). What does
change after it is made lives in objects of their own, each with one owner that the view only names: `ready`, the
rehydration still putting layers of `kv` in place (the engine's thread pulls them: service.engines.gate); `lease`,
the pooled buffers `kv` lies in (the pipeline releases it after generation: service.cache.placement); `early`, the
prompt's blocks the write-back queued while the reply was generated (only the write-back advances it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachestore.codec.arrays import Array
from service.cache.placement import Lease
from service.engines.gate import LayerGate


class EarlyWrites:
    """The prompt's blocks queued for writing while the reply was generated: blocks [held_blocks, blocks). Advanced
    by the write-back alone, on the event loop, and read by its final write-back (which skips them)."""

    def __init__(self) -> None:
        self.blocks = 0


@dataclass(frozen=True)
class CacheView:
    """What the cache contributed to one request."""

    kv: Array | None  # [layers, 2, kv_heads, cached_tokens, head_dim]
    cached_tokens: int
    hit_blocks: int  # leading full blocks found in Redis
    status: str  # "hit" | "partial" | "miss" | "bypass" | "recompute" (Redis held blocks; prefilling them was faster)
    fetched_bytes: int = 0
    salt: bytes | None = None  # the tenant's salt when the cache is writable: the prompt's blocks go early
    tenant: str | None = None  # whose entries the write-back stores (its quota applies); None: the namespace's
    stored_blocks: int = 0  # leading blocks known to be in Redis though not read (a recompute plan): not rewritten
    boundary: bytes | None = None  # a sliding-window or hybrid model's state at the end of `kv` (a boundary record)
    ready: LayerGate | None = None  # layers of `kv` still being dequantized: the engine waits per layer
    lease: Lease | None = None  # the pooled buffers `kv` (and `ready`'s source) read: back after generation
    early: EarlyWrites = field(default_factory=EarlyWrites, compare=False)

    @property
    def held_blocks(self) -> int:
        """Leading blocks Redis holds already (read, or known to be there): a write-back starts after them."""
        return max(self.hit_blocks, self.stored_blocks)

    @property
    def landing(self) -> Array | None:
        """The pooled buffer the frames were received into (the lease's), read by `ready`'s source; None: none."""
        return self.lease.landing if self.lease is not None else None

    def complete(self) -> Array | None:
        """`kv` with every layer in place (blocks the calling thread until then); engines wait on `ready`."""
        if self.ready is not None:
            self.ready.wait_all()
        return self.kv


def bypass() -> CacheView:
    """The view of a request the cache took no part in (no store, Redis failing or out of time)."""
    return CacheView(None, 0, 0, "bypass")
