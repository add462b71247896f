"""The pod's Starlette app, composed in one call; the lifespan opens the model, Redis and the writer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from cachestore.codec import CodecSpec
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.frame import FLOAT_MODES
from cachestore.errors import ConfigError, KvstashError
from cachestore.settings import StoreSettings, mask_url
from cachestore.store import BlockStore
from service.cache import codecnames
from service.cache.pipeline import Pipeline
from service.cache.writer import BackgroundWriter
from service.engines import Engine, load_engine
from service.http import completions, health, openapi, sessions_api
from service.http.errors import EXCEPTION_HANDLERS
from service.runtime import threads
from service.runtime.drain import Drain
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings
from service.state import PodState

if TYPE_CHECKING:
    from service.engines.hf.models import LoadedModel

log = logging.getLogger("kvstash.service")
DEAD_SAMPLE_EVERY = 20  # usage samples per sample of the dead bytes (kvstash_cache_dead_bytes)
IO_THREADS = 8  # asyncio.to_thread's pool in a pod: encoding for write-back, tails, copies


def shared_redis(url: str) -> bool:
    """Whether a Redis URL names a server beyond this machine (every host of a cluster or sentinel URL counts): where
    unsigned frames are worth a warning. A unix socket or a loopback address is this machine's own."""
    if url.startswith("unix:"):
        return False
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    hosts = [item[1:item.find("]")] if item.startswith("[") else item.split(":")[0] for item in netloc.split(",")]
    return any(h not in ("localhost", "::1", "") and not h.startswith("127.") for h in hosts)


def store_settings(settings: PodSettings) -> StoreSettings:
    return StoreSettings.from_url(
        settings.redis_url,
        namespace=settings.namespace,
        block_ttl_s=settings.block_ttl_s,
        session_ttl_s=settings.session_ttl_s,
        budget_bytes=settings.budget_bytes,
        max_value_bytes=settings.max_value_bytes,
        # the store gives up a little before the request path stops waiting, so a slow Redis is recorded as a
        # failure (and opens the breaker) instead of the call being cancelled, which records nothing
        op_timeout_s=settings.redis_timeout_s * 0.8,
        local_tier_bytes=settings.local_tier_bytes,
        frame_key=settings.frame_key,
        frame_key_previous=settings.frame_key_previous,
        tenant_quota_bytes=settings.tenant_quota_bytes,
        tenant_quotas=tuple(sorted(settings.tenant_quotas.items())),
    )


def _rejected(metrics: PodMetrics, reason: str, detail: str) -> None:
    """A value the store discarded (its signature did not verify): a miss, logged and counted like the pipeline's
    (and as kvstash_frames_rejected_total, the name docs/security.md gives it)."""
    log.warning("discarding a cached value (%s): %s", reason, detail)
    metrics.cache_rejected.labels(reason).inc()
    metrics.frames_rejected.labels(reason).inc()


def _store_stats(state: PodState) -> dict[str, Any] | None:
    if state.store is None:
        return None
    stats = state.store.stats()
    values = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))
    values["breaker_state"] = state.store.breaker_state
    return values


async def _sample_usage(state: PodState) -> None:
    """Every pod exports the namespace's bytes, budget and entry count itself (no redis_exporter needed);
    sampled, never per request. A Redis that does not answer leaves the last values."""
    assert state.store is not None
    state.metrics.budget.set(state.settings.budget_bytes)
    tenants = state.settings.tenants
    for tenant in tenants:
        if state.store.settings.quota_of(tenant):
            state.metrics.tenant_quota.labels(tenant).set(state.store.settings.quota_of(tenant))
    for sample in itertools.count():
        try:
            usage = await state.store.usage()
            if sample % DEAD_SAMPLE_EVERY == 0:  # an O(entries) read of the index: seldom
                state.metrics.dead_bytes.set((await state.store.dead()).bytes)
        except KvstashError:
            pass
        else:
            state.metrics.bytes_held.set(usage.bytes_held)
            state.metrics.entries_held.set(usage.blocks)
            for tenant in tenants:  # this pod's tenants only: a label per name a writer put in Redis is unbounded
                state.metrics.tenant_bytes.labels(tenant).set(usage.by_tenant.get(tenant, 0))
        await asyncio.sleep(state.settings.usage_sample_s)


