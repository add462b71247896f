"""Where a lookup's bytes go: the context a hit is dequantized into, and the landing its frames are received into.

Frames stored plainly (int8, fp16 and exact under lz4 or none) are received into one pooled buffer, one slot per
block (one copy on the wire, cachestore.wire); a layer-by-layer engine dequantizes them from there a layer at a
time (service.cache.rehydrate). Token-row frames for a context an engine lent (a llama.cpp sequence state) are received
straight into that state's rows instead: nothing is left to dequantize. What a hit takes from the pools comes back
through one `Lease`, released once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from cachestore.codec.arrays import Array, host_bytes
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.wire import Target
from service.engines import Engine
from service.runtime.contextpool import ContextPool, LandingPool

LANDING_ALIGN = 64  # each frame's slot in a lookup's landing starts on a cache line
# compressors under which frames are mostly stored plainly (lz4 gains nothing on quantized KV), so their length is
# known before they are read: they land in place (a frame of another length is read and decoded as before)
LANDING_COMPRESSORS = frozenset({"none", "lz4"})


class Placement:
    """The pod's pooled contexts and landings, and the slots a lookup's frames are received into."""

    def __init__(self, engine: Engine, codecs: BlockCodecs, block_tokens: int, max_tokens_limit: int,
                 signed: bool = False) -> None:
        """`signed`: every block comes from a signing store (its MAC covers the frame's checksum)."""
        geo = engine.geometry
        self.engine = engine
        self.signed = signed
        self.codecs = codecs
        self.block_tokens = block_tokens
        self.dtype = geo.dtype
        self._max_tokens_limit = max_tokens_limit
        self._max_context = geo.max_context
        self._contexts = ContextPool(geo.num_layers, geo.kv_heads, geo.head_dim, geo.dtype,
                                     max_idle=max(2, engine.parallel))
        # [layers, 2, kv_heads, block_tokens, head_dim]
        block_shape = (geo.num_layers, 2, geo.kv_heads, block_tokens, geo.head_dim)
        # block 0 may have its own codec
        self.slot_sizes = ((codecs.sink.plain_size(block_shape, geo.dtype), codecs.main.plain_size(block_shape,
                                                                                                  geo.dtype))
                           if codecs.main.spec.compressor in LANDING_COMPRESSORS else None)
        self._landings = LandingPool(geo.dtype, max_idle=max(2, engine.parallel))

    @property
    def block_bytes(self) -> int | None:
        """The length of a stored block (after block 0) when it is known before it is read."""
        return self.slot_sizes[1] if self.slot_sizes is not None else None

    def landing_for(self, blocks: int, out: Array | None = None
                    ) -> tuple[Array | None, Sequence[Target] | None]:
        """A pooled buffer the lookup's frames are received into, and each block's slot in it (64-byte aligned, at
        one stride after block 0, whose codec may differ); (None, None) when this pod's frames are compressed (their
        lengths vary). Token-row frames for a context the engine lent (`out`, a llama.cpp sequence state) land in it
        instead: (None, a `Scatter` per block, its header apart and its rows where the state holds them)."""
        if not blocks or self.slot_sizes is None:
            return None, None
        placed = self._rows_into(out, blocks) if out is not None else None
        if placed is not None:
            return None, placed
        sizes = [self.slot_sizes[0 if i == 0 else 1] for i in range(blocks)]
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end += -(-size // LANDING_ALIGN) * LANDING_ALIGN
        stage = self._landings.take(end)
        view = host_bytes(stage).data  # [bytes] uint8 (a view: the buffer is on the host)
        return stage, [view[at:at + size] for at, size in zip(offsets, sizes, strict=True)]

    def _rows_into(self, out: Array, blocks: int) -> Sequence[Target] | None:
        """Each block's target in the context `out` an engine lent (`Engine.landing_targets`), when this pod writes
        uncompressed-length token rows of its element type (`CodecSpec.rows`); else None."""
        codec = self.codecs.main
        if not codec.spec.rows or self.codecs.sink is not codec or out.dtype != self.dtype:
            return None
        targets = self.engine.landing_targets(out, blocks, self.block_tokens, checksummed=not self.signed)
        if targets is None:
            return None
        return targets if len(targets[0]) == self.block_bytes else None

    def release_landing(self, stage: Array) -> None:
        self._landings.give(stage)

    def context_for(self, prompt_ids: list[int]) -> Array:
        """Where a hit is dequantized: the engine's own context when it lends one (llama.cpp: a sequence state, set
        as it is), else a pooled [layers, 2, kv_heads, capacity, head_dim] buffer with room for the prompt and the
        longest reply, so generation appends in place (hfcache.GrowingLayer); pages never written are never
        touched."""
        lent = self.engine.context_for(len(prompt_ids) - 1)  # a hit fills at most the prompt but its last token
        if lent is not None:
            return lent
        return self._contexts.take(min(len(prompt_ids) + self._max_tokens_limit, self._max_context + 1))

    def give_context(self, buffer: Array) -> None:
        if not self.engine.give_context(buffer):
            self._contexts.give(buffer)


class Lease:
    """The pooled buffers one hit took: the context its KV lies in and the landing its frames were received into (None:
    none), given back to `placement` once they are released and the threads still writing into them (`writers`, the
    lookup's reader and rehydration) are done. Released once, by whoever holds the hit last: the pipeline after
    generation, or the lookup that gives up on it."""

    def __init__(self, placement: Placement, context: Array, landing: Array | None = None,
                 writers: Sequence[asyncio.Future[Any]] = ()) -> None:
        self.placement, self.context, self.landing = placement, context, landing
        self._writers = writers
        self._waiting = 0  # futures not done yet, once released
        self._released = False

    def release_after(self, work: asyncio.Future[Any] | None = None) -> None:
        """(On the event loop.) Give the buffers back once `work` (a generation reading them) and the writers are
        done, even if the request is cancelled meanwhile; a second release does nothing."""
        if self._released:
            return
        self._released = True
        pending = {f for f in (work, *self._writers) if f is not None and not f.done()}
        self._waiting = len(pending)
        if not pending:
            self._give()
        for future in pending:
            future.add_done_callback(self._one_done)

    def _one_done(self, _: asyncio.Future[Any]) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self._give()

    def _give(self) -> None:
        self.placement.give_context(self.context)
        if self.landing is not None:
            self.placement.release_landing(self.landing)
