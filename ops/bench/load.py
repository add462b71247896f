"""`kvstash bench load`: concurrent multi-turn chat sessions over P pods, kvstash against its alternatives.

Each session starts with notes unique to it (a window of ops/data/sample.txt in its system prompt),
so its first turn is a miss; every later turn resends the whole conversation (the OpenAI way, with no
session id unless --session-header) and can reuse everything the previous turn processed, wherever it ran.
The best possible hit for turn k is the previous turn's prompt + reply (less the last reply token,
which is never fed); hit rate = cached tokens / that. S sessions run at once, T turns each, with a
short think time between turns; the generator is bounded by --deadline-s and always terminates.

Runs: kvstash (Redis, round robin), then the baselines: `off` (no cache, round robin) and `sticky` (each pod
keeps KV in its own memory, `kvstash serve --memory-kv-bytes`, and nginx hashes X-Session-Id consistently, so a
session stays on one pod). `--skew` makes a few sessions heavy; `--restart-pod-at` kills a pod mid-run.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.bench import loadstats
from ops.bench.common import SAMPLE_TEXT, machine, plot_bars, write_json
from ops.bench.restart import PodRestarter, RestartAt
from ops.bench.routing import ConsistentHash, RoundRobin, Router, ViaBalancer

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
BASELINES = ("off", "sticky")
RUN_LABELS = {"kvstash": "kvstash (round robin)", "sticky": "sticky sessions", "off": "cache OFF"}
STICKY_HEADER = "X-Session-Id"  # what nginx hashes in the sticky run (every request of it carries one)
HEAVY_NOTES, HEAVY_TURNS = 4, 2  # --skew: a heavy session's notes and turns, times a light one's
RETRIES = 2  # a turn whose pod died under it (502, connection reset) is sent again, as a client would
_METRIC = re.compile(r'^(kvstash_[a-z_]+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$')


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("load", help="S concurrent sessions x T turns over P pods: kvstash against "
                                    "cache off and sticky sessions")
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
    p.add_argument("--baseline", default="off",
                   help="runs after kvstash's, comma-separated: off (cache disabled, round robin; the default), "
                        "sticky (pod-local in-memory KV, nginx hash on X-Session-Id consistent)")
    p.add_argument("--no-baseline", action="store_true", help="only the kvstash run")
    p.add_argument("--memory-kv-mb", type=int, default=0,
                   help="sticky: KV each pod keeps in memory, MiB (default: --budget-mb, per pod)")
    p.add_argument("--skew", action="store_true",
                   help=f"a few heavy sessions (one in five, at least one) among light ones: {HEAVY_NOTES}x the "
                        f"notes and {HEAVY_TURNS}x the turns (at most {len(QUESTIONS)}); TTFT reported apart")
    p.add_argument("--restart-pod-at", type=_restart_at, metavar="WHEN",
                   help="kill -9 the busiest pod mid-run and start it again on its port, in every run: seconds "
                        "into the run (30) or once a share of the turns is done (40%%)")
    p.add_argument("--session-header", action="store_true",
                   help="send X-Session-Id (server-side partial blocks); default: stateless, as the OpenAI "
                        "clients send the whole history and no session id")
    p.add_argument("--json", type=Path, help="write the summary and every turn as JSON here")
    p.add_argument("--plot", type=Path, help="TTFT p50/p99 by turn kind, one bar per run (PNG)")
    p.set_defaults(func=run)


def _restart_at(text: str) -> RestartAt:
    try:
        return RestartAt.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _notes(session: int, doc_tokens: int) -> str:
    text = " ".join(SAMPLE_TEXT.read_text(encoding="utf-8").split())
    chars = min(len(text) - 1, int(doc_tokens * CHARS_PER_TOKEN))
    start = (session * 997) % max(1, len(text) - chars)
    return text[start:start + chars]


@dataclass(frozen=True)
class SessionPlan:
    index: int
    doc_tokens: int
    turns: int
    heavy: bool

    @property
    def key(self) -> str:
        return f"load-{self.index}"


def plan_sessions(args: argparse.Namespace) -> list[SessionPlan]:
    """--sessions conversations; with --skew the first one in five (at least one) is heavy."""
    heavy = max(1, args.sessions // 5) if args.skew else 0
    return [SessionPlan(i, args.doc_tokens * HEAVY_NOTES, min(len(QUESTIONS), args.turns * HEAVY_TURNS), True)
            if i < heavy else SessionPlan(i, args.doc_tokens, args.turns, False) for i in range(args.sessions)]


def _session(
    plan: SessionPlan, args: argparse.Namespace, router: Router, started: float, deadline: float,
    restarter: PodRestarter | None, send_session_id: bool,
) -> list[dict[str, Any]]:
    """One conversation of `plan.turns` turns, each sent where the router says."""
    import httpx  # noqa: PLC0415

    from ops.chatclient import stream_chat  # noqa: PLC0415

    messages = [{"role": "system", "content": f"Session {plan.index}. Answer briefly from these notes.\n\n"
                                              f"{_notes(plan.index, plan.doc_tokens)}"}]
    rows: list[dict[str, Any]] = []
    previous_seq = 0
    headers = {STICKY_HEADER: plan.key} if send_session_id else {}
    with httpx.Client(timeout=300) as client:
        for turn in range(1, plan.turns + 1):
            if time.monotonic() > deadline:
                break
            messages.append({"role": "user", "content": QUESTIONS[turn - 1]})
            body = {"model": args.model_name, "messages": messages, "max_tokens": args.max_tokens,
                    "temperature": 0}
            t0 = time.monotonic()
            base = {"session": plan.index, "turn": turn, "heavy": plan.heavy, "started": t0,
                    "started_s": t0 - started}
            res, error = None, ""
            for attempt in range(RETRIES + 1):
                if attempt:
                    time.sleep(0.5)
                sent, url = time.monotonic(), router.pick(plan.key)
                try:
                    res = stream_chat(client, url, body, headers=headers)
                except Exception as exc:  # noqa: BLE001 - every failure is counted: a retry, then an error row
                    res, error = None, f"{type(exc).__name__}: {exc}"
                    router.failed(url)
                    continue
                if res.status != 502:
                    break
                router.failed(url)
            base.update(retries=attempt, ended_s=time.monotonic() - started)
            if res is None:
                rows.append({**base, "status": 0, "error": error})
                break
            waited_ms = (sent - t0) * 1000  # a retried turn's user waited through the failed tries too
            row = {**base, "status": res.status, "pod": res.pod, "cache": res.cache,
                   "ttft_ms": waited_ms + res.ttft_ms, "total_ms": waited_ms + res.total_ms,
                   "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                   "completion_tokens": res.completion_tokens,
                   "cacheable_tokens": min(previous_seq, max(0, res.prompt_tokens - 1))}
            rows.append(row)
            if restarter is not None and res.status == 200:
                restarter.turn_done(res.pod)
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
def fleet_pods(
    args: argparse.Namespace, redis_url: str, kind: str, namespace: str, parallel: int
) -> Iterator[tuple[list[Any], Any]]:
    """The run's pods and nginx: kvstash pods (Redis) or cache-off pods behind a round robin, or pods keeping KV
    in their own memory behind a consistent hash on the session (sticky)."""
    import os  # noqa: PLC0415

    from ops.pods import NginxProcess, PodProcess, ProcessError, nginx_binary  # noqa: PLC0415

    threads = args.threads_per_pod or max(1, (os.cpu_count() or 1) // args.pods)
    extra: tuple[str, ...] = ("--codec", args.codec, "--max-queue", str(args.sessions + 4), "--namespace", namespace,
             "--budget-bytes", str(args.budget_mb << 20), "--redis-timeout-s", "2", "--engine", args.engine,
             "--parallel", str(parallel), "--threads", str(threads))
    if getattr(args, "flash_attn", "auto") != "auto":
        extra += ("--flash-attn", args.flash_attn)
    if kind == "sticky":
        extra += ("--memory-kv-bytes", str((args.memory_kv_mb or args.budget_mb) << 20))
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    pods = [PodProcess(f"pod-{chr(ord('a') + i)}", redis_url, args.model, extra, no_cache=kind != "kvstash", env=env)
            for i in range(args.pods)]
    balancer = None
    try:
        for pod in pods:
            pod.start()
        for pod in pods:
            pod.wait_ready()
        if nginx_binary() is not None:
            try:
                balancer = NginxProcess([f"127.0.0.1:{p.port}" for p in pods],
                                        hash_header=STICKY_HEADER if kind == "sticky" else None).start()
            except ProcessError as exc:
                print(f"nginx could not start ({exc}); the client routes to the pods itself", flush=True)
        yield pods, balancer
    finally:
        if balancer is not None:
            balancer.cleanup()
        for pod in pods:
            pod.cleanup()


def router_for(kind: str, pods: list[Any], balancer: Any) -> Router:
    if balancer is not None:
        return ViaBalancer(str(balancer.url), "nginx (hash $http_x_session_id consistent)" if kind == "sticky"
                           else "nginx (round robin)")
    urls = [str(p.url) for p in pods]
    return ConsistentHash(urls) if kind == "sticky" else RoundRobin(urls)


def _drive(
    args: argparse.Namespace, kind: str, pods: list[Any], router: Router
) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
    plans = plan_sessions(args)
    start = time.monotonic()
    deadline = start + args.deadline_s
    restarter = (PodRestarter(args.restart_pod_at, pods, sum(p.turns for p in plans), start).start()
                 if args.restart_pod_at else None)
    with ThreadPoolExecutor(max_workers=len(plans)) as pool:
        futures = [pool.submit(_session, plan, args, router, start, deadline, restarter,
                               kind == "sticky" or args.session_header) for plan in plans]
        rows = [row for f in futures for row in f.result()]
    wall = time.monotonic() - start
    return rows, wall, restarter.finish() if restarter else {}


def _one_run(
    args: argparse.Namespace, redis_url: str, kind: str, parallel: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from cachestore.syncstore import SyncBlockStore  # noqa: PLC0415

    cache = kind == "kvstash"
    namespace = f"load-cache-p{parallel}" if cache else f"load-{kind}"
    label = RUN_LABELS[kind] + f", parallel {parallel}"
    with fleet_pods(args, redis_url, kind, namespace, parallel) as (pods, balancer):
        router = router_for(kind, pods, balancer)
        print(f"[{label}] {len(pods)} pods ready; {router.name}; {args.sessions} sessions x {args.turns} turns"
              + (" (skewed)" if args.skew else ""), flush=True)
        rows, wall, restart = _drive(args, kind, pods, router)
        time.sleep(1.0)  # let the last background writes land before reading the store
        metrics = _scrape([p.url for p in pods])
    summary = {"run": kind, "label": label, "cache": cache, **loadstats.summary(rows, wall)}
    if args.skew:
        summary.update(loadstats.skew(rows))
    if args.restart_pod_at:
        summary["restart"] = restart
        summary.update(loadstats.after_kill(rows, restart))
    summary["balancer"] = router.name
    summary["engine"], summary["parallel"] = args.engine, parallel
    summary["evictions"] = metrics.get('kvstash_store_events{event="evictions"}', 0.0)
    summary["store_errors"] = metrics.get('kvstash_store_events{event="errors"}', 0.0)
    summary["writes_dropped"] = sum(v for k, v in metrics.items() if k.startswith("kvstash_writes_dropped"))
    summary["budget_bytes"] = args.budget_mb << 20
    summary["bytes_held"] = 0
    if kind == "sticky":  # summed over the pods; a restarted pod counts only what it kept since
        summary["bytes_held"] = metrics.get("kvstash_cache_bytes_held", 0.0)
        summary["budget_bytes"] = (args.memory_kv_mb or args.budget_mb) << 20  # per pod
    if cache:
        settings = StoreSettings.from_url(redis_url, namespace=namespace, budget_bytes=args.budget_mb << 20)
        with SyncBlockStore(settings) as store:
            usage = store.usage()
        summary["bytes_held"], summary["blocks_held"] = usage.bytes_held, usage.blocks
    print(f"[{label}] {summary['ok']}/{summary['requests']} ok in {wall:.1f} s; lookups {summary['lookup_results']}"
          + (f"; restart {restart}" if restart else ""), flush=True)
    return summary, rows


def _baselines(args: argparse.Namespace) -> list[str]:
    if args.no_baseline:
        return []
    wanted = [b.strip() for b in str(args.baseline).split(",") if b.strip() and b.strip() != "none"]
    unknown = [b for b in wanted if b not in BASELINES]
    if unknown:
        raise SystemExit(f"--baseline takes {', '.join(BASELINES)} (comma-separated), not {', '.join(unknown)}")
    return list(dict.fromkeys(wanted))


def run(args: argparse.Namespace) -> int:
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    if not 1 <= args.turns <= len(QUESTIONS):
        raise SystemExit(f"--turns must be in 1..{len(QUESTIONS)}")
    baselines = _baselines(args)
    if args.engine == "llamacpp" and args.model != "smollm2":
        args.model_name = Path(args.model).stem  # a llama.cpp pod answers to the GGUF file's name
    else:
        args.model_name = Path(args.model).name if "/" in args.model else args.model
    try:
        parallels = [int(p) for p in str(args.parallel).split(",") if p.strip()]
    except ValueError:
        raise SystemExit("--parallel takes a number or a comma-separated list of numbers") from None
    before = machine()
    redis = RedisProcess(extra_args=("--maxmemory", f"{2 * args.budget_mb + 256}mb",
                                     "--maxmemory-policy", "allkeys-lru")).start()
    runs: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    try:
        plan = [("kvstash", p) for p in parallels] + [(b, parallels[-1]) for b in baselines]
        for kind, parallel in plan:
            summary, rows = _one_run(args, redis.url, kind, parallel)
            runs.append(summary)
            turns += [{**r, "run": kind, "cache_enabled": kind == "kvstash", "parallel": parallel} for r in rows]
    finally:
        redis.cleanup()
    loadstats.print_report(runs, args.skew, args.restart_pod_at.describe() if args.restart_pod_at else None)
    on = runs[len(parallels) - 1]  # the cache-on run with the most parallel sequences
    print(f"Redis holds {on['bytes_held'] / 1e6:.1f} MB of a {on['budget_bytes'] / 1e6:.0f} MB budget; "
          f"{on['evictions']:.0f} evictions, {on['store_errors']:.0f} store errors, "
          f"{on['writes_dropped']:.0f} writes dropped")
    for r in runs:
        if r["run"] == "sticky":
            print(f"sticky pods hold {r['bytes_held'] / 1e6:.1f} MB of KV in memory together (at most "
                  f"{r['budget_bytes'] / 1e6:.0f} MB each)")
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
                               "machine_after": machine(), "args": {
                                   k: v.describe() if isinstance(v, RestartAt) else v for k, v in vars(args).items()
                                   if k != "func" and not isinstance(v, Path)}})
    if args.plot:
        labels = ["turn 1 p50", "turns 2+ p50", "turns 2+ p99"]
        keys = ["ttft_ms_first_turn_p50", "ttft_ms_later_turns_p50", "ttft_ms_later_turns_p99"]
        if args.restart_pod_at:
            labels, keys = labels + ["after kill p50", "after kill p99"], keys + ["after_kill_ttft_ms_p50",
                                                                              "after_kill_ttft_ms_p99"]
        groups = {r["label"]: [r.get(k, 0.0) for k in keys] for r in runs}
        plot_bars(args.plot, labels, groups, title=f"TTFT under load: {args.sessions} sessions, {args.pods} pods"
                  + (", skewed" if args.skew else ""), ylabel="ms")
    return 0
