"""`kvstash bench resume`: time to first token of a resumed session, kvstash vs recompute, naive and floor.

For each context length N the prompt is N + 1 tokens of ops/data/sample.txt: the N-token history
(prefilled "on another pod") and one new token. Methods, all on one model and one private Redis:

    recompute       no cache: a full prefill of the N + 1 tokens (ModelRunner.generate); recompute-q8_0: the same
                    on the llamacpp engine with a q8_0 KV cache, which codec q8 runs (and is compared with)
    kvstash-MODE    what a pod does on a hit: Pipeline.lookup (BlockStore.lookup of the N/b blocks
                    in one pipelined round trip + Codec.decode + assembly), then Pipeline.generate
                    (cache build + one forward step of the last token + the pick)
    naive           torch.save of the per-layer (K, V) tensors into ONE Redis key; GET + torch.load
                    + DynamicCache + the same forward step
    floor-MODE      raw redis-py pipelined GETs of kvstash-MODE's frames (in the pod's chunks) + the forward
                    step over a cache already in memory: the least any hit of those bytes can cost
    signed-MODE     with --frame-key: kvstash-MODE's hit on a pod that signs its values (cachestore.signing), the
                    same history written signed; timed rep by rep beside the unsigned hit (ratio_to_unsigned: the
                    median of the paired ratios)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ops.bench.common import SAMPLE_TEXT, machine, percentile, plot_lines, print_table, write_json

CONTEXTS = [256, 512, 1024, 2048, 4096]
LONG_CONTEXT = 8128  # the largest multiple of 64 whose prompt (+1 token) fits SmolLM2's 8192 context
SALT = b"bench-resume"
TARGET_CONTEXT, TARGET_MODE = 2048, "int8"
# speedup over recompute at 2048 tokens, int8: the engine the README recommends for the fastest resume
# (llama.cpp, 50x) and transformers (20x, bounded by its forward step)
TARGET_SPEEDUP = {"hf": 20.0, "llamacpp": 50.0}
# a hit within this factor of the floor (a raw GET of the same frames + the step), at 2048 and 8128 tokens
TARGET_FLOOR_RATIO = {"int8": 1.15, "fp16": 1.15, "int4": 1.25, "q8": 1.15}
SPEEDUP_MODES = ("int8", "q8")  # q8: llama.cpp's own 8-bit cache (q8_0), the int8 a llamacpp pod runs best
TARGET_FLOOR_CONTEXTS = (TARGET_CONTEXT, LONG_CONTEXT)
TARGET_SIGNED_RATIO = 1.05  # a signed hit within 5% of an unsigned one, at 2048 and 8128 tokens
BURST_CONTEXT = 2048


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("resume", help="TTFT of a resumed session: kvstash vs recompute, naive, floor")
    p.add_argument("--engine", default="hf", choices=["hf", "llamacpp", "llama-server"],
                   help="model runtime: hf (transformers, default), llamacpp (recompute = llama.cpp's prefill) or "
                        "llama-server (a spawned llama-server; adds slot-file-tmpfs, its own slot restore)")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default); hf: tiny-random or a local HF directory; llamacpp: a .gguf file")
    p.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"],
                   help="llama.cpp's flash attention (llama.cpp engines; default auto)")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                   help="history lengths in tokens, multiples of --block-tokens (default %(default)s)")
    p.add_argument("--long", action="store_true", help=f"also {LONG_CONTEXT} tokens (the model's context)")
    p.add_argument("--modes", default="fp16,int8,int4,int2", help="codec specs to measure (default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block, as the pod (default 64)")
    p.add_argument("--repeat", type=int, default=7, help="timed runs per hit method (default 7)")
    p.add_argument("--recompute-repeat", type=int, default=3, help="timed full prefills per context (default 3)")
    p.add_argument("--no-naive", action="store_true", help="skip the torch.save baseline")
    p.add_argument("--burst", type=int, default=0, metavar="N",
                   help=f"also N sessions of {BURST_CONTEXT} tokens arriving together on one pod: p50/p99 TTFT of "
                        "their hits (first mode) and of recomputing them")
    p.add_argument("--profile", action="store_true",
                   help="break each measured hit (every context and mode; hf) into its phases")
    p.add_argument("--redis-url", help="use this Redis (default: a private redis-server)")
    p.add_argument("--frame-key", default="", metavar="KEY",
                   help="also time each hit on a pod that signs its values with this frame key (signed-MODE rows)")
    p.add_argument("--json", type=Path, help="write rows and targets as JSON here")
    p.add_argument("--plot", type=Path, help="draw TTFT vs context length for every method (PNG)")
    p.set_defaults(func=run)


def _prompt_ids(engine: Any, length: int) -> list[int]:
    ids = engine.text_ids(SAMPLE_TEXT.read_text(encoding="utf-8"))
    return (ids * (-(-length // len(ids))))[:length]


def _row(context: int, method: str, times_s: list[float], nbytes: int) -> dict[str, Any]:
    return {"context": context, "method": method, "runs": len(times_s),
            "ttft_ms_p50": percentile(times_s, 0.5) * 1000, "ttft_ms_p90": percentile(times_s, 0.9) * 1000,
            "bytes": nbytes, "speedup_vs_recompute": None, "ratio_to_floor": None}


class ResumeBench:
    """One model, one Redis; measures every method for one context at a time."""

    def __init__(self, engine: Any, url: str, args: argparse.Namespace) -> None:
        self.engine, self.url, self.args = engine, url, args
        self.loaded = getattr(engine, "loaded", None)  # the transformers model of the hf engine
        self._warm = False
        self._beside: Any = None  # the one-core thread that calls an engine that does not run torch
        # llama-server keeps each slot's tokens: emptied before every timed run, so nothing is reused unasked
        self._fresh = getattr(engine, "forget", lambda: None)

    def compute(self, fn: Any, *args: Any) -> Any:
        """Run `fn` where a pod calls its engine (service.threads): an engine that runs torch on the process's compute
        thread, any other (llama.cpp, which computes on a thread of its own) on a thread that keeps torch to one core,
        as a pod's request threads do. The recompute, floor and naive methods get the cores exactly as the pod's hit
        path does (the floor of a q8 hit assembles a q8_0 state with torch, which a pod does on one core)."""
        from service import threads  # noqa: PLC0415

        if getattr(self.engine, "runs_torch", True):
            return threads.compute_executor().submit(fn, *args).result()
        if self._beside is None:
            self._beside = threads.io_executor(1, "kvstash-bench")
        return self._beside.submit(fn, *args).result()
    def recompute(self, prompt: list[int]) -> tuple[list[float], Any]:
        from service.runner import GenParams  # noqa: PLC0415

        times, kv = [], None
        if not self._warm:  # the first forward of a process pays one-time setup: not a prefill cost
            self.compute(self.engine.generate, prompt[:64], None, GenParams(max_tokens=1))
            self._warm = True
        for _ in range(max(1, self.args.recompute_repeat)):
            self._fresh()
            gen = self.compute(self.engine.generate, prompt, None, GenParams(max_tokens=1))
            times.append(gen.ttft_s)
            kv = gen.kv
        return times, kv  # kv: [L, 2, H, N + 1, D], the history's KV and the new token's

    @contextlib.asynccontextmanager
    async def _pod(self, namespace: str, mode: str, frame_key: str = "") -> AsyncIterator[tuple[Any, Any]]:
        """(pipeline, store) of a pod with codec `mode` that did not process the history: no local tier, and a
        Redis budget generous enough to time a cold 8k fp16 fetch instead of bypassing it. Emptied after."""
        from cachestore.store import BlockStore  # noqa: PLC0415
        from service.app import store_settings  # noqa: PLC0415
        from service.metrics import PodMetrics  # noqa: PLC0415
        from service.pipeline import Pipeline  # noqa: PLC0415
        from service.settings import PodSettings  # noqa: PLC0415

        settings = PodSettings(redis_url=self.url, namespace=namespace, codec=mode, block_tokens=self.args.block_tokens,
                               local_tier_bytes=0, redis_timeout_s=60.0, budget_bytes=8 << 30, frame_key=frame_key)
        store = BlockStore(store_settings(settings).with_options(write_timeout_s=60.0))
        pipeline = Pipeline(settings, self.engine, store, mode, PodMetrics(), None)
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
        assert await store.put_blocks(pipeline.model_key, hashes, frames) == len(frames)
        return hashes, frames

    async def kvstash(self, mode: str, prompt: list[int], kv: Any) -> list[dict[str, Any]]:
        """The pod's hit path for codec `mode`, then the floor over the very same frames (and with a frame key, the
        same hit on a signing pod)."""

        from service.runner import GenParams  # noqa: PLC0415

        context = len(prompt) - 1
        raw = _raw_client(self.url)
        try:
            async with self._pod("bench-resume", mode) as (pipeline, store), \
                    (self._pod("bench-resume-signed", mode, self.args.frame_key) if self.args.frame_key
                     else contextlib.nullcontext((None, None))) as (signed, signed_store):
                hashes, frames = await self._store_history(pipeline, store, prompt, kv)
                if self.args.frame_key:
                    await self._store_history(signed, signed_store, prompt, kv)
                nbytes = sum(len(f) for f in frames)
                keys = [store.keys.block(pipeline.model_key, h)[1] for h in hashes]
                # the floor's KV, in memory: a context the engine lent stays lent to the floor as a hit left it (its
                # state holds the hit's rows: set, or written as a slot file, as they are), anything else is copied
                decoded = (await pipeline.lookup(SALT, prompt))[0].complete()
                is_lent = getattr(self.engine, "is_lent", None)
                lent = self.loaded is None and is_lent is not None and is_lent(decoded)
                if self.loaded is None and not lent:
                    decoded = decoded.clone()
                times: list[float] = []
                floor: list[float] = []
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
                for rep in range(self.args.repeat + 1):  # the first round warms up and is not counted
                    if self.args.frame_key and rep % 2:
                        signed_s, elapsed = await hit(signed), await hit(pipeline)
                    else:
                        elapsed = await hit(pipeline)
                        signed_s = await hit(signed) if self.args.frame_key else 0.0
                    least = self.compute(self._floor, raw, keys, prompt, decoded)
                    if rep:
                        times.append(elapsed)
                        floor.append(least)
                        signed_times.append(signed_s)
                if lent:
                    self.engine.give_context(decoded)
                if self.args.frame_key:
                    assert signed_store.stats().rejected_mac == 0
            rows = [_row(context, f"kvstash-{mode}", times, nbytes), _row(context, f"floor-{mode}", floor, nbytes)]
            if self.args.frame_key:
                row = _row(context, f"signed-{mode}", signed_times, nbytes + 40 * len(frames))
                row["ratio_to_unsigned"] = statistics.median(s / u for s, u in zip(signed_times, times, strict=True))
                rows.append(row)
            return rows
        finally:
            raw.close()

    async def burst(self, mode: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
        """len(prompts) sessions that another pod processed arrive on this pod at the same moment: each one's
        TTFT counted from that moment, for recomputing them all and for kvstash's hits (queueing included:
        an hf pod prefills one prompt at a time and decodes them together, a llama.cpp pod batches both)."""
        from service.pipeline import CacheView  # noqa: PLC0415
        from service.runner import GenParams  # noqa: PLC0415

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
        return [{**_row(context, f"burst{n}-{name}", times, 0), "ttft_ms_p99": percentile(times, 0.99) * 1000}
                for name, times in (("recompute", recompute), (f"kvstash-{mode}", hits))]

    def _floor(self, raw: Any, keys: list[str], prompt: list[int], kv: Any) -> float:
        """Seconds of one floor run: the raw GETs of the frames, then the step over `kv` already decoded."""
        if self.loaded is None:
            return self._floor_engine(raw, keys, prompt, kv)
        import torch  # noqa: PLC0415

        from service import hfcache  # noqa: PLC0415

        cache = hfcache.cache_from_tensor(kv, self.loaded.model)  # in memory before the clock starts
        t0 = time.perf_counter()
        got = _raw_get(raw, keys)
        with torch.inference_mode():
            logits, _ = hfcache.forward(self.loaded.model, prompt[len(prompt) - 1:], cache)
            int(torch.argmax(logits[-1]))
        elapsed = time.perf_counter() - t0
        assert all(isinstance(g, bytes) for g in got)
        return elapsed

    def _floor_engine(self, raw: Any, keys: list[str], prompt: list[int], kv: Any) -> float:
        """The floor of an engine that takes KV as tensors (llama.cpp): the raw GETs of the same frames, then
        the engine's own resume from KV already decoded in memory (state set + one decode step)."""
        from service.engines import GenParams  # noqa: PLC0415

        self._fresh()
        t0 = time.perf_counter()
        got = _raw_get(raw, keys)
        fetched = time.perf_counter() - t0
        # the KV handed back starts where the hit's does (the pipeline's keep_from): parsing the whole history out of
        # the state, which a hit never does, faulted in 47-94 MB at 2048 tokens right before the next hit was timed
        gen = self.engine.generate(prompt, kv, GenParams(max_tokens=1), keep_from=int(kv.shape[3]))
        assert all(isinstance(g, bytes) for g in got)
        return fetched + gen.ttft_s

    def slot_restore(self, prompt: list[int], kv: Any) -> dict[str, Any]:
        """llama-server's own mechanism, the bar a user compares with: the history's slot file already on the local
        tmpfs (written once), then `POST /slots/0?action=restore` + the completion of the last token."""
        from service.engines import GenParams, slotfile  # noqa: PLC0415

        context = len(prompt) - 1
        path = self.engine.slot_dir / "bench-floor.bin"
        nbytes = slotfile.write(path, prompt[:context], kv[:, :, :, :context], self.engine.state_geometry)
        times = []
        try:
            for rep in range(self.args.repeat + 1):
                self._fresh()
                t0 = time.perf_counter()
                r = self.engine.restore_file(0, path.name)
                gen = self.engine.generate(prompt, None, GenParams(max_tokens=1))
                if r != context or gen.cached_tokens != context:
                    raise RuntimeError(f"slot restore: {r} tokens restored, {gen.cached_tokens} reused of {context}")
                if rep:
                    times.append(time.perf_counter() - t0 - (gen.total_s - gen.ttft_s))
        finally:
            path.unlink(missing_ok=True)
        return _row(context, "slot-file-tmpfs", times, nbytes)

    def naive(self, prompt: list[int], kv: Any) -> dict[str, Any]:
        """What people write by hand: torch.save the whole cache into one key, GET it, torch.load it."""
        import redis  # noqa: PLC0415
        import torch  # noqa: PLC0415
        from transformers import DynamicCache  # noqa: PLC0415

        from service import hfcache  # noqa: PLC0415

        context = len(prompt) - 1
        model = self.loaded.model
        per_layer = tuple((kv[i, 0, :, :context].unsqueeze(0).clone(), kv[i, 1, :, :context].unsqueeze(0).clone())
                          for i in range(kv.shape[0]))  # [1, H, N, D] each, in the model's dtype
        buf = io.BytesIO()
        torch.save(per_layer, buf)
        key = "bench-resume:naive"
        raw = redis.Redis.from_url(self.url)
        try:
            raw.set(key, buf.getvalue())
            times = []
            for rep in range(self.args.repeat + 1):
                t0 = time.perf_counter()
                blob = raw.get(key)
                # The one torch.load in kvstash: bytes this benchmark itself wrote a moment ago, to
                # measure the naive method; never on bytes from a Redis anyone else can write.
                loaded = torch.load(io.BytesIO(blob), weights_only=True)
                with torch.inference_mode():
                    cache = DynamicCache(list(loaded), config=model.config)
                    logits, _ = hfcache.forward(model, prompt[context:], cache)
                    int(torch.argmax(logits[-1]))
                if rep:
                    times.append(time.perf_counter() - t0)
            return _row(context, "naive", times, len(buf.getvalue()))
        finally:
            raw.delete(key)
            raw.close()

    async def profile(self, mode: str, prompt: list[int], kv: Any) -> dict[str, float]:
        """Median ms of each phase of a hit, run one after another (the pod verifies between its reads): the reads
        into the landing, verifying, handing the frames over, the cache, the forward step dequantizing a layer of
        every block just before that layer's attention; and, for comparison, the same step over that context once
        it is all in place (the floor's step), and the floor's raw GETs of the same frames."""
        import redis  # noqa: PLC0415
        import torch  # noqa: PLC0415

        from service import hfcache  # noqa: PLC0415
        from service.pipeline import chunk_plan  # noqa: PLC0415
        from service.rehydrate import Rehydration  # noqa: PLC0415

        context, b = len(prompt) - 1, self.args.block_tokens
        names = ("fetch", "verify", "hand_over", "cache_build", "forward_layerwise", "forward_in_memory", "raw_get")
        phases: dict[str, list[float]] = {k: [] for k in names}
        with contextlib.closing(redis.Redis.from_url(self.url)) as raw:
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
                    _raw_get(raw, keys)
                    if rep:
                        phases["raw_get"].append(time.perf_counter() - start)
                        for name, (t0, t1) in zip(names[:-1], itertools.pairwise(marks), strict=True):
                            phases[name].append(t1 - t0)
        return {name: percentile(v, 0.5) * 1000 for name, v in phases.items()}


