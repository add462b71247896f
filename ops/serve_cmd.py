"""`kvstash serve`: run one inference pod under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from service.engines import IN_POD


class SettingHelp(str):
    """A flag's help naming a PodSettings field: argparse expands it (only when it prints help) into the setting's
    meaning and default from service.settings (`describe`), so building the parser does not import the service."""

    def __mod__(self, params: object) -> str:
        from service.settings import describe  # noqa: PLC0415 (importing the service costs seconds)

        return describe(str(self)).replace("%", "%%") % params


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
    p.add_argument("--host", help=SettingHelp("host"))
    p.add_argument("--port", type=int, help=SettingHelp("port"))
    p.add_argument("--engine", choices=IN_POD, help=SettingHelp("engine"))
    p.add_argument("--model", help=SettingHelp("model"))
    p.add_argument("--parallel", type=int, help=SettingHelp("parallel"))
    p.add_argument("--threads", type=int, help=SettingHelp("threads"))
    p.add_argument("--flash-attn", choices=["auto", "on", "off"], help=SettingHelp("flash_attn"))
    p.add_argument("--device", help=SettingHelp("device"))
    p.add_argument("--memory-kv-bytes", type=int, help=SettingHelp("memory_kv_bytes"))
    add_pod_options(p)
    p.set_defaults(func=run)


def add_pod_options(p: argparse.ArgumentParser, no_cache_help: str = "neither read nor write the cache (for "
                    "comparisons)") -> None:
    """The flags of every pod-like command (`serve`, `sidecar`): Redis, cache, admission, logging."""
    for name, kind in (("redis_url", str), ("namespace", str), ("codec", str), ("block_tokens", int),
                       ("budget_bytes", int), ("block_ttl_s", int), ("session_ttl_s", int),
                       ("redis_timeout_s", float), ("link_bytes_s", float), ("prefill_tokens_s", float),
                       ("max_queue", int), ("pod_name", str), ("drain_grace_s", float), ("drain_delay_s", float)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=SettingHelp(name))
    p.add_argument("--fetch-policy", choices=["auto", "always"], help=SettingHelp("fetch_policy"))
    p.add_argument("--no-cache", action="store_true", help=no_cache_help)
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")


def settings_from_args(args: argparse.Namespace) -> Any:
    from service.settings import settings_from_env  # noqa: PLC0415

    overrides = {
        name: getattr(args, name)
        for name in ("host", "port", "engine", "model", "parallel", "threads", "device", "redis_url", "namespace",
                     "codec", "block_tokens",
                     "budget_bytes", "block_ttl_s", "session_ttl_s", "redis_timeout_s", "max_queue", "pod_name",
                     "fetch_policy", "link_bytes_s", "prefill_tokens_s", "drain_grace_s", "drain_delay_s")
    }
    overrides["memory_kv_bytes"] = getattr(args, "memory_kv_bytes", None)  # `serve` only, not `sidecar`
    overrides["flash_attn"] = getattr(args, "flash_attn", None)
    if args.no_cache:
        overrides["cache_enabled"] = False
    return settings_from_env().with_overrides(**overrides)


def run(args: argparse.Namespace) -> int:
    from cachestore.codec import CodecSpec  # noqa: PLC0415
    from cachestore.redisclient import check_connection  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from service.app import check_block_fits, create_app, store_settings  # noqa: PLC0415
    from service.engines import load_engine  # noqa: PLC0415
    from service.runtime import threads  # noqa: PLC0415
    from service.runtime.drain import serve  # noqa: PLC0415

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
    # (on the process's compute thread, the one thread that runs torch on every core: service.runtime.threads)
    threads.one_core()
    engine = threads.compute_executor(settings.threads).submit(
        load_engine, settings.engine, settings.model, device=settings.device, parallel=settings.parallel,
        threads=settings.threads, codec=settings.codec, flash_attn=settings.flash_attn).result()
    try:
        CodecSpec.parse(settings.codec).check_model(engine.geometry.num_layers, engine.geometry.head_dim)
        check_block_fits(settings, engine)
        app = create_app(settings, engine)
        # SIGTERM drains the pod (runtime.drain): not ready, no new connections, requests and write-back finished
        serve(app, app.state.drain, settings.host, settings.port, args.log_level)
    finally:
        engine.close()
    return 0