class RouteMetrics(BaseHTTPMiddleware):
    """Counts requests and times them per route (paths with ids are folded into their route)."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")
        state: PodState = request.app.state.pod
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        state.metrics.latency.labels(name).observe(time.perf_counter() - t0)
        if state.settings.pod_name:
            response.headers["X-KV-Pod"] = state.settings.pod_name
        if state.drain.active:  # leaving: a keep-alive client reconnects, to another pod
            response.headers["Connection"] = "close"
        return response


FRAME_HEADER_ROOM = 4096  # a frame's header and trailer beside its payload, generously


def check_block_fits(settings: PodSettings, engine: Engine) -> None:
    """A block of this model in a float codec (exact, fp16: its payload is the KV's own bytes) must fit
    max_value_bytes, or every write of it would fail: refused at start, in one line. Quantized codecs are a fraction
    of that."""
    spec = CodecSpec.parse(settings.codec)
    if not settings.cache_enabled or spec.mode not in FLOAT_MODES:
        return
    geo = engine.geometry
    itemsize = 2 if spec.mode == "fp16" else int(getattr(geo.dtype, "itemsize", 2))
    payload = geo.num_layers * 2 * geo.kv_heads * settings.block_tokens * geo.head_dim * itemsize
    limit = store_settings(settings).max_value_bytes  # as the store has it: its default capped at the budget
    if payload + FRAME_HEADER_ROOM > limit:
        raise ConfigError(f"a {settings.block_tokens}-token block of this model in codec {spec.mode} is "
                          f"{payload / 2**20:.1f} MiB, over max_value_bytes ({limit / 2**20:.1f} "
                          f"MiB): raise max_value_bytes (KVSTASH_MAX_VALUE_BYTES) or lower block_tokens")


class StartupErrors:
    """A start-up the operator's settings refused is reported as its one line (uvicorn would log the traceback)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state

        async def sending(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed" and getattr(state, "startup_error", None):
                message = {**message, "message": state.startup_error}
            await send(message)

        await self.app(scope, receive, sending)


def build_state(settings: PodSettings, engine: Engine) -> PodState:
    """Wire engine, store, codec, writer and pipeline (no I/O; the store connects lazily)."""
    state = PodState(settings=settings, metrics=PodMetrics(lambda: _store_stats(state)))
    codec = BlockCodecs.for_spec(settings.codec, rows=engine.kv_layout.row_frames,  # the writer's and the pipeline's
                                 rope=engine.kv_layout.rope)
    check_block_fits(settings, engine)
    state.engine = engine
    state.metrics.draining.set_function(lambda: float(state.drain.active))
    if settings.cache_enabled:
        metrics = state.metrics
        state.store = BlockStore(store_settings(settings), on_rejected=lambda reason, detail: _rejected(
            metrics, reason, detail))
        state.writer = BackgroundWriter(state.store, codec, state.metrics, settings.write_queue)
    state.pipeline = Pipeline(settings, engine, state.store, codec, state.metrics, state.writer)
    return state


def _as_engine(model: Engine | LoadedModel) -> Engine:
    """Tests and benchmarks may hand over a transformers model loaded once: it runs as the hf engine."""
    if isinstance(model, Engine):
        return model  # torch and transformers stay unimported (the sidecar's engine)
    from service.engines.hf.models import LoadedModel  # noqa: PLC0415  (transformers: only when handed a model)

    if isinstance(model, LoadedModel):
        from service.engines.hf.engine import HfEngine  # noqa: PLC0415

        return HfEngine(model)
    return model


def create_app(settings: PodSettings, engine: Engine | LoadedModel | None = None,
               api_routes: Sequence[BaseRoute] | None = None) -> Starlette:
    """The app; `engine` lets tests and benchmarks share one loaded model between several apps. `api_routes` replace
    kvstash's completions and model list (the sidecar passes llama-server's API through:
    service.sidecar.passthrough). `app.state.drain` is the pod's drain, begun by the server on SIGTERM
    (service.runtime.drain.serve)."""
    drain = Drain(settings.drain_grace_s, settings.drain_delay_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = engine is None  # an engine handed in belongs to the caller, who closes it
        # torch on every core in one thread only, the compute thread (service.runtime.threads): the event loop's
        # thread and the threads of asyncio.to_thread (encoding, copies) keep to one core
        threads.one_core()
        asyncio.get_running_loop().set_default_executor(threads.io_executor(IO_THREADS, "kvstash-io"))
        model = _as_engine(engine) if engine is not None else await asyncio.wrap_future(
            threads.compute_executor(settings.threads).submit(
                load_engine, settings.engine, settings.model, device=settings.device, parallel=settings.parallel,
                threads=settings.threads, codec=settings.codec, flash_attn=settings.flash_attn))
        try:
            # a named codec (int4, int2) is the fleet's plan for this model: read from Redis, or made and stored here
            pod_settings, _ = await codecnames.resolve(settings, model, store_settings(settings))
            state = build_state(pod_settings, model)
        except KvstashError as exc:  # the operator's to fix: one line, not a traceback (`StartupErrors`)
            app.state.startup_error = f"kvstash: error: {exc}"
            if own:
                model.close()
            raise
        state.drain = drain
        drain.holding = lambda: (state.admission.admitted, state.writer.depth if state.writer else 0)
        app.state.pod = state
        if state.writer is not None:
            state.writer.start()
        sampler = asyncio.create_task(_sample_usage(state), name="kvstash-usage") if state.store else None
        state.metrics.frames_signed.set(1 if pod_settings.frame_key else 0)
        if state.store is not None and not pod_settings.frame_key and shared_redis(pod_settings.redis_url):
            log.warning("frames are unsigned on a Redis other pods and clients can reach (%s): whoever can write "
                        "there can hand this pod KV of its choosing; set KVSTASH_FRAME_KEY on every pod "
                        "(docs/security.md)", mask_url(pod_settings.redis_url))
        log.info("pod ready: %r", pod_settings)
        try:
            yield
        finally:
            if sampler is not None:
                sampler.cancel()
            if state.writer is not None:  # the requests are done: what they computed goes to Redis, in the grace
                await state.writer.stop(drain_timeout_s=drain.left_s())
            if drain.active:
                log.info("drained in %.1f s: %s; exiting", drain.elapsed_s(), drain.describe())
            if state.pipeline is not None:
                state.pipeline.close()
            if state.store is not None:
                await state.store.close()
            if own:
                model.close()

    routes: list[BaseRoute] = [
        Route("/healthz", health.healthz, methods=["GET"]),
        Route("/readyz", health.readyz, methods=["GET"]),
        Route("/metrics", health.metrics, methods=["GET"]),
        Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
        Route("/v1/sessions", sessions_api.create_session, methods=["POST"]),
        Route("/v1/sessions", sessions_api.list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session_id}", sessions_api.get_session, methods=["GET"]),
        Route("/v1/sessions/{session_id}", sessions_api.delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{session_id}/messages", sessions_api.add_messages, methods=["POST"]),
        Route("/v1/sessions/{session_id}/fork", sessions_api.fork_session, methods=["POST"]),
    ]
    routes += api_routes if api_routes is not None else [
        Route("/v1/models", completions.list_models, methods=["GET"]),
        Route("/v1/chat/completions", completions.chat_completions, methods=["POST"]),
        Route("/v1/completions", completions.completions, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(StartupErrors), Middleware(RouteMetrics)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.drain = drain
    return app