def _raw_client(url: str) -> Any:
    """The floor's blocking redis-py client of `url`: a Cluster client for a Cluster URL (its pipeline reads the
    nodes one after another: the floor is then plain redis-py's, not the fastest possible read)."""
    from cachestore.redisclient import make_client  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415

    return make_client(StoreSettings.from_url(url), asynchronous=False)


def _raw_get(raw: Any, keys: list[str]) -> list[Any]:
    """Plain GETs of `keys` on a blocking redis-py client, in the pod's chunks (`chunk_plan`): the least a read of
    those bytes costs here (one pipeline of them all is slower: 116-192 ms against 72-75 ms for 97 MB in 127
    values, because both ends buffer the whole reply)."""
    from service.pipeline import chunk_plan  # noqa: PLC0415

    got: list[Any] = []
    for chunk in chunk_plan(len(keys)):
        pipe = raw.pipeline(transaction=False)
        for key in keys[chunk.start:chunk.stop]:
            pipe.get(key)
        got += pipe.execute()
    return got


def _finish(rows: list[dict[str, Any]]) -> None:
    """Fill speedup vs recompute (of the same engine: a q8 hit against the q8_0 cache's prefill) and the ratio to the
    floor of the same bytes."""
    by = {(r["context"], r["method"]): r for r in rows}
    for r in rows:
        burst = r["method"].split("-", 1)[0] if r["method"].startswith("burst") else None
        rec = (by.get((r["context"], f"{burst}-recompute")) if burst else
               by.get((r["context"], "recompute" + _cache_suffix(r["method"]))) or by.get((r["context"], "recompute")))
        if rec and r["ttft_ms_p50"] > 0:
            r["speedup_vs_recompute"] = rec["ttft_ms_p50"] / r["ttft_ms_p50"]
        if r["method"].startswith("kvstash-"):
            floor = by.get((r["context"], "floor-" + r["method"].removeprefix("kvstash-")))
            if floor:
                r["ratio_to_floor"] = r["ttft_ms_p50"] / floor["ttft_ms_p50"]


