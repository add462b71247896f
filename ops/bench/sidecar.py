"""`kvstash bench sidecar`: what the sidecar costs and gains a client, against llama-server asked directly.

One llama-server on its own ("direct") and two `kvstash sidecar --spawn` pods (A and B, each with its own
llama-server of the same build and flags) share a private Redis. Every request is a streamed chat completion of a
~`--context`-token prompt (a window of ops/data/sample.txt and alice.txt, and a question, after a system line
that differs every time), greedy; TTFT is the time from sending
it to the first content chunk. Each repetition uses another window, so nothing is cached unless the method says so;
direct and sidecar runs are interleaved, so load drifting on the machine touches both alike.

    cold-direct       llama-server, a fresh prompt (its slot holds another one)
    cold-sidecar      sidecar A, a fresh prompt: render and tokenize by llama-server, a Redis miss, the prefill
    resumed-prefill   llama-server, the second turn of a conversation whose slot was erased: a full prefill
    resumed-kept      llama-server, the second turn in the slot that kept the first (sticky routing's best case)
    resumed-sidecar   sidecar B, the second turn of a conversation sidecar A served: its prefix restored from Redis

Targets: cold-sidecar within 5% of cold-direct (p50); resumed-sidecar's speedup over resumed-prefill reported.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ops.bench.common import SAMPLE_TEXT, machine, percentile, print_table, write_json

COLD_TARGET = 1.05  # cold-sidecar p50 / cold-direct p50 at most
QUESTION = "What is this text about? Answer in one sentence."
FOLLOW_UP = "Name one person it mentions."
COLUMNS = [("method", "method", ""), ("prompt_tokens", "prompt", "d"), ("ttft_ms_p50", "TTFT p50 ms", ".0f"),
           ("ttft_ms_p90", "p90 ms", ".0f"), ("processed_p50", "processed", ".0f"),
           ("vs_direct", "vs direct", ".3f"), ("speedup", "speedup", ".1f")]


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("sidecar", help="cold TTFT through the sidecar vs llama-server directly, and a "
                                    "resumed turn on a second sidecar")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a kvgeom model or a .gguf path")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of a cold request (default 2048)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per method (default 3)")
    p.add_argument("--codec", default="exact", help="codec of the sidecars' blocks (default exact)")
    p.add_argument("--threads", type=int, default=2, help="threads of each llama-server (default 2)")
    p.add_argument("--max-tokens", type=int, default=8, help="reply tokens per request (default 8)")
    p.add_argument("--redis-url", help="use this Redis (default: a private redis-server)")
    p.add_argument("--json", type=Path, default=Path("bench-results/sidecar.json"),
                   help="write rows, targets and every run as JSON here")
    p.set_defaults(func=run)


def _stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion: TTFT, the reply, llama-server's timings and the X-KV-* headers."""
    started = time.perf_counter()
    ttft = None
    text, timings, usage = "", dict[str, Any](), dict[str, Any]()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}},
                      timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code} {r.read()[:300]!r}")
        headers = dict(r.headers)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text += piece
            timings = event.get("timings") or timings
            usage = event.get("usage") or usage
    return {"ttft_ms": 1000 * (ttft if ttft is not None else time.perf_counter() - started), "text": text,
            "prompt_tokens": usage.get("prompt_tokens"), "processed": timings.get("prompt_n"),
            "cached_tokens": int(headers.get("x-kv-cached-tokens", 0)), "cache": headers.get("x-kv-cache")}


