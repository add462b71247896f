"""Liveness, readiness and Prometheus metrics endpoints."""

from __future__ import annotations

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.http.respond import pod


async def healthz(request: Request) -> Response:
    """The process is alive and its event loop answers."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready once the model is loaded, until SIGTERM starts the pod's drain (runtime.drain). Redis state is reported,
    but an outage does not make the pod unready: it then serves by recomputing."""
    state = pod(request)
    redis_state = "disabled"
    if state.store is not None:
        try:
            redis_state = "up" if await asyncio.wait_for(state.store.ping(), 1.0) else "down"
        except TimeoutError:
            redis_state = "down"
        redis_state = f"{redis_state} (breaker {state.store.breaker_state})"
    ready = state.ready and not state.drain.active
    body = {
        "status": "draining" if state.drain.active else "ready" if state.ready else "loading",
        "model": state.engine.name if state.engine else None,
        "engine": state.engine.kind if state.engine else None,
        "redis": redis_state,
        "write_queue": state.writer.depth if state.writer else 0,
        "pod": state.settings.pod_name,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    state = pod(request)
    if state.writer is not None:
        state.metrics.write_queue_depth.set(state.writer.depth)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