def _targets(rows: list[dict[str, Any]], engine: str) -> dict[str, Any]:
    """The speedup at 2048 tokens (int8) and every measured hit's ratio to its floor, against the targets."""
    targets: dict[str, Any] = {}
    for mode in SPEEDUP_MODES:
        hit = next((r for r in rows if r["context"] == TARGET_CONTEXT and r["method"] == f"kvstash-{mode}"), None)
        if hit is not None and engine in TARGET_SPEEDUP:
            speedup, least = hit["speedup_vs_recompute"], TARGET_SPEEDUP[engine]
            targets[f"speedup_{mode}_2048_{engine}"] = {"value": speedup, "target": least,
                                                        "met": (speedup or 0) >= least}
    for r in rows:
        mode = r["method"].removeprefix("kvstash-")
        if (r["method"].startswith("kvstash-") and mode in TARGET_FLOOR_RATIO and r["context"] in TARGET_FLOOR_CONTEXTS
                and r["ratio_to_floor"] is not None):
            limit = TARGET_FLOOR_RATIO[mode]
            targets[f"floor_ratio_{mode}_{r['context']}"] = {"value": r["ratio_to_floor"], "target": limit,
                                                            "met": r["ratio_to_floor"] <= limit}
        if r["method"].startswith("signed-") and r["context"] in TARGET_FLOOR_CONTEXTS:
            targets[f"signed_ratio_{r['method'].removeprefix('signed-')}_{r['context']}"] = {
                "value": r["ratio_to_unsigned"], "target": TARGET_SIGNED_RATIO,
                "met": r["ratio_to_unsigned"] <= TARGET_SIGNED_RATIO}
    return targets


