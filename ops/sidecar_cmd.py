"""`kvstash sidecar`: a kvstash pod in front of one llama-server, sharing its KV with every other pod via Redis."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from ops.serve_cmd import SettingHelp, add_pod_options

SIDECAR_EPILOG = """\
Two ways to run it:
  kvstash sidecar --upstream http://127.0.0.1:8080 --slot-dir /slots --model /models/m.gguf
      in front of a running `llama-server -m /models/m.gguf --slot-save-path /slots -np N`
      (the same slot directory on both sides: an emptyDir with medium Memory, or a tmpfs);
  kvstash sidecar --spawn --model smollm2 --parallel 4 -- [llama-server arguments]
      starts llama-server itself (built by `make setup`) and restarts it if it dies.
The port opens (and GET /healthz answers) once llama-server is up and has passed a save/restore probe.
Every llama-server route passes through unchanged (docs/sidecar.md); completions share KV through Redis.
A llama-server started with --api-key: set KVSTASH_UPSTREAM_API_KEY to that key (with --spawn, llama-server is
started with it).
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "sidecar", help="run kvstash beside a llama-server (shares its KV through Redis)",
        description="A kvstash pod (the OpenAI API of `kvstash serve`) whose generation runs in llama-server. "
                    "Every kvstash flag also reads KVSTASH_<NAME> from the environment; flags win.",
        epilog=SIDECAR_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up = p.add_argument_group("llama-server")
    up.add_argument("--upstream", help="URL of a running llama-server (started with --slot-save-path)")
    up.add_argument("--slot-dir", help="the directory llama-server's --slot-save-path names (shared with it)")
    up.add_argument("--spawn", action="store_true", help="start and supervise llama-server here")
    up.add_argument("--model", help="smollm2 (default), kvgeom-8b/-32b/-70b or a .gguf path: the file llama-server "
                    "serves (its digest keys the cache)")
    up.add_argument("--parallel", type=int, help="--spawn: llama-server slots (-np, default 4)")
    up.add_argument("--threads", type=int, help="--spawn: llama-server threads (default: its own)")
    up.add_argument("--ctx-per-slot", type=int, default=8192, help="--spawn: context tokens per slot (default 8192)")
    up.add_argument("--llama-server", help="--spawn: the binary (default: the one `make setup` built)")
    up.add_argument("--flash-attn", choices=["auto", "on", "off"],
                    help="--spawn: llama-server's -fa (default auto; off decodes a long context faster on some CPUs)")
    p.add_argument("--host", help=SettingHelp("host"))
    p.add_argument("--port", type=int, help=SettingHelp("port"))
    add_pod_options(p, no_cache_help="neither read nor write the cache, and let llama-server reuse nothing "
                    "either (a full prefill every request: the baseline for comparisons)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="--spawn: arguments after -- go to llama-server")
    p.set_defaults(func=run, engine="llama-server", device=None)


def start_engine(args: argparse.Namespace, codec: str = "", flash_attn: str = "auto", api_key: str = "") -> Any:
    """The llama-server engine: spawned here (with the KV cache type a pod of `codec` stores: `kv_cache_type`, and
    `-fa flash_attn` unless auto or given after --), or in front of --upstream (probed either way)."""
    from cachestore.errors import ConfigError  # noqa: PLC0415
    from service.engines.llama import PARALLEL, kv_cache_type  # noqa: PLC0415
    from service.engines.llama.llamaserver import LlamaServerEngine  # noqa: PLC0415

    model = args.model or "smollm2"
    extra = list(args.extra or [])
    extra = extra[1:] if extra[:1] == ["--"] else extra
    if args.spawn == bool(args.upstream):
        raise ConfigError("give either --upstream URL --slot-dir DIR (a running llama-server) or --spawn")
    if args.spawn:  # a sidecar of codec q8 runs llama-server's q8_0 cache, whose bytes its frames are
        return LlamaServerEngine.spawn(
            model, Path(args.slot_dir) if args.slot_dir else None, parallel=args.parallel or PARALLEL,
            threads=args.threads or 0, ctx_per_slot=args.ctx_per_slot,
            binary=Path(args.llama_server) if args.llama_server else None, extra_args=extra,
            reuse_slots=not args.no_cache, kv_type=kv_cache_type(codec), flash_attn=flash_attn, api_key=api_key,
        )
    if extra or flash_attn != "auto":
        raise ConfigError("arguments after -- and KVSTASH_FLASH_ATTN go to a spawned llama-server; with --upstream, "
                          "give them to yours")
    if not args.slot_dir:
        raise ConfigError("--upstream needs --slot-dir: the directory of llama-server's --slot-save-path")
    return LlamaServerEngine(args.upstream, Path(args.slot_dir), model, reuse_slots=not args.no_cache,
                             api_key=api_key)


class SidecarCollector:
    """The engine's restore/save counters as Prometheus metrics, read at scrape time."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily  # noqa: PLC0415

        stats = self._engine.stats
        events = CounterMetricFamily("kvstash_sidecar_events", "llama-server slot events: restores, "
                                     "restore_failures, reuse_misses (a restore llama-server did not use), "
                                     "save_failures, restarts", labels=["event"])
        for key in ("restores", "restore_failures", "reuse_misses", "save_failures"):
            events.add_metric([key], float(getattr(stats, key)))
        process = self._engine.process
        events.add_metric(["restarts"], float(process.restarts if process else 0))
        yield events
        bypassed = CounterMetricFamily("kvstash_sidecar_bypassed", "Completions sent to llama-server past the cache, "
                                       "by reason (media, prompts, global-lora, lora, length, ...)", labels=["reason"])
        for reason, count in sorted(stats.bypassed.items()):
            bypassed.add_metric([reason], float(count))
        yield bypassed
        tokens = CounterMetricFamily("kvstash_sidecar_restored_tokens", "Tokens restored into llama-server slots")
        tokens.add_metric([], float(stats.restored_tokens))
        yield tokens


def sidecar_app(settings: Any, engine: Any) -> Any:
    """The pod's app around `engine`, llama-server's API passed through (service.sidecar.passthrough), with the
    sidecar's counters on its /metrics."""
    from service.app import create_app  # noqa: PLC0415
    from service.sidecar.passthrough import Passthrough  # noqa: PLC0415

    side = Passthrough(engine)
    app = create_app(settings, engine, api_routes=side.routes())
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[None]:
        async with inner(a):
            a.state.pod.metrics.registry.register(SidecarCollector(engine))
            try:
                yield
            finally:
                await side.aclose()

    app.router.lifespan_context = lifespan
    return app


def run(args: argparse.Namespace) -> int:
    from cachestore.codec import CodecSpec  # noqa: PLC0415
    from cachestore.redisclient import check_connection  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from ops.serve_cmd import settings_from_args  # noqa: PLC0415
    from service.app import store_settings  # noqa: PLC0415
    from service.engines.llama import PARALLEL  # noqa: PLC0415
    from service.runtime.drain import serve  # noqa: PLC0415

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.model = args.model or "smollm2"
    args.parallel = args.parallel or PARALLEL
    settings = settings_from_args(args)
    CodecSpec.parse(settings.codec)
    if settings.cache_enabled:
        StoreSettings.from_url(settings.redis_url)
        warning = asyncio.run(check_connection(store_settings(settings)))
        if warning:
            print(f"kvstash: warning: {warning}", file=sys.stderr)
    # the port opens only after llama-server is up and probed
    engine = start_engine(args, settings.codec, settings.flash_attn, settings.upstream_api_key)
    try:
        CodecSpec.parse(settings.codec).check_model(engine.geometry.num_layers, engine.geometry.head_dim)
        settings = settings.with_overrides(parallel=engine.parallel)
        app = sidecar_app(settings, engine)
        # SIGTERM drains the sidecar (service.runtime.drain) while llama-server still serves what it holds
        serve(app, app.state.drain, settings.host, settings.port, args.log_level)
    finally:
        engine.close()  # a spawned llama-server stops only now, after the drain
    return 0
