"""The methods `kvstash bench resume` times, one context at a time: recompute, a kvstash hit, the floor of its bytes,
llama-server's slot restore, the naive torch.save baseline, and a hit broken into its phases."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from cachestore.boundary import BoundaryRecord, pack_boundary
from cachestore.signing import TRAILER_SIZE
from ops.bench.common import kv_bytes, percentile, reset_peak, status_bytes
from ops.bench.rawredis import raw_client, raw_get, raw_get_one
from service.engines.generation import GenRequest

SALT = b"bench-resume"
RAW_TIMEOUT_S = 120.0  # a floor read of 8k tokens over a slow --link-gbit


def result_row(context: int, method: str, times_s: list[float], nbytes: int) -> dict[str, Any]:
    return {"context": context, "method": method, "runs": len(times_s),
            "ttft_ms_p50": percentile(times_s, 0.5) * 1000, "ttft_ms_p90": percentile(times_s, 0.9) * 1000,
            "bytes": nbytes, "speedup_vs_recompute": None, "ratio_to_floor": None}


class ResumeBench:
    """One model, one Redis; measures every method for one context at a time."""

    def __init__(self, engine: Any, url: str, args: argparse.Namespace) -> None:
        self.engine, self.url, self.args = engine, url, args
        self.loaded: Any = engine.loaded if engine.kind == "hf" else None  # the transformers model of the hf engine
        self._warm = False
        self._beside: Any = None  # the one-core thread that calls an engine that does not run torch
        # llama-server keeps each slot's tokens: emptied before every timed run, so nothing is reused unasked
        self._fresh = engine.forget
        self.boundary: bytes | None = None  # a sliding-window or hybrid model's boundary state at the history's end
        self._specs: dict[str, str] = {}  # int4, int2: what a pod of this model serves them as
        self._hit_lengths: set[int] = set()  # contexts whose hit's memory was measured

    def compute(self, fn: Any, *args: Any) -> Any:
        """Run `fn` where a pod calls its engine (service.runtime.threads): an engine that runs torch on the
        process's compute thread, any other (llama.cpp, which computes on a thread of its own) on a thread that keeps
        torch to one core, as a pod's request threads do. The recompute, floor and naive methods get the cores exactly
        as the pod's hit path does (the floor of a q8 hit assembles a q8_0 state with torch, which a pod does on one
        core)."""
        from service.runtime import threads  # noqa: PLC0415

        if self.engine.runs_torch:
            return threads.compute_executor().submit(fn, *args).result()
        if self._beside is None:
            self._beside = threads.io_executor(1, "kvstash-bench")
        return self._beside.submit(fn, *args).result()

    def recompute(self, prompt: list[int]) -> tuple[list[float], Any]:
        from service.engines import GenParams  # noqa: PLC0415

        times, kv = [], None
        if not self._warm:  # the first forward of a process pays one-time setup: not a prefill cost
            self.compute(self.engine.generate, GenRequest(prompt[:64], None, GenParams(max_tokens=1)))
            self._warm = True
        for _ in range(max(1, self.args.recompute_repeat)):
            self._fresh()
            gen = self.compute(self.engine.generate, GenRequest(prompt, None, GenParams(max_tokens=1)))
            times.append(gen.ttft_s)
            kv = gen.kv
        if self.engine.boundary_records:  # the window / recurrent state at the history's end
            history = self.compute(self.engine.generate, GenRequest(prompt[:-1], None, GenParams(max_tokens=1)))
            self.boundary = dict(history.boundaries)[len(prompt) - 1]
        return times, kv  # kv: [L, 2, H, N + 1, D], the history's KV and the new token's

    @contextlib.asynccontextmanager
    async def _pod(self, namespace: str, mode: str, frame_key: str = "") -> AsyncIterator[tuple[Any, Any]]:
        """(pipeline, store) of a pod with codec `mode` that did not process the history: no local tier, and a
        Redis budget generous enough to time a cold 8k fp16 fetch instead of bypassing it. Emptied after."""
        from cachestore.store import BlockStore  # noqa: PLC0415
        from service.app import store_settings  # noqa: PLC0415
        from service.cache.codecnames import written_out  # noqa: PLC0415
        from service.cache.pipeline import Pipeline  # noqa: PLC0415
        from service.runtime.metrics import PodMetrics  # noqa: PLC0415
        from service.settings import PodSettings  # noqa: PLC0415

        if mode not in self._specs:  # a name (int4, int2) as this model's pod serves it; a spec as itself
            self._specs[mode] = written_out(mode, self.engine, self.engine.kv_layout.rope)[0]
        codec = self._specs[mode]
        settings = PodSettings(redis_url=self.url, namespace=namespace, codec=codec,
                               block_tokens=self.args.block_tokens, local_tier_bytes=0, redis_timeout_s=60.0,
                               budget_bytes=8 << 30, frame_key=frame_key)
        store = BlockStore(store_settings(settings).with_options(write_timeout_s=60.0))
        pipeline = Pipeline(settings, self.engine, store, codec, PodMetrics(), None)
        try:
            yield pipeline, store
        finally:
            await store.clear_namespace()
            await store.close()
            pipeline.close()

    async def _store_history(
        self, pipeline: Any, store: Any, prompt: list[int], kv: Any
    ) -> tuple[list[Any], list[bytes]]:
        """The KV of prompt[:-1] written as another pod writes it: its full blocks, in the pipeline's codecs."""
        b = self.args.block_tokens
        hashes = pipeline.hashes(SALT, prompt[:-1])
        frames = [pipeline.codecs.at(i).encode(kv[:, :, :, i * b:(i + 1) * b])  # [L, 2, H, b, D] each
                  for i in range(len(hashes))]
        assert (await store.store_blocks(pipeline.model_key, hashes, frames)).value == len(frames)
        if self.boundary is not None:  # and its boundary record, as the pod that stopped there writes it
            record = pack_boundary(BoundaryRecord(len(prompt) - 1, [], b"", self.boundary))
            assert await store.put_entries([store.keys.boundary(pipeline.model_key, hashes[-1])], [record]) == 1
        return hashes, frames

    async def kvstash(self, mode: str, prompt: list[int], kv: Any) -> list[dict[str, Any]]:
        """The pod's hit path for codec `mode`, then the floor over the very same frames (and with a frame key, the
        same hit on a signing pod)."""

        from service.engines import GenParams  # noqa: PLC0415

        context = len(prompt) - 1
        raw = raw_client(self.url, RAW_TIMEOUT_S)
        try:
            async with self._pod("bench-resume", mode) as (pipeline, store), \
                    (self._pod("bench-resume-signed", mode, self.args.frame_key) if self.args.frame_key
                     else contextlib.nullcontext((None, None))) as (signed, signed_store):
                hashes, frames = await self._store_history(pipeline, store, prompt, kv)
                if self.args.frame_key:
                    await self._store_history(signed, signed_store, prompt, kv)
                nbytes = sum(len(f) for f in frames)
                keys = [store.keys.block(pipeline.model_key, h)[1] for h in hashes]
                if self.boundary is not None:  # the floor reads the record too
                    keys.append(store.keys.boundary(pipeline.model_key, hashes[-1])[1])
                    nbytes += len(await raw_get_one(raw, keys[-1]))
                # the floor's KV, in memory: a context the engine lent stays lent to the floor as a hit left it (its
                # state holds the hit's rows: set, or written as a slot file, as they are), anything else is copied
                # the first lookup and hit's high water above what the process held: what a hit allocates (pools,
                # landings, the engine's state), less the KV the floor keeps from that first lookup (the context
                # the engine lent, or a copy: the hit must take another, where a pod would have it back)
                held = reset_peak()
                decoded = (await pipeline.lookup(SALT, prompt))[0].complete()
                lent = self.loaded is None and self.engine.is_lent(decoded)
                if self.loaded is None and not lent:
                    decoded = decoded.clone()
                kept = kv_bytes(decoded, decoded.shape[3]) if len(getattr(decoded, "shape", ())) == 5 else 0
                times: list[float] = []
                floor: list[float] = []
                fetched: list[float] = []  # the floor's reads alone: over a --link-gbit, its wire
                signed_times: list[float] = []

                async def hit(pipe: Any) -> float:
                    self._fresh()
                    t0 = time.perf_counter()
                    view, _ = await pipe.lookup(SALT, prompt)
                    if view.cached_tokens != context:
                        raise RuntimeError(f"{mode}: expected a hit of {context} tokens, got {view}")
                    gen = await pipe.generate(prompt, view, GenParams(max_tokens=1))
                    # everything after the first token (copying the KV out for write-back) is not TTFT
                    return time.perf_counter() - t0 - (gen.total_s - gen.ttft_s)

                # hit and floor alternate, so both see the same machine (a VM's speed drifts over a minute); so do the
                # unsigned and the signed hit, who goes first alternating rep by rep
                peak: int | None = None
                for rep in range(self.args.repeat + 1):  # the first round warms up and is not counted
                    if self.args.frame_key and rep % 2:
                        signed_s, elapsed = await hit(signed), await hit(pipeline)
                    else:
                        elapsed = await hit(pipeline)
                        peak = peak if rep or held is None else status_bytes("VmHWM")
                        signed_s = await hit(signed) if self.args.frame_key else 0.0
                    least, read = self.compute(self._floor, raw, keys, prompt, decoded)
                    if rep:
                        times.append(elapsed)
                        floor.append(least)
                        fetched.append(read)
                        signed_times.append(signed_s)
                if lent:
                    self.engine.give_context(decoded)
                if self.args.frame_key:
                    assert signed_store is not None and signed_store.stats().rejected_mac == 0
            rows = [result_row(context, f"kvstash-{mode}", times, nbytes),
                    {**result_row(context, f"floor-{mode}", floor, nbytes),
                     "fetch_ms_p50": percentile(fetched, 0.5) * 1000}]
            # the hit's memory beside the KV it rebuilt (the engine's dtype)
            if held is not None and peak is not None and context not in self._hit_lengths:
                # measured cold only: on the first hit of this length in the process (its pools and the allocator's
                # free pages hold nothing that size yet); a later one would touch only what they lack
                rows[0].update({"hit_memory_bytes": peak - held - kept, "kv_bytes": kv_bytes(kv, context),
                                "memory_cold": True})
                self._hit_lengths.add(context)
            if self.boundary is not None:
                rows[0].update(self._bytes_per_token(context, frames, nbytes))
            if self.args.frame_key:
                row = result_row(context, f"signed-{mode}", signed_times, nbytes + TRAILER_SIZE * len(frames))
                row["ratio_to_unsigned"] = statistics.median(s / u for s, u in zip(signed_times, times, strict=True))
                rows.append(row)
            return rows
        finally:
            raw.close()

    async def burst(self, mode: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
        """len(prompts) sessions that another pod processed arrive on this pod at the same moment: each one's
        TTFT counted from that moment, for recomputing them all and for kvstash's hits (queueing included:
        an hf pod prefills one prompt at a time and decodes them together, a llama.cpp pod batches both)."""
        from service.cache.cacheview import CacheView  # noqa: PLC0415
        from service.engines import GenParams  # noqa: PLC0415

        async def together(pipeline: Any, cached: bool) -> tuple[list[float], list[Any]]:
            start = time.perf_counter()

            async def one(prompt: list[int]) -> tuple[float, Any]:
                view = (await pipeline.lookup(SALT, prompt))[0] if cached else CacheView(None, 0, 0, "miss")
                gen = await pipeline.generate(prompt, view, GenParams(max_tokens=1))
                if cached and view.cached_tokens != len(prompt) - 1:
                    raise RuntimeError(f"burst: expected a hit of {len(prompt) - 1} tokens, got {view}")
                return time.perf_counter() - start - (gen.total_s - gen.ttft_s), gen.kv

            done = await asyncio.gather(*(one(p) for p in prompts))
            return [t for t, _ in done], [kv for _, kv in done]

        async with self._pod("bench-burst", mode) as (pipeline, store):
            self._fresh()
            recompute, kvs = await together(pipeline, cached=False)
            for prompt, kv in zip(prompts, kvs, strict=True):
                await self._store_history(pipeline, store, prompt, kv)
            self._fresh()
            await together(pipeline, cached=True)  # warm-up: buffers, connections
            self._fresh()
            hits, _ = await together(pipeline, cached=True)
        context, n = len(prompts[0]) - 1, len(prompts)
        return [{**result_row(context, f"burst{n}-{name}", times, 0), "ttft_ms_p99": percentile(times, 0.99) * 1000}
                for name, times in (("recompute", recompute), (f"kvstash-{mode}", hits))]

    def _floor(self, raw: Any, keys: list[str], prompt: list[int], kv: Any) -> tuple[float, float]:
        """Seconds of one floor run (the raw GETs of the frames, then the step over `kv` already decoded), and of its
        GETs alone."""
        if self.loaded is None:
            return self._floor_engine(raw, keys, prompt, kv)
        import torch  # noqa: PLC0415

        from service.engines.hf import hfcache  # noqa: PLC0415

        cache = hfcache.cache_from_tensor(kv, self.loaded.model)  # in memory before the clock starts
        t0 = time.perf_counter()
        got = raw_get(raw, keys)
        fetched = time.perf_counter() - t0
        with torch.inference_mode():
            logits, _ = hfcache.forward(self.loaded.model, prompt[len(prompt) - 1:], cache)
            int(torch.argmax(logits[-1]))
        elapsed = time.perf_counter() - t0
        assert all(isinstance(g, bytes) for g in got)
        return elapsed, fetched

    def _floor_engine(self, raw: Any, keys: list[str], prompt: list[int], kv: Any) -> tuple[float, float]:
        """The floor of an engine that takes KV as tensors (llama.cpp): the raw GETs of the same frames, then
        the engine's own resume from KV already decoded in memory (state set + one decode step)."""
        from service.engines import GenParams  # noqa: PLC0415

        self._fresh()
        t0 = time.perf_counter()
        got = raw_get(raw, keys)
        fetched = time.perf_counter() - t0
        # the KV handed back starts where the hit's does (the pipeline's keep_from): parsing the whole history out of
        # the state, which a hit never does, faulted in 47-94 MB at 2048 tokens right before the next hit was timed
        gen = self.engine.generate(GenRequest(prompt, kv, GenParams(max_tokens=1), keep_from=int(kv.shape[3]),
                                   boundary=self.boundary))
        assert all(isinstance(g, bytes) for g in got)
        return fetched + gen.ttft_s, fetched

    def _bytes_per_token(self, context: int, frames: list[bytes], nbytes: int) -> dict[str, float]:
        """What a sliding-window or hybrid model's hit stores a token: its blocks (full-attention layers) and its
        record, against blocks of every attention layer for every position in the same codec."""
        layout = self.engine.layout
        blocks = sum(len(f) for f in frames)
        every_layer = blocks * (layout.full + layout.sliding_count) / layout.full
        return {"bytes_per_token": nbytes / context, "record_bytes": nbytes - blocks,
                "every_layer_bytes_per_token": every_layer / context}

    def slot_restore(self, prompt: list[int], kv: Any) -> dict[str, Any]:
        """llama-server's own mechanism, the bar a user compares with: the history's slot file already on the local
        tmpfs (written once), then `POST /slots/0?action=restore` + the completion of the last token."""
        from service.engines import GenParams  # noqa: PLC0415
        from service.engines.llama import slotfile  # noqa: PLC0415

        context = len(prompt) - 1
        path = self.engine.slot_dir / "bench-floor.bin"
        nbytes = slotfile.write(path, prompt[:context], kv[:, :, :, :context], self.engine.state_geometry)
        times = []
        try:
            for rep in range(self.args.repeat + 1):
                self._fresh()
                t0 = time.perf_counter()
                r = self.engine.restore_file(0, path.name)
                gen = self.engine.generate(GenRequest(prompt, None, GenParams(max_tokens=1)))
                if r != context or gen.cached_tokens != context:
                    raise RuntimeError(f"slot restore: {r} tokens restored, {gen.cached_tokens} reused of {context}")
                if rep:
                    times.append(time.perf_counter() - t0 - (gen.total_s - gen.ttft_s))
        finally:
            path.unlink(missing_ok=True)
        return result_row(context, "slot-file-tmpfs", times, nbytes)

    def naive(self, prompt: list[int], kv: Any) -> dict[str, Any]:
        """What people write by hand: torch.save the whole cache into one key, GET it, torch.load it."""
        import torch  # noqa: PLC0415

        from service.engines.hf import hfcache  # noqa: PLC0415

        context = len(prompt) - 1
        model = self.loaded.model
        per_layer = tuple((kv[i, 0, :, :context].unsqueeze(0).clone(), kv[i, 1, :, :context].unsqueeze(0).clone())
                          for i in range(kv.shape[0]))  # [1, H, N, D] each, in the model's dtype
        buf = io.BytesIO()
        torch.save(per_layer, buf)
        key = "bench-resume:naive"
        raw = raw_client(self.url, RAW_TIMEOUT_S)
        try:
            raw.set(key, buf.getvalue())
            times = []
            for rep in range(self.args.repeat + 1):
                t0 = time.perf_counter()
                blob = cast(bytes, raw.get(key))
                # The one torch.load in kvstash: bytes this benchmark itself wrote a moment ago, to
                # measure the naive method; never on bytes from a Redis anyone else can write.
                loaded = torch.load(io.BytesIO(blob), weights_only=True)
                with torch.inference_mode():
                    cache = hfcache.cache_of_layers(loaded, model)
                    logits, _ = hfcache.forward(model, prompt[context:], cache)
                    int(torch.argmax(logits[-1]))
                if rep:
                    times.append(time.perf_counter() - t0)
            return result_row(context, "naive", times, len(buf.getvalue()))
        finally:
            raw.delete(key)
            raw.close()

    async def profile(self, mode: str, prompt: list[int], kv: Any) -> dict[str, float]:
        """Median ms of each phase of a hit, run one after another (the pod verifies between its reads): the reads
        into the landing, verifying, handing the frames over, the cache, the forward step dequantizing a layer of
        every block just before that layer's attention; and, for comparison, the same step over that context once
        it is all in place (the floor's step), and the floor's raw GETs of the same frames."""
        import torch  # noqa: PLC0415

        from service.cache.lookup import chunk_plan  # noqa: PLC0415
        from service.cache.rehydrate import Rehydration  # noqa: PLC0415
        from service.engines.hf import hfcache  # noqa: PLC0415

        context, b = len(prompt) - 1, self.args.block_tokens
        names = ("fetch", "verify", "hand_over", "cache_build", "forward_layerwise", "forward_in_memory", "raw_get")
        phases: dict[str, list[float]] = {k: [] for k in names}
        with contextlib.closing(raw_client(self.url, RAW_TIMEOUT_S)) as raw:
            async with self._pod("bench-profile", mode) as (pipeline, store):
                hashes, _ = await self._store_history(pipeline, store, prompt, kv)
                keys = [store.keys.block(pipeline.model_key, h)[1] for h in hashes]
                # one buffer for every run, as the pod's context pool: a fresh 94 MB tensor each time would time the
                # page faults of its first touch (39 ms of decoding and 7 ms of "cache_build" at 2048 tokens here)
                layers, _, heads, _, dim = kv.shape
                pooled = torch.empty((layers, 2, heads, context + b, dim), dtype=kv.dtype)
                stage, slots = pipeline.landing_for(len(hashes))
                for rep in range(self.args.repeat + 1):
                    marks = [time.perf_counter()]

                    def read() -> list[Any]:  # as a pod's lookup reads them: on a reader thread, in its chunks
                        got: list[Any] = []
                        for r in chunk_plan(len(hashes)):
                            into = slots[r.start:r.stop] if slots is not None else None
                            got += store.fetch_blocking(pipeline.model_key, hashes[r.start:r.stop], into).value
                        return got

                    got = await asyncio.to_thread(read)
                    marks.append(time.perf_counter())
                    rehydration = Rehydration(pooled, b, pipeline.open_block, layerwise=True, landing=stage)
                    rehydration.take(got)
                    marks.append(time.perf_counter())
                    rehydration.end()
                    rehydration.run(lambda n, nbytes: None)
                    marks.append(time.perf_counter())

                    def step(marks: list[float] = marks, gate: Any = rehydration.gate) -> None:  # on the compute thread
                        whole = pooled[:, :, :, :context]  # [L, 2, H, N, D], a view of a buffer with room to grow
                        with torch.inference_mode():
                            for ready in (gate, None):
                                cache = hfcache.cache_from_tensor(whole, self.loaded.model, ready=ready)
                                if ready is not None:
                                    marks.append(time.perf_counter())
                                logits, _ = hfcache.forward(self.loaded.model, prompt[context:], cache)
                                int(torch.argmax(logits[-1]))
                                marks.append(time.perf_counter())

                    self.compute(step)
                    start = time.perf_counter()
                    raw_get(raw, keys)
                    if rep:
                        phases["raw_get"].append(time.perf_counter() - start)
                        for name, (t0, t1) in zip(names[:-1], itertools.pairwise(marks), strict=True):
                            phases[name].append(t1 - t0)
        return {name: percentile(v, 0.5) * 1000 for name, v in phases.items()}