async def _measure(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from service import threads  # noqa: PLC0415
    from service.engines import load_engine  # noqa: PLC0415

    threads.one_core()  # this thread runs the event loop, as in a pod; models run on the compute thread
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()] + ([LONG_CONTEXT] if args.long else [])
    every = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.engine != "hf":  # before any engine is loaded: a q8_0 cache cannot run without flash attention
        from service.engines import kv_cache_type  # noqa: PLC0415
        from service.engines.base import check_flash_attn  # noqa: PLC0415

        for mode in every:
            check_flash_attn(args.flash_attn, kv_cache_type(mode))
    groups: dict[str, list[str]] = {}  # the modes each engine runs (a llama.cpp pod's cache type follows its codec)
    for mode in every:
        groups.setdefault(_cache_suffix(f"kvstash-{mode}") if args.engine != "hf" else "", []).append(mode)
    rows: list[dict[str, Any]] = []
    profile: dict[str, Any] = {}
    for suffix, modes in groups.items():
        engine = threads.compute_executor().submit(load_engine, args.engine, args.model, parallel=1,
                                                   codec=modes[0], flash_attn=args.flash_attn).result()
        try:
            await _measure_engine(args, ResumeBench(engine, url, args), contexts, modes, suffix, rows, profile,
                                  burst=args.burst if modes[0] == every[0] else 0)
        finally:
            engine.close()
    return rows, profile