class Prompts:
    """Conversations of about `context` tokens, each over another window of the sample text."""

    def __init__(self, direct_url: str, context: int) -> None:
        text = SAMPLE_TEXT.read_text() + "\n\n" + (SAMPLE_TEXT.parent / "alice.txt").read_text()
        self.ids = httpx.post(direct_url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"]
        self.url = direct_url
        self.context = context
        self.used = 0
        if len(self.ids) < context + 64:
            raise SystemExit(f"{SAMPLE_TEXT} has {len(self.ids)} tokens, fewer than --context {context}")

    def next(self) -> list[dict[str, str]]:
        """A fresh first turn: the next window (wrapping around, shifted so no two share a first block)."""
        span = self.context - 40  # the template and the question
        start = (self.used * 997) % (len(self.ids) - span)
        self.used += 1
        window = httpx.post(self.url + "/detokenize", json={"tokens": self.ids[start:start + span]},
                            timeout=60).json()["content"]
        return [{"role": "system", "content": f"Reader {self.used}: you answer questions about a text."},
                {"role": "user", "content": f"{window}\n\n{QUESTION}"}]


def _settle(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/readyz", timeout=10).json().get("write_queue"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}: the write queue did not drain")
        time.sleep(0.05)


def _erase(url: str) -> None:
    httpx.post(url + "/slots/0?action=erase", json={}, timeout=30)


def _row(method: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_ms"] for r in runs]
    processed = [r["processed"] for r in runs if r["processed"] is not None]
    return {"method": method, "runs": len(runs), "prompt_tokens": runs[0]["prompt_tokens"],
            "ttft_ms_p50": percentile(ttfts, 0.5), "ttft_ms_p90": percentile(ttfts, 0.9),
            "processed_p50": percentile(processed, 0.5) if processed else None,
            "cached_tokens_p50": percentile([r["cached_tokens"] for r in runs], 0.5), "vs_direct": None,
            "speedup": None}


def _measure(args: argparse.Namespace, redis_url: str) -> dict[str, list[dict[str, Any]]]:
    from ops.sidecarproc import SidecarProcess  # noqa: PLC0415
    from service.engines.llama.llamaserverproc import LlamaServerProcess  # noqa: PLC0415
    from service.engines.llama.models import resolve_gguf  # noqa: PLC0415

    ctx = 2 * args.context + 512  # a second turn fits
    side_args = ("--codec", args.codec, "--ctx-per-slot", str(ctx))
    direct = LlamaServerProcess(resolve_gguf(args.model), Path(tempfile.mkdtemp(prefix="kvstash-bench-direct-")),
                                parallel=1, ctx_per_slot=ctx, threads=args.threads)
    pods = {name: SidecarProcess(f"bench-{name}", redis_url, args.model, side_args, parallel=1, threads=args.threads)
            for name in ("a", "b")}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ("cold-direct", "cold-sidecar", "resumed-prefill",
                                                               "resumed-kept", "resumed-sidecar")}
    direct.start()
    try:
        for pod in pods.values():
            pod.start()
        for pod in pods.values():
            pod.wait_ready(300)
        a, b = pods["a"].url, pods["b"].url
        prompts = Prompts(direct.url, args.context)
        body = {"model": args.model, "temperature": 0, "max_tokens": args.max_tokens}
        _stream(direct.url, {**body, "messages": prompts.next()})  # warm up: page in the weights, one each
        _stream(a, {**body, "messages": prompts.next()})
        _stream(b, {**body, "messages": prompts.next()})
        for i in range(args.repeat):
            print(f"run {i + 1}/{args.repeat}", flush=True)
            runs["cold-direct"].append(_stream(direct.url, {**body, "messages": prompts.next()}))
            first = prompts.next()
            cold = _stream(a, {**body, "messages": first})
            runs["cold-sidecar"].append(cold)
            second = [*first, {"role": "assistant", "content": cold["text"]}, {"role": "user", "content": FOLLOW_UP}]
            _settle(a)
            runs["resumed-sidecar"].append(_stream(b, {**body, "messages": second}))
            _erase(direct.url)
            runs["resumed-prefill"].append(_stream(direct.url, {**body, "messages": second}))
            _erase(direct.url)
            _stream(direct.url, {**body, "messages": first})
            runs["resumed-kept"].append(_stream(direct.url, {**body, "messages": second}))
            for name, got in runs.items():
                print(f"  {name}: TTFT {got[-1]['ttft_ms']:.0f} ms, processed {got[-1]['processed']}, "
                      f"cached {got[-1]['cached_tokens']}", flush=True)
            _settle(b)
    finally:
        for pod in pods.values():
            pod.cleanup()
        direct.stop()
    return runs


def run(args: argparse.Namespace) -> int:
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    before = machine()
    server = None if args.redis_url else RedisProcess().start()
    try:
        runs = _measure(args, args.redis_url or server.url)  # type: ignore[union-attr]
    finally:
        if server is not None:
            server.cleanup()
    rows = [_row(m, r) for m, r in runs.items()]
    by = {r["method"]: r for r in rows}
    by["cold-sidecar"]["vs_direct"] = by["cold-sidecar"]["ttft_ms_p50"] / by["cold-direct"]["ttft_ms_p50"]
    for name in ("resumed-kept", "resumed-sidecar"):
        by[name]["speedup"] = by["resumed-prefill"]["ttft_ms_p50"] / by[name]["ttft_ms_p50"]
    by["resumed-sidecar"]["vs_direct"] = by["resumed-sidecar"]["ttft_ms_p50"] / by["resumed-kept"]["ttft_ms_p50"]
    print_table(rows, COLUMNS)
    ratio = by["cold-sidecar"]["vs_direct"]
    targets = {"cold_ttft_vs_direct": {"value": ratio, "target": COLD_TARGET, "met": ratio <= COLD_TARGET},
               "resumed_speedup_vs_prefill": {"value": by["resumed-sidecar"]["speedup"], "target": None,
                                              "met": None}}
    verdict = "met" if ratio <= COLD_TARGET else "MISSED"
    print(f"target cold_ttft_vs_direct: {ratio:.3f} (at most {COLD_TARGET}) {verdict}")
    print(f"resumed turn on the second sidecar: {by['resumed-sidecar']['speedup']:.1f}x faster than a full prefill, "
          f"{by['resumed-sidecar']['vs_direct']:.2f}x the TTFT of a llama-server that kept the slot")
    write_json(args.json, {"rows": rows, "targets": targets, "runs": runs, "model": args.model, "codec": args.codec,
                           "context": args.context, "threads": args.threads, "repeat": args.repeat,
                           "machine_before": before, "machine_after": machine()})
    return 0
