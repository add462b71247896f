"""`kvstash demo`: Redis, three pods and a round-robin balancer; a multi-turn chat hopping between pods."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.engines import ENGINES

QUESTIONS = [
    "What is photosynthesis?",
    "Why are leaves green?",
    "What happens to leaves in autumn?",
    "How do trees survive the winter?",
    "Can you name three evergreen trees?",
    "Summarise what we talked about in two sentences.",
    "What is the water cycle?",
    "How does rain form?",
]
SYSTEM = "You are a helpful assistant who explains science clearly."


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", help="three pods behind a round-robin balancer holding one multi-turn chat",
        description="Start Redis, three pods and a round-robin balancer (nginx if installed), hold a "
                    "multi-turn chat through it, and compare every turn with a pod that has no cache.",
    )
    p.add_argument("--turns", type=int, default=6, help="number of chat turns (default 6, at most 8)")
    p.add_argument("--engine", default="hf", choices=list(ENGINES),
                   help="model runtime of every pod: hf (transformers, default), llamacpp, or llama-server "
                        "(each pod a `kvstash sidecar` with its own llama-server)")
    p.add_argument("--model", default="smollm2", help="model every pod serves (default smollm2)")
    p.add_argument("--codec", default="exact", help="codec of the cached blocks (default exact: lossless)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per cached block (default 64)")
    p.add_argument("--max-tokens", type=int, default=160, help="reply length per turn (default 160)")
    p.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    p.add_argument("--pods", type=int, default=3, help="number of caching pods (default 3)")
    p.add_argument("--json", type=Path, help="write the per-turn results here")
    p.set_defaults(func=run)


def _say(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[tuple[str, list[Any], Any, Any]]:
    """Redis, caching pods, one no-cache pod and the balancer; everything is stopped on exit."""
    from ops.pods import NginxProcess, PodProcess, ProcessError, nginx_binary  # noqa: PLC0415
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    started: list[Any] = []
    try:
        redis_url = args.redis_url
        if redis_url is None:
            redis_proc = RedisProcess(extra_args=("--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"))
            started.append(redis_proc.start())
            redis_url = redis_proc.url
            _say(f"redis        {redis_url} (private, started for the demo)")
        extra: tuple[str, ...] = ("--engine", args.engine, "--codec", args.codec,
                                  "--block-tokens", str(args.block_tokens))
        pod_class: Any = PodProcess
        if args.engine == "llama-server":  # every pod a sidecar beside its own llama-server
            from ops.sidecarproc import SidecarProcess  # noqa: PLC0415

            pod_class, extra = SidecarProcess, extra[2:]
        pods = [pod_class(f"pod-{chr(ord('a') + i)}", redis_url, args.model, extra) for i in range(args.pods)]
        baseline = pod_class("pod-nocache", redis_url, args.model, extra, no_cache=True)
        for pod in [*pods, baseline]:
            started.append(pod.start())
        _say(f"starting {len(pods)} pods + 1 no-cache pod (engine {args.engine}, model {args.model}, "
             f"codec {args.codec}); "
             "the first start converts the model once ...")
        for pod in [*pods, baseline]:
            pod.wait_ready()
            _say(f"{pod.name:<12} {pod.url} ready" + (" (cache disabled)" if pod.no_cache else ""))
        balancer = None
        if nginx_binary() is not None:
            try:
                balancer = NginxProcess([f"127.0.0.1:{p.port}" for p in pods]).start()
                started.append(balancer)
                _say(f"nginx        {balancer.url} round robin over {len(pods)} pods")
            except ProcessError as exc:
                _say(f"nginx could not start ({exc}); the demo client rotates pods itself")
        else:
            _say("nginx is not installed; the demo client rotates over the pods itself (round robin)")
        yield redis_url, pods, baseline, balancer
    finally:
        for proc in reversed(started):
            proc.cleanup()


def run(args: argparse.Namespace) -> int:
    import httpx  # noqa: PLC0415

    from ops.chatclient import stream_chat  # noqa: PLC0415
    from service.cache.partials import common_prefix  # noqa: PLC0415
    from service.engines import check_runtime  # noqa: PLC0415

    check_runtime(args.engine)  # before any process starts: a missing runtime is one line, not four pod logs
    if not 1 <= args.turns <= len(QUESTIONS):
        print(f"kvstash demo: --turns must be between 1 and {len(QUESTIONS)}", file=sys.stderr)
        return 2
    # Ctrl-C (or SIGTERM) stops the demo and every process it started. A KeyboardInterrupt raised while Python runs a
    # finalizer is printed and dropped ("Exception ignored in ..."), and the demo went on to finish with status 0 (seen
    # once in CI): the signal is also remembered, and every turn starts by checking it.
    interrupted: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    rows: list[dict[str, Any]] = []
    with _cluster(args) as (_, pods, baseline, balancer), httpx.Client(timeout=300) as client:
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        count = _token_counter(args.engine, args.model)
        model = client.get(pods[0].url + "/v1/models").json()["data"][0]["id"]  # the name pods answer to
        _say("")
        _say(f"{'turn':>4}  {'pod':<8} {'cache':<8} {'prompt':>6} {'possible':>8} {'cached':>6} {'TTFT ms':>8} "
             f"{'no-cache ms':>11} {'speedup':>7}  same reply")
        possible = 0  # tokens of this prompt some pod already computed: the last prompt and its reply
        for turn in range(1, args.turns + 1):
            if interrupted:
                raise KeyboardInterrupt
            messages.append({"role": "user", "content": QUESTIONS[turn - 1]})
            body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                    "return_token_ids": True}
            target = balancer.url if balancer else pods[(turn - 1) % len(pods)].url
            cached = stream_chat(client, target, body)
            # the no-cache pod is handed exactly the tokens the caching pod used (a reply some pod generated is
            # fed back as the ids it generated, not a re-tokenization of its text)
            same_tokens = {"model": model, "prompt": cached.prompt_token_ids or [], "max_tokens": args.max_tokens,
                           "temperature": 0}
            plain = stream_chat(client, baseline.url, same_tokens, path="/v1/completions")
            if cached.status != 200 or plain.status != 200:
                print(f"kvstash demo: turn {turn} failed: {cached.text or plain.text}", file=sys.stderr)
                return 1
            same = cached.text == plain.text
            rows.append({
                "turn": turn, "pod": cached.pod, "cache": cached.cache, "prompt_tokens": cached.prompt_tokens,
                "possible_tokens": possible, "cached_tokens": cached.cached_tokens, "ttft_ms": round(cached.ttft_ms, 1),
                "ttft_ms_nocache": round(plain.ttft_ms, 1), "identical": same,
                "matching_tokens": common_prefix(count(cached.text), count(plain.text)),
            })
            speed = plain.ttft_ms / cached.ttft_ms if cached.ttft_ms else 0.0
            _say(f"{turn:>4}  {cached.pod:<8} {cached.cache:<8} {cached.prompt_tokens:>6} {possible:>8} "
                 f"{cached.cached_tokens:>6} {cached.ttft_ms:>8.0f} {plain.ttft_ms:>11.0f} {speed:>6.1f}x  "
                 f"{'yes' if same else 'no'}")
            messages.append({"role": "assistant", "content": cached.text})
            possible = cached.prompt_tokens + cached.completion_tokens - 1  # the next turn is sent at once
    if interrupted:  # it came while the processes were being stopped
        raise KeyboardInterrupt
    later = [r for r in rows if r["turn"] > 1]
    speedup = (sum(r["ttft_ms_nocache"] for r in later) / max(1e-9, sum(r["ttft_ms"] for r in later))) if later else 0
    all_identical = all(r["identical"] for r in rows)
    _say("")
    _say(f"turns 2..{args.turns}: mean TTFT {_mean(later, 'ttft_ms'):.0f} ms with kvstash vs "
         f"{_mean(later, 'ttft_ms_nocache'):.0f} ms recomputing: {speedup:.1f}x faster")
    possible = sum(r["possible_tokens"] for r in later)
    reused = sum(min(r["cached_tokens"], r["possible_tokens"]) for r in later)
    if possible:
        _say(f"turns 2..{args.turns}: {reused} of the {possible} tokens some pod had already computed came from "
             f"the cache ({100 * reused / possible:.1f}%), each turn sent the moment the previous reply ended")
    pods_used = sorted({r["pod"] for r in rows})
    _say(f"pods that served turns: {', '.join(pods_used)}")
    if all_identical:
        _say(f"every reply was identical with and without the cache (codec {args.codec})")
    else:
        differing = [r["turn"] for r in rows if not r["identical"]]
        why = f"codec {args.codec} is lossy"
        if args.codec == "exact" and args.engine != "hf":  # llama.cpp: a reply decoded token by token vs prefilled
            why = "codec exact is lossless; llama.cpp's logits depend on how tokens were batched"
        _say(f"replies differed on turns {differing} ({why}; "
             f"leading tokens that matched per turn: {[r['matching_tokens'] for r in rows]})")
    if args.json:
        args.json.write_text(json.dumps({"turns": rows, "speedup": round(speedup, 2),
                                         "all_identical": all_identical, "codec": args.codec}, indent=2))
        _say(f"wrote {args.json}")
    return 0


def _token_counter(engine: str, model: str) -> Any:
    """Tokenize replies with the served model's tokenizer, to count matching tokens of lossy codecs
    (words, for a GGUF file that has no transformers twin)."""
    if engine != "hf" and model != "smollm2":
        return str.split
    from service.engines.hf.models import load_tokenizer  # noqa: PLC0415

    tokenizer = load_tokenizer(model)
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else 0.0
