"""Lookup reads blocks in pipelined chunks and decodes them into one context: exact, truncated at holes."""

from __future__ import annotations

import torch

from cachestore.codec import Codec
from cachestore.store import BlockStore
from cachestore.tails import unpack_tail
from ops.redisproc import RedisProcess
from service.app import store_settings
from service.cache import lookup as lookup_module
from service.cache.pipeline import Pipeline
from service.cache.writer import BackgroundWriter
from service.engines import GenParams
from service.engines.generation import GenRequest
from service.engines.hf.engine import HfEngine
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings

SALT = b"chunks"


async def test_chunked_lookup_rebuilds_the_context_and_stops_at_a_corrupt_block(
    kv_server: RedisProcess, tiny_model: object
) -> None:
    b = 4
    settings = PodSettings(redis_url=kv_server.url, namespace="chunks", codec="exact", block_tokens=b,
                           local_tier_bytes=0)
    store = BlockStore(store_settings(settings))
    runner = HfEngine(tiny_model)  # type: ignore[arg-type]
    pipe = Pipeline(settings, runner, store, Codec("exact"), PodMetrics(), None)
    try:
        prompt = list(range(100, 100 + 20 * b + 2))  # 20 full blocks usable: 3 chunks of 8, 8, 4
        assert lookup_module.FETCH_CHUNK_BLOCKS < 20
        kv = runner.generate(GenRequest(prompt, None, GenParams(max_tokens=1))).kv  # [L, 2, H, T, D]
        hashes = pipe.hashes(SALT, prompt[:-1])
        frames = [Codec("exact").encode(kv[:, :, :, i * b:(i + 1) * b]) for i in range(len(hashes))]
        assert (await store.store_blocks(pipe.model_key, hashes, frames)).value == 20

        view, _ = await pipe.lookup(SALT, prompt)
        assert (view.status, view.cached_tokens, view.hit_blocks) == ("hit", 20 * b, 20)
        assert view.kv is not None and torch.equal(view.complete(), kv[:, :, :, :20 * b])
        assert view.fetched_bytes == sum(map(len, frames))

        # a corrupt block in the second chunk truncates the hit there
        key = store.keys.block(pipe.model_key, hashes[11])[1]
        await store.client.set(key, frames[11][:-1] + bytes([frames[11][-1] ^ 1]))
        view, _ = await pipe.lookup(SALT, prompt)
        assert (view.status, view.cached_tokens) == ("partial", 11 * b)
        assert view.kv is not None and torch.equal(view.complete(), kv[:, :, :, :11 * b])

        # a hole in the third chunk: the first two chunks still count
        await store.client.delete(store.keys.block(pipe.model_key, hashes[17])[1])
        await store.client.set(key, frames[11])
        view, _ = await pipe.lookup(SALT, prompt)
        assert view.cached_tokens == 17 * b
        gen = runner.generate(GenRequest(prompt, view.kv, GenParams(max_tokens=3), kv_ready=view.ready))
        plain = runner.generate(GenRequest(prompt, None, GenParams(max_tokens=3)))
        assert gen.cached_tokens == 17 * b and gen.token_ids == plain.token_ids
    finally:
        await store.clear_namespace()
        await store.close()
        pipe.close()


async def test_a_hit_writes_back_the_blocks_after_it_and_its_tail_from_the_kv_it_copied_out(
    kv_server: RedisProcess, tiny_model: object
) -> None:
    """A hit copies out only the KV after the blocks it read (keep_from); what the write-back stores from it, the
    new blocks and the tail, is the sequence's own KV at the right positions."""
    b = 4
    settings = PodSettings(redis_url=kv_server.url, namespace="wb", codec="exact", block_tokens=b,
                           local_tier_bytes=0)
    store = BlockStore(store_settings(settings))
    runner = HfEngine(tiny_model)  # type: ignore[arg-type]
    metrics = PodMetrics()
    writer = BackgroundWriter(store, Codec("exact"), metrics, 8)
    writer.start()
    pipe = Pipeline(settings, runner, store, Codec("exact"), metrics, writer)
    try:
        prompt = list(range(300, 300 + 9 * b + 3))  # 9 full blocks and 2 more tokens usable
        # the whole sequence's KV, from scratch
        truth = runner.generate(GenRequest(prompt, None, GenParams(max_tokens=4)))
        hashes = pipe.hashes(SALT, prompt[:-1])
        frames = [Codec("exact").encode(truth.kv[:, :, :, i * b:(i + 1) * b]) for i in range(5)]
        assert (await store.store_blocks(pipe.model_key, hashes[:5], frames)).value == 5  # another pod wrote 5 blocks

        view, _ = await pipe.lookup(SALT, prompt)
        assert view.hit_blocks == 5
        gen = await pipe.generate(prompt, view, GenParams(max_tokens=4))
        assert gen.token_ids == truth.token_ids and gen.kv_from == 5 * b
        assert await pipe.writes.settle(pipe.writes.write_back(SALT, gen, view), view)

        seq = gen.seq_ids
        full = len(seq) // b
        stored = (await store.fetch(pipe.model_key, pipe.hashes(SALT, seq))).value
        assert len(stored) == full
        for i in range(5, full):
            torch.testing.assert_close(Codec("exact").decode(stored[i], device="cpu"),
                                       truth.kv[:, :, :, i * b:(i + 1) * b], rtol=1e-4, atol=1e-4)
        tail = (await store.get_entries([store.keys.tail(pipe.model_key, pipe.hashes(SALT, seq)[-1])]))[0]
        assert tail is not None
        ids, frame = unpack_tail(tail)
        assert ids == seq[full * b:]
        torch.testing.assert_close(Codec("exact").decode(frame, device="cpu"), truth.kv[:, :, :, full * b:len(seq)],
                                   rtol=1e-4, atol=1e-4)
    finally:
        await writer.stop()
        await store.clear_namespace()
        await store.close()
        pipe.close()
