"""Pipeline.lookup reads blocks in pipelined chunks and decodes them into one context: exact, truncated at holes."""

from __future__ import annotations

import torch

from cachestore.codec import Codec
from cachestore.store import BlockStore
from ops.redisproc import RedisProcess
from service import pipeline as pipeline_module
from service.app import store_settings
from service.engines import GenParams
from service.engines.hf import HfEngine
from service.metrics import PodMetrics
from service.pipeline import Pipeline
from service.settings import PodSettings

SALT = b"chunks"


async def test_chunked_lookup_rebuilds_the_context_and_stops_at_a_corrupt_block(
    redis_server: RedisProcess, tiny_model: object
) -> None:
    b = 4
    settings = PodSettings(redis_url=redis_server.url, namespace="chunks", codec="exact", block_tokens=b,
                           local_tier_bytes=0)
    store = BlockStore(store_settings(settings))
    runner = HfEngine(tiny_model)  # type: ignore[arg-type]
    pipe = Pipeline(settings, runner, store, Codec("exact"), PodMetrics(), None)
    try:
        prompt = list(range(100, 100 + 20 * b + 2))  # 20 full blocks usable: 3 chunks of 8, 8, 4
        assert pipeline_module.FETCH_CHUNK_BLOCKS < 20
        kv = runner.generate(prompt, None, GenParams(max_tokens=1)).kv  # [L, 2, H, T, D]
        hashes = pipe.hashes(SALT, prompt[:-1])
        frames = [Codec("exact").encode(kv[:, :, :, i * b:(i + 1) * b]) for i in range(len(hashes))]
        assert await store.put_blocks(pipe.model_key, hashes, frames) == 20

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
        gen = runner.generate(prompt, view.kv, GenParams(max_tokens=3), kv_ready=view.ready)
        plain = runner.generate(prompt, None, GenParams(max_tokens=3))
        assert gen.cached_tokens == 17 * b and gen.token_ids == plain.token_ids
    finally:
        await store.clear_namespace()
        await store.close()
        pipe.close()
