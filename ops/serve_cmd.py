"""`kvstash serve`: run one inference pod under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "serve", help="run an inference pod (OpenAI-compatible HTTP API)",
        description="Run an inference pod. Every flag also reads KVSTASH_<NAME> from the environment; "
                    "flags win.",
        epilog="Slow clients: a request body must arrive within KVSTASH_BODY_TIMEOUT_S (10 s; else 408), but "
               "uvicorn has no timeout for request headers, so a client that never finishes its headers holds "
               "a socket until it leaves. Put a balancer that bounds headers in front of pods clients can reach "
               "directly: the shipped ops/nginx/nginx.conf sets client_header_timeout 10s.",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8000)")
    p.add_argument("--engine", choices=["hf", "llamacpp"], help="model runtime: hf (transformers, default) or "
                   "llamacpp (llama-cpp-python, batched decoding)")
    p.add_argument("--model", help="smollm2 (default); hf: tiny-random or a local HF model directory; "
                   "llamacpp: a local .gguf file")
    p.add_argument("--parallel", type=int, help="llamacpp: sequences decoded together (default 4)")
    p.add_argument("--threads", type=int,
                   help="CPU threads of the model: llama.cpp's, or torch's for hf (default: one per core)")
    p.add_argument("--flash-attn", choices=["auto", "on", "off"],
                   help="llamacpp: llama.cpp's flash attention (default auto: llama.cpp decides; off decodes a long "
                        "context faster on some CPUs; a q8 cache needs it)")
    p.add_argument("--device", help="cpu (default) or cuda[:N]")
    p.add_argument("--memory-kv-bytes", type=int,
                   help="with --no-cache: keep the KV of recent sequences in this pod's memory, at most this many "
                        "bytes, least recently used evicted (the sticky-sessions baseline of `kvstash bench load "
                        "--baseline sticky`: only this pod can reuse it, and a restart loses it)")
    add_pod_options(p)
    p.set_defaults(func=run)


def add_pod_options(p: argparse.ArgumentParser, no_cache_help: str = "neither read nor write the cache (for "
                    "comparisons)") -> None:
    """The flags of every pod-like command (`serve`, `sidecar`): Redis, cache, admission, logging."""
    p.add_argument("--redis-url", help="redis://, rediss://, unix:// URL (cluster: add ?cluster=1)")
    p.add_argument("--namespace", help="prefix of every Redis key (default kvstash)")
    p.add_argument("--codec", help="exact (default, lossless), fp16, int8, int4, int2, fp8, q8 (llamacpp: a q8_0 KV "
                   "cache, stored exactly); +zstd/+lz4/+none")
    p.add_argument("--block-tokens", type=int, help="tokens per cached block (default 64)")
    p.add_argument("--budget-bytes", type=int, help="byte budget of the namespace in Redis")
    p.add_argument("--block-ttl-s", type=int, help="TTL of cached blocks in seconds")
    p.add_argument("--session-ttl-s", type=int, help="TTL of session records in seconds")
    p.add_argument("--redis-timeout-s", type=float, help="most a request waits on Redis (default 0.5)")
    p.add_argument("--fetch-policy", choices=["auto", "always"],
                   help="auto (default): read a hit only when that beats prefilling its tokens, from the measured "
                        "read bandwidth and prefill rate; always: read every block Redis holds (docs/fetch-or-"
                        "recompute.md)")
    p.add_argument("--link-bytes-s", type=float,
                   help="with --fetch-policy auto: assume this read bandwidth from Redis, bytes/s (default 0: measure)")
    p.add_argument("--prefill-tokens-s", type=float,
                   help="with --fetch-policy auto: assume this prefill rate, tokens/s (default 0: measure)")
    p.add_argument("--max-queue", type=int, help="requests admitted before 503 (default 8)")
    p.add_argument("--pod-name", help="name reported in /readyz and the X-KV-Pod header")
    p.add_argument("--no-cache", action="store_true", help=no_cache_help)
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")


def settings_from_args(args: argparse.Namespace) -> Any:
    from service.settings import settings_from_env  # noqa: PLC0415

    overrides = {
        name: getattr(args, name)
        for name in ("host", "port", "engine", "model", "parallel", "threads", "device", "redis_url", "namespace",
                     "codec", "block_tokens",
                     "budget_bytes", "block_ttl_s", "session_ttl_s", "redis_timeout_s", "max_queue", "pod_name",
                     "fetch_policy", "link_bytes_s", "prefill_tokens_s")
    }
    overrides["memory_kv_bytes"] = getattr(args, "memory_kv_bytes", None)  # `serve` only, not `sidecar`
    overrides["flash_attn"] = getattr(args, "flash_attn", None)
    if args.no_cache:
        overrides["cache_enabled"] = False
    return settings_from_env().with_overrides(**overrides)


def run(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415

    from cachestore.codec import CodecSpec  # noqa: PLC0415
    from cachestore.redisclient import check_connection  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from service import threads  # noqa: PLC0415
    from service.app import create_app, store_settings  # noqa: PLC0415
    from service.engines import load_engine  # noqa: PLC0415

    settings = settings_from_args(args)
    CodecSpec.parse(settings.codec)  # fail fast with a clear message on a bad codec
    if settings.cache_enabled:
        StoreSettings.from_url(settings.redis_url)  # and on a malformed Redis URL
        # and on credentials, TLS or ACL that cannot work; an unreachable Redis only warns
        warning = asyncio.run(check_connection(store_settings(settings)))
        if warning:
            print(f"kvstash: warning: {warning}", file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the model loads before the port opens: a model the engine cannot serve (a missing or sliding-window GGUF,
    # another llama.cpp state layout) is one line and a non-zero exit, never a traceback from the lifespan
    # (on the process's compute thread, the one thread that runs torch on every core: service.threads)
    threads.one_core()
    engine = threads.compute_executor(settings.threads).submit(
        load_engine, settings.engine, settings.model, device=settings.device, parallel=settings.parallel,
        threads=settings.threads, codec=settings.codec, flash_attn=settings.flash_attn).result()
    try:
        CodecSpec.parse(settings.codec).check_model(engine.geometry.num_layers, engine.geometry.head_dim)
        uvicorn.run(create_app(settings, engine), host=settings.host, port=settings.port,
                    log_level=args.log_level, timeout_graceful_shutdown=15)
    finally:
        engine.close()
    return 0
