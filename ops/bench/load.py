"""`kvstash bench load`: concurrent multi-turn chat sessions over P pods behind a round robin, cache on vs off.

Each session starts with notes unique to it (a window of ops/data/sample.txt in its system prompt),
so its first turn is a miss; every later turn resends the whole conversation (the OpenAI way, with no
session id unless --session-header) and can reuse everything the previous turn processed, wherever it ran.
The best possible hit for turn k is the previous turn's prompt + reply (less the last reply token,
which is never fed); hit rate = cached tokens / that. S sessions run at once, T turns each, with a
short think time between turns; the generator is bounded by --deadline-s and always terminates.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ops.bench.common import SAMPLE_TEXT, machine, percentile, plot_bars, print_table, write_json

QUESTIONS = [
    "Summarise these notes in two sentences.",
    "Who or what is the main subject of the notes?",
    "Quote the single most important phrase.",
    "What would a sceptical reader object to?",
    "Give three keywords for the notes.",
    "Rewrite the first sentence in plain words.",
    "What happened next, in your view?",
    "End with a one-line summary.",
]
CHARS_PER_TOKEN = 4.4  # English prose under SmolLM2's tokenizer, measured on sample.txt
_METRIC = re.compile(r'^(kvstash_[a-z_]+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$')


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("load", help="S concurrent sessions x T turns over P pods, cache on vs off")
    p.add_argument("--pods", type=int, default=3, help="caching pods behind the balancer (default 3)")
    p.add_argument("--sessions", type=int, default=32, help="concurrent sessions (default 32)")
    p.add_argument("--turns", type=int, default=5, help=f"turns per session (default 5, at most {len(QUESTIONS)})")
    p.add_argument("--max-tokens", type=int, default=16, help="reply tokens per turn (default 16)")
    p.add_argument("--doc-tokens", type=int, default=384, help="tokens of session notes (default ~384)")
    p.add_argument("--think-ms", type=int, default=300, help="pause between a reply and the next turn (default 300)")
    p.add_argument("--engine", default="hf", choices=["hf", "llamacpp"], help="model runtime of the pods (default hf)")
    p.add_argument("--parallel", default="4",
                   help="llamacpp: sequences each pod decodes together; a list (e.g. 1,4) runs each in turn "
                        "and reports the batching speedup (default 4)")
    p.add_argument("--model", default="smollm2", help="model the pods serve (default smollm2)")
    p.add_argument("--codec", default="int8", help="codec of the cached blocks (default int8)")
    p.add_argument("--budget-mb", type=int, default=512, help="Redis byte budget of the namespace (default 512)")
    p.add_argument("--threads-per-pod", type=int, default=0,
                   help="torch threads per pod (default: cores / pods, at least 1)")
    p.add_argument("--deadline-s", type=float, default=600.0, help="stop starting turns after this (default 600)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run with the cache disabled")
    p.add_argument("--session-header", action="store_true",
                   help="send X-Session-Id (server-side partial blocks); default: stateless, as the OpenAI "
                        "clients send the whole history and no session id")
    p.add_argument("--json", type=Path, help="write the summary and every turn as JSON here")
    p.add_argument("--plot", type=Path, help="TTFT p50/p99 by turn kind, cache on vs off (PNG)")
    p.set_defaults(func=run)


def _notes(session: int, doc_tokens: int) -> str:
    text = " ".join(SAMPLE_TEXT.read_text(encoding="utf-8").split())
    chars = min(len(text) - 1, int(doc_tokens * CHARS_PER_TOKEN))
    start = (session * 997) % max(1, len(text) - chars)
    return text[start:start + chars]


def _session(idx: int, args: argparse.Namespace, pick: Any, deadline: float) -> list[dict[str, Any]]:
    """One conversation of --turns turns; every turn is sent to the next pod of the rotation."""
    import httpx  # noqa: PLC0415

    from ops.chatclient import stream_chat  # noqa: PLC0415

    messages = [{"role": "system", "content": f"Session {idx}. Answer briefly from these notes.\n\n"
                                              f"{_notes(idx, args.doc_tokens)}"}]
    rows: list[dict[str, Any]] = []
    previous_seq = 0
    with httpx.Client(timeout=300) as client:
        for turn in range(1, args.turns + 1):
            if time.monotonic() > deadline:
                break
            messages.append({"role": "user", "content": QUESTIONS[turn - 1]})
            body = {"model": args.model_name, "messages": messages, "max_tokens": args.max_tokens,
                    "temperature": 0}
            t0 = time.monotonic()
            try:
                headers = {"X-Session-Id": f"load-{idx}"} if args.session_header else {}
                res = stream_chat(client, pick(), body, headers=headers)
            except Exception as exc:  # noqa: BLE001 - every failure is counted as an error row
                rows.append({"session": idx, "turn": turn, "status": 0, "error": f"{type(exc).__name__}: {exc}",
                             "started": t0})
                break
            row = {"session": idx, "turn": turn, "status": res.status, "pod": res.pod, "cache": res.cache,
                   "ttft_ms": res.ttft_ms, "total_ms": res.total_ms, "prompt_tokens": res.prompt_tokens,
                   "cached_tokens": res.cached_tokens, "completion_tokens": res.completion_tokens,
                   "cacheable_tokens": min(previous_seq, max(0, res.prompt_tokens - 1)), "started": t0}
            rows.append(row)
            if res.status != 200:
                row["error"] = res.text[:200]
                break
            previous_seq = res.prompt_tokens + max(0, res.completion_tokens - 1)
            messages.append({"role": "assistant", "content": res.text})
            time.sleep(args.think_ms / 1000)
    return rows


def _scrape(urls: list[str]) -> dict[str, float]:
    """Sum of every kvstash_* metric sample over the pods, keyed by name{labels}."""
    import httpx  # noqa: PLC0415

    totals: dict[str, float] = {}
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            m = _METRIC.match(line)
            if m:
                key = m[1] + (m[2] or "")
                totals[key] = totals.get(key, 0.0) + float(m[3])
    return totals


@contextlib.contextmanager
def _pods(
    args: argparse.Namespace, redis_url: str, cache: bool, namespace: str, parallel: int
) -> Iterator[tuple[list[Any], Any]]:
    import os  # noqa: PLC0415

    from ops.pods import NginxProcess, PodProcess, ProcessError, nginx_binary  # noqa: PLC0415

    threads = args.threads_per_pod or max(1, (os.cpu_count() or 1) // args.pods)
    extra = ("--codec", args.codec, "--max-queue", str(args.sessions + 4), "--namespace", namespace,
             "--budget-bytes", str(args.budget_mb << 20), "--redis-timeout-s", "2", "--engine", args.engine,
             "--parallel", str(parallel), "--threads", str(threads))
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    pods = [PodProcess(f"pod-{chr(ord('a') + i)}", redis_url, args.model, extra, no_cache=not cache, env=env)
            for i in range(args.pods)]
    balancer = None
    try:
        for pod in pods:
            pod.start()
        for pod in pods:
            pod.wait_ready()
        if nginx_binary() is not None:
            try:
                balancer = NginxProcess([f"127.0.0.1:{p.port}" for p in pods]).start()
            except ProcessError as exc:
                print(f"nginx could not start ({exc}); the client rotates over the pods itself", flush=True)
        yield pods, balancer
    finally:
        if balancer is not None:
            balancer.cleanup()
        for pod in pods:
            pod.cleanup()


def _drive(args: argparse.Namespace, pods: list[Any], balancer: Any) -> tuple[list[dict[str, Any]], float]:
    if balancer is not None:
        def pick() -> str:
            return str(balancer.url)
    else:
        rotation = itertools.cycle([p.url for p in pods])
        lock = threading.Lock()

        def pick() -> str:
            with lock:
                return str(next(rotation))
    start = time.monotonic()
    deadline = start + args.deadline_s
    with ThreadPoolExecutor(max_workers=args.sessions) as pool:
        futures = [pool.submit(_session, i, args, pick, deadline) for i in range(args.sessions)]
        rows = [row for f in futures for row in f.result()]
    return rows, time.monotonic() - start


def _summary(rows: list[dict[str, Any]], wall_s: float, cache: bool) -> dict[str, Any]:
    ok = [r for r in rows if r.get("status") == 200]
    first = [r["ttft_ms"] for r in ok if r["turn"] == 1]
    later = [r["ttft_ms"] for r in ok if r["turn"] > 1]
    hits = [r["ttft_ms"] for r in ok if r.get("cache") == "hit"]
    misses = [r["ttft_ms"] for r in ok if r.get("cache") in ("miss", "bypass")]
    cacheable = sum(r["cacheable_tokens"] for r in ok)
    cached = sum(min(r["cached_tokens"], r["cacheable_tokens"]) for r in ok)
    kinds: dict[str, int] = {}
    for r in ok:
        kinds[r["cache"]] = kinds.get(r["cache"], 0) + 1
    return {
        "cache": cache, "requests": len(rows), "ok": len(ok), "errors": len(rows) - len(ok), "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "completion_tokens_per_s": sum(r["completion_tokens"] for r in ok) / wall_s if wall_s else 0.0,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "cacheable_tokens": cacheable, "hit_rate_vs_possible": cached / cacheable if cacheable else 0.0,
        "lookup_results": kinds, "pods_used": sorted({r["pod"] for r in ok}),
        "ttft_ms_hit_p50": percentile(hits, 0.5), "ttft_ms_hit_p99": percentile(hits, 0.99), "hits": len(hits),
        "ttft_ms_miss_p50": percentile(misses, 0.5), "ttft_ms_miss_p99": percentile(misses, 0.99),
        "misses": len(misses),
        "ttft_ms_first_turn_p50": percentile(first, 0.5), "ttft_ms_first_turn_p99": percentile(first, 0.99),
        "ttft_ms_later_turns_p50": percentile(later, 0.5), "ttft_ms_later_turns_p99": percentile(later, 0.99),
    }


def _one_run(
    args: argparse.Namespace, redis_url: str, cache: bool, parallel: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from cachestore.syncstore import SyncBlockStore  # noqa: PLC0415

    namespace = f"load-cache-p{parallel}" if cache else "load-nocache"
    label = ("cache on" if cache else "cache OFF") + (f", parallel {parallel}" if args.engine != "hf" else "")
    with _pods(args, redis_url, cache, namespace, parallel) as (pods, balancer):
        route = f"nginx {balancer.url}" if balancer else "client-side round robin (nginx not installed)"
        print(f"[{label}] {len(pods)} pods ready; {route}; {args.sessions} sessions x {args.turns} turns", flush=True)
        rows, wall = _drive(args, pods, balancer)
        time.sleep(1.0)  # let the last background writes land before reading the store
        metrics = _scrape([p.url for p in pods])
    summary = _summary(rows, wall, cache)
    summary["balancer"] = "nginx" if balancer else "client round robin"
    summary["engine"], summary["parallel"] = args.engine, parallel if args.engine != "hf" else 1
    summary["evictions"] = metrics.get('kvstash_store_events{event="evictions"}', 0.0)
    summary["store_errors"] = metrics.get('kvstash_store_events{event="errors"}', 0.0)
    summary["writes_dropped"] = sum(v for k, v in metrics.items() if k.startswith("kvstash_writes_dropped"))
    summary["budget_bytes"] = args.budget_mb << 20
    summary["bytes_held"] = 0
    if cache:
        settings = StoreSettings.from_url(redis_url, namespace=namespace, budget_bytes=args.budget_mb << 20)
        with SyncBlockStore(settings) as store:
            usage = store.usage()
        summary["bytes_held"], summary["blocks_held"] = usage.bytes_held, usage.blocks
    print(f"[{label}] {summary['ok']}/{summary['requests']} ok in {wall:.1f} s; lookups {summary['lookup_results']}",
          flush=True)
    return summary, rows


def run(args: argparse.Namespace) -> int:
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    if not 1 <= args.turns <= len(QUESTIONS):
        raise SystemExit(f"--turns must be in 1..{len(QUESTIONS)}")
    if args.engine == "llamacpp" and args.model != "smollm2":
        args.model_name = Path(args.model).stem  # a llama.cpp pod answers to the GGUF file's name
    else:
        args.model_name = Path(args.model).name if "/" in args.model else args.model
    try:
        parallels = [int(p) for p in str(args.parallel).split(",") if p.strip()]
    except ValueError:
        raise SystemExit("--parallel takes a number or a comma-separated list of numbers") from None
    if args.engine == "hf":
        parallels = [1]  # transformers pods run one generation at a time
    before = machine()
    redis = RedisProcess(extra_args=("--maxmemory", f"{2 * args.budget_mb + 256}mb",
                                     "--maxmemory-policy", "allkeys-lru")).start()
    runs: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    try:
        plan = [(True, p) for p in parallels] + ([] if args.no_baseline else [(False, parallels[-1])])
        for cache, parallel in plan:
            summary, rows = _one_run(args, redis.url, cache, parallel)
            runs.append(summary)
            turns += [{**r, "cache_enabled": cache, "parallel": parallel} for r in rows]
    finally:
        redis.cleanup()
    print_table(runs, [("cache", "cache", ""), ("parallel", "par", "d"), ("ok", "ok", "d"), ("errors", "errors", "d"),
                       ("requests_per_s", "req/s", ".2f"), ("completion_tokens_per_s", "tok/s", ".1f"),
                       ("ttft_ms_first_turn_p50", "turn1 p50", ".0f"), ("ttft_ms_later_turns_p50", "turn2+ p50", ".0f"),
                       ("ttft_ms_later_turns_p99", "turn2+ p99", ".0f"), ("ttft_ms_hit_p50", "hit p50", ".0f"),
                       ("ttft_ms_hit_p99", "hit p99", ".0f"), ("ttft_ms_miss_p50", "miss p50", ".0f"),
                       ("hit_rate_vs_possible", "hit rate", ".3f"), ("evictions", "evict", ".0f")])
    on = runs[len(parallels) - 1]  # the cache-on run with the most parallel sequences
    print(f"Redis holds {on['bytes_held'] / 1e6:.1f} MB of a {on['budget_bytes'] / 1e6:.0f} MB budget; "
          f"{on['evictions']:.0f} evictions, {on['store_errors']:.0f} store errors, "
          f"{on['writes_dropped']:.0f} writes dropped")
    targets = {
        "hit_rate_vs_possible": {"value": on["hit_rate_vs_possible"], "target": 0.95,
                                 "met": on["hit_rate_vs_possible"] >= 0.95},
        "hit_p99_under_miss_p50": {"value": [on["ttft_ms_hit_p99"], on["ttft_ms_miss_p50"]],
                                   "met": 0 < on["ttft_ms_hit_p99"] < on["ttft_ms_miss_p50"]},
    }
    one = next((r for r in runs if r["cache"] and r["parallel"] == 1), None)
    if one is not None and on is not one and one["completion_tokens_per_s"]:
        speedup = on["completion_tokens_per_s"] / one["completion_tokens_per_s"]
        targets["batching_speedup"] = {"value": speedup, "target": 2.5, "met": speedup >= 2.5,
                                       "parallel": on["parallel"]}
    for name, t in targets.items():
        print(f"target {name}: {t['value']} {'met' if t['met'] else 'MISSED'}")
    if args.json:
        write_json(args.json, {"runs": runs, "targets": targets, "turns": turns, "machine_before": before,
                               "machine_after": machine(), "args": {k: v for k, v in vars(args).items()
                                                                    if k != "func" and not isinstance(v, Path)}})
    if args.plot:
        labels = ["turn 1 p50", "turns 2+ p50", "turns 2+ p99"]
        groups = {(("cache on" if r["cache"] else "cache off") + f" (parallel {r['parallel']})"):
                  [r["ttft_ms_first_turn_p50"], r["ttft_ms_later_turns_p50"],
                                                                 r["ttft_ms_later_turns_p99"]] for r in runs}
        plot_bars(args.plot, labels, groups, title=f"TTFT under load: {args.sessions} sessions, {args.pods} pods",
                  ylabel="ms")
    return 0
