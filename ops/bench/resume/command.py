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

With --link-gbit the private Redis sits behind a shaped link (ops/netlink.py), the floor's reads over it too; the hit
and floor rows then record the link and their time against its arithmetic (bytes x 8 / rate).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from cachestore.signing import MAC
from ops import netlink, svgchart
from ops.bench.common import SAMPLE_TEXT, check_chart, machine, print_table, write_chart, write_json
from ops.bench.resume.methods import ResumeBench, result_row
from service.engines import ENGINES

CONTEXTS = [256, 512, 1024, 2048, 4096]
LONG_CONTEXT = 8128  # the largest multiple of 64 whose prompt (+1 token) fits SmolLM2's 8192 context
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
TARGET_FLOOR_TO_LINK = 1.10  # over --link-gbit: the floor's reads within 10% of the link's bytes x 8 / rate
TARGET_HIT_MEMORY = 1.3  # what a hit allocates, at most this many times the KV bytes it rebuilds (landing in place)


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("resume", help="TTFT of a resumed session: kvstash vs recompute, naive, floor")
    p.add_argument("--engine", default="hf", choices=list(ENGINES),
                   help="model runtime: hf (transformers, default), llamacpp (recompute = llama.cpp's prefill) or "
                        "llama-server (a spawned llama-server; adds slot-file-tmpfs, its own slot restore)")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), kvgeom-8b/-32b/-70b; hf: tiny-random or a local HF directory; "
                        "llamacpp: a .gguf file")
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
    p.add_argument("--redis-url", help="use this Redis, any URL a pod takes (default: a private redis-server)")
    netlink.add_link_args(p)
    p.add_argument("--frame-key", default="", metavar="KEY",
                   help="also time each hit on a pod that signs its values with this frame key (signed-MODE rows)")
    p.add_argument("--json", type=Path, help="write rows and targets as JSON here")
    p.add_argument("--plot", type=Path, help="draw TTFT vs context length for every method (an .svg file)")
    p.set_defaults(func=run)