def _cache_suffix(method: str) -> str:
    """What a hit's or floor's recompute is called after "recompute" on a llama.cpp engine: "-" and the KV cache type
    its codec runs (`kv_cache_type`: "-q8_0" for q8), "" for an f16 cache and for every other method."""
    from service.engines import kv_cache_type  # noqa: PLC0415

    if not method.startswith(("kvstash-", "floor-")):
        return ""
    kind = kv_cache_type(method.split("-", 1)[1])
    return "" if kind == "f16" else f"-{kind}"


async def _measure_engine(args: argparse.Namespace, bench: ResumeBench, contexts: list[int], modes: list[str],
                          suffix: str, rows: list[dict[str, Any]], profile: dict[str, Any], burst: int) -> None:
    engine = bench.engine
    ids = _prompt_ids(engine, max([*contexts, BURST_CONTEXT if burst else 0]) + 1)
    max_context = engine.geometry.max_context
    for context in contexts:
        if context % args.block_tokens or context + 1 >= max_context:
            raise SystemExit(f"context {context}: must be a multiple of {args.block_tokens} below "
                             f"{max_context - 1}")
        prompt = ids[:context + 1]
        times, kv = bench.recompute(prompt)
        rows.append(_row(context, "recompute" + suffix, times, 0))
        print(f"context {context}: recompute p50 {rows[-1]['ttft_ms_p50']:.0f} ms", flush=True)
        for mode in modes:
            measured = await bench.kvstash(mode, prompt, kv)
            rows += measured
            hit, floor = measured[:2]
            print(f"context {context}: {hit['method']} p50 {hit['ttft_ms_p50']:.1f} ms, "
                  f"floor {floor['ttft_ms_p50']:.1f} ms"
                  + "".join(f", {r['method']} p50 {r['ttft_ms_p50']:.1f} ms ({r['ratio_to_unsigned']:.3f}x paired)"
                            for r in measured[2:]), flush=True)
        if args.engine == "llama-server":
            rows.append(bench.slot_restore(prompt, kv))
            print(f"context {context}: slot-file-tmpfs p50 {rows[-1]['ttft_ms_p50']:.1f} ms", flush=True)
        if not args.no_naive and bench.loaded is not None:
            rows.append(bench.compute(bench.naive, prompt, kv))
        if args.profile and bench.loaded is not None:
            for mode in modes:
                profile[f"{mode}@{context}"] = await bench.profile(mode, prompt, kv)
    if burst:
        length = min(BURST_CONTEXT, (max_context - 2) // args.block_tokens * args.block_tokens)
        step = max(1, len(ids) // (burst + 1))  # a different history per session
        prompts = [(ids[i * step:] + ids)[:length + 1] for i in range(burst)]
        measured = await bench.burst(modes[0], prompts)
        rows += measured
        for r in measured:
            print(f"burst of {burst} at {length} tokens: {r['method']} TTFT p50 {r['ttft_ms_p50']:.0f} ms, "
                  f"p99 {r['ttft_ms_p99']:.0f} ms", flush=True)


def run(args: argparse.Namespace) -> int:
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    before = machine()
    server = None
    url = args.redis_url
    if not url:
        server = RedisProcess().start()
        url = server.url
    try:
        rows, profile = asyncio.run(_measure(args, url))
    finally:
        if server is not None:
            server.cleanup()
    _finish(rows)
    print_table(rows, [("context", "context", "d"), ("method", "method", ""), ("ttft_ms_p50", "p50 ms", ".1f"),
                       ("ttft_ms_p90", "p90 ms", ".1f"), ("bytes", "bytes", ",d"),
                       ("speedup_vs_recompute", "speedup", ".1f"), ("ratio_to_floor", "vs floor", ".2f"),
                       *([("ratio_to_unsigned", "vs unsigned", ".3f")] if args.frame_key else [])])
    for name, phases in profile.items():
        print(f"{name} hit, median ms per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    targets = _targets(rows, args.engine)
    for name, t in targets.items():
        print(f"target {name}: {t['value']:.2f} (target {t['target']}) {'met' if t['met'] else 'MISSED'}")
    if args.json:
        write_json(args.json, {"rows": rows, "targets": targets, "profile": profile, "model": args.model,
                               "engine": args.engine,
                               "repeat": args.repeat, "recompute_repeat": args.recompute_repeat,
                               "machine_before": before, "machine_after": machine()})
    if args.plot:
        methods = list(dict.fromkeys(r["method"] for r in rows))
        series = {m: ([r["context"] for r in rows if r["method"] == m], [r["ttft_ms_p50"] for r in rows
                                                                          if r["method"] == m]) for m in methods}
        plot_lines(args.plot, series, title=f"Resume TTFT vs context ({args.engine}, {args.model}, CPU)",
                   xlabel="history tokens", ylabel="TTFT p50 (ms, log)", logx=True, logy=True)
    return 0