def prompt_ids(engine: Any, length: int) -> list[int]:
    ids = engine.text_ids(SAMPLE_TEXT.read_text(encoding="utf-8"))
    return (ids * (-(-length // len(ids))))[:length]



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
        if r.get("hit_memory_bytes") is not None and r["context"] in TARGET_FLOOR_CONTEXTS:
            ratio = r["hit_memory_bytes"] / r["kv_bytes"]
            targets[f"hit_memory_{mode}_{r['context']}"] = {"value": ratio, "target": TARGET_HIT_MEMORY,
                                                           "met": ratio <= TARGET_HIT_MEMORY}
        if r["method"].startswith("signed-") and r["context"] in TARGET_FLOOR_CONTEXTS:
            targets[f"signed_ratio_{r['method'].removeprefix('signed-')}_{r['context']}"] = {
                "value": r["ratio_to_unsigned"], "target": TARGET_SIGNED_RATIO,
                "met": r["ratio_to_unsigned"] <= TARGET_SIGNED_RATIO}
        if r["method"].startswith("floor-") and r.get("to_link") is not None:  # the link is real: its reads, the wire
            targets[f"floor_to_link_{r['method'].removeprefix('floor-')}_{r['context']}"] = {
                "value": r["to_link"], "target": TARGET_FLOOR_TO_LINK,
                "met": abs(r["to_link"] - 1) <= TARGET_FLOOR_TO_LINK - 1}  # within 10%, either way
    return targets


async def _measure(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from service.engines import load_engine  # noqa: PLC0415
    from service.runtime import threads  # noqa: PLC0415

    threads.one_core()  # this thread runs the event loop, as in a pod; models run on the compute thread
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()] + ([LONG_CONTEXT] if args.long else [])
    every = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.engine != "hf":  # before any engine is loaded: a q8_0 cache cannot run without flash attention
        from service.engines.llama import kv_cache_type  # noqa: PLC0415
        from service.engines.llama.gguf import check_flash_attn  # noqa: PLC0415

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
    from service.engines.llama import kv_cache_type  # noqa: PLC0415

    if not method.startswith(("kvstash-", "floor-")):
        return ""
    kind = kv_cache_type(method.split("-", 1)[1])
    return "" if kind == "f16" else f"-{kind}"


async def _measure_engine(args: argparse.Namespace, bench: ResumeBench, contexts: list[int], modes: list[str],
                          suffix: str, rows: list[dict[str, Any]], profile: dict[str, Any], burst: int) -> None:
    engine = bench.engine
    ids = prompt_ids(engine, max([*contexts, BURST_CONTEXT if burst else 0]) + 1)
    max_context = engine.geometry.max_context
    for context in contexts:
        if context % args.block_tokens or context + 1 >= max_context:
            raise SystemExit(f"context {context}: must be a multiple of {args.block_tokens} below "
                             f"{max_context - 1}")
        prompt = ids[:context + 1]
        times, kv = bench.recompute(prompt)
        rows.append(result_row(context, "recompute" + suffix, times, 0))
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
    from ops.bench.rawredis import operator_redis  # noqa: PLC0415
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    check_chart(args.plot)  # every refusal before a model loads
    spec = netlink.spec_of(args)
    if args.redis_url:
        operator_redis(args.redis_url)
    before = machine()
    with netlink.opened(spec) as link:
        server = None if args.redis_url else RedisProcess().start()
        try:
            if link is not None and server is not None:
                link.shape(server.port)
                print(link.describe(), flush=True)
            rows, profile = asyncio.run(_measure(args, args.redis_url or server.url))  # type: ignore[union-attr]
        finally:
            if server is not None:
                server.cleanup()
    _finish(rows)
    for r in rows:
        if r.get("hit_memory_bytes") is not None:
            r["hit_memory_to_kv"] = r["hit_memory_bytes"] / r["kv_bytes"]
    for r in rows:  # a floor's reads alone against the link's arithmetic (its step is not the wire's)
        if spec is not None and r["method"].startswith(("kvstash-", "floor-")):
            r.update(netlink.link_fields(spec, r["bytes"], 1, r.get("fetch_ms_p50", r["ttft_ms_p50"]) / 1000))
    print_table(rows, [("context", "context", "d"), ("method", "method", ""), ("ttft_ms_p50", "p50 ms", ".1f"),
                       ("ttft_ms_p90", "p90 ms", ".1f"), ("bytes", "bytes", ",d"),
                       ("speedup_vs_recompute", "speedup", ".1f"), ("ratio_to_floor", "vs floor", ".2f"),
                       ("hit_memory_to_kv", "memory / KV", ".2f"),
                       *([("fetch_ms_p50", "GETs ms", ".1f"), ("link_ms", "link ms", ".1f"),
                          ("to_link", "vs link", ".2f")] if spec else []),
                       *([("ratio_to_unsigned", "vs unsigned", ".3f")] if args.frame_key else [])])
    for name, phases in profile.items():
        print(f"{name} hit, median ms per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    targets = _targets(rows, args.engine)
    for name, t in targets.items():
        print(f"target {name}: {t['value']:.2f} (target {t['target']}) {'met' if t['met'] else 'MISSED'}")
    if args.json:
        write_json(args.json, {"rows": rows, "targets": targets, "profile": profile, "model": args.model,
                               "engine": args.engine, **({"mac": MAC} if args.frame_key else {}),
                               **({"link": link.as_json()} if link is not None else {}),
                               "repeat": args.repeat, "recompute_repeat": args.recompute_repeat,
                               "machine_before": before, "machine_after": machine()})
    if args.plot:
        contexts = sorted({r["context"] for r in rows})
        ttft = {(r["method"], r["context"]): r["ttft_ms_p50"] for r in rows}
        series = {m: [ttft.get((m, c)) for c in contexts] for m in dict.fromkeys(r["method"] for r in rows)}
        write_chart(args.plot, svgchart.lines([f"{c:,}" for c in contexts], series, log=True,
                                              title=f"Resume TTFT vs context ({args.engine}, {args.model})",
                                              xlabel="history tokens", ylabel="TTFT p50, ms (log)"))
    return 0
