"""The sidecar's API: llama-server's own, passed through, with a shared KV cache under its completions.

A completion (`/v1/chat/completions`, `/v1/completions`, `/completion` and their aliases) is rendered and tokenized
by llama-server itself (`/apply-template`, `/tokenize`), looked up in the cache, restored into a slot, and sent to
llama-server with its body unchanged but for `id_slot` (that slot) and `cache_prompt` (true). The reply comes back
as llama-server wrote it, streamed event by event when asked, with the X-KV-* headers added; the events that end it
are held until the slot's KV is saved and written back (`WriteBack.finish`), so the next turn hits on any pod. Every
other route is forwarded as it is. llama-server's statuses and error bodies reach the client unchanged; a
llama-server that does not answer is a 503 with a JSON body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from service.cache.cacheview import CacheView
from service.cache.pipeline import Pipeline
from service.engines import Generation
from service.engines.llama import llamaserverinput as inputs
from service.engines.server import SlotLease, SlotServer
from service.http.admission import Ticket
from service.http.errors import ApiError
from service.http.requests import _read_body, read_json
from service.http.respond import admitted_lookup, cache_headers, pod, ready_pipeline
from service.http.tenancy import resolve_tenant

log = logging.getLogger("kvstash.passthrough")

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "content-length", "host"})
# kvstash's own routes: llama-server's of these names are not reachable through the sidecar
OWN_ROUTES = ("/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/sessions")
UPSTREAM_TIMEOUT = httpx.Timeout(600.0, connect=5.0)
BYPASS = {"X-KV-Cache": "bypass", "X-KV-Cached-Tokens": "0"}  # a completion the cache took no part in


def unavailable(exc: Exception) -> ApiError:
    return ApiError(503, f"llama-server is not reachable: {type(exc).__name__}", type_="server_error",
                    code="upstream_unavailable", headers={"Retry-After": "1"})


def upstream_headers(request: Request, api_key: str, multi_tenant: bool) -> dict[str, str]:
    """The client's headers as llama-server gets them, without hop-by-hop ones. A pod of tenants checked the client's
    kvstash key: llama-server gets the sidecar's upstream key instead (a kvstash key is never shown to it). Without
    tenants the client's own key goes to llama-server, which checks it as it would directly."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    if multi_tenant:
        headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "x-api-key")}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _reply_headers(upstream: httpx.Response, extra: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    return {**out, **extra}


class Passthrough:
    """The sidecar's routes around one llama-server engine, with one pooled HTTP client to it."""

    def __init__(self, engine: SlotServer) -> None:
        self.engine = engine
        self.client = httpx.AsyncClient(base_url=engine.url, timeout=UPSTREAM_TIMEOUT,
                                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    async def aclose(self) -> None:
        await self.client.aclose()

    def routes(self) -> list[Route]:
        cached = [Route(path, self.completion, methods=["POST"]) for path in (*inputs.CHAT_ROUTES, *inputs.TEXT_ROUTES)]
        return [*cached, Route("/slots/{rest:path}", self.slots, methods=["POST"]), Route("/slots", self.slots),
                Route("/{path:path}", self.forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])]

    def _headers(self, request: Request) -> dict[str, str]:
        settings = pod(request).settings
        return upstream_headers(request, settings.upstream_api_key, settings.multi_tenant)

    # -- every other route --------------------------------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        """Any route: to llama-server and back as it is, streamed."""
        state = pod(request)
        resolve_tenant(request, state.settings)
        if request.method in ("POST", "PUT", "PATCH"):  # the same size and time limits as a completion's
            content = await _read_body(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
        else:
            content = b""
        upstream_request = self.client.build_request(request.method, request.url.path, params=request.query_params,
                                                     content=content, headers=self._headers(request))
        return await self._relay(upstream_request)

    async def _relay(self, upstream_request: httpx.Request, extra: dict[str, str] | None = None) -> Response:
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except httpx.TransportError as exc:
            raise unavailable(exc) from None
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                 headers=_reply_headers(upstream, extra or {}),
                                 background=BackgroundTask(upstream.aclose))

    async def slots(self, request: Request) -> Response:
        """llama-server's slots belong to the sidecar: their actions are refused, and a pod of several tenants does not
        show one tenant what the slots hold."""
        state = pod(request)
        resolve_tenant(request, state.settings)
        if request.method != "GET" or state.settings.multi_tenant:
            raise ApiError(403, "the sidecar manages llama-server's slots (save, restore and erase are its own; "
                           "with tenants, so is the slot list)", code="slots_managed")
        return await self.forward(request)

    # -- completions --------------------------------------------------------------------------------------------------
    async def completion(self, request: Request) -> Response:
        state = pod(request)
        pipeline = ready_pipeline(state)
        tenant = resolve_tenant(request, state.settings)
        body = await read_json(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
        route = request.url.path
        headers = self._headers(request)
        how = inputs.plan(body, route, self.engine.adapters)
        if how.bypass is None and (self.engine.multimodal and how.chat):
            how = inputs.Plan(how.chat, bypass="multimodal-server")  # llama-server tokenizes its chats with mtmd
        if how.bypass is not None:
            return await self._bypass(route, body, headers, how.bypass)
        prompt = await self._tokens(body, how, headers)
        if isinstance(prompt, Response):
            return prompt  # llama-server refused the body: its status and message
        if not prompt or len(prompt) >= self.engine.geometry.max_context:
            return await self._bypass(route, body, headers, "length")
        salt = inputs.salt(tenant.salt, how.identity)
        ticket, view, _ = await admitted_lookup(state, salt, prompt, tenant.name)
        try:
            lease: SlotLease = await pipeline.in_engine(view, self.engine.lease, prompt, view.kv, view.ready,
                                                        how.slots, view.boundary)
        except BaseException:
            ticket.release()
            raise
        sent = {**body, "id_slot": lease.slot, "cache_prompt": self.engine.reuse_slots}
        call = _Call(self, pipeline, ticket, view, lease, salt)
        upstream_request = self.client.build_request("POST", route, content=json.dumps(sent).encode(),
                                                     headers={**headers, "content-type": "application/json"})
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except BaseException as exc:
            call.fail()
            if isinstance(exc, httpx.TransportError):
                raise unavailable(exc) from None
            raise
        extra = cache_headers(view)
        if not how.stream or upstream.status_code != 200:
            try:
                data = await upstream.aread()
            except BaseException:
                call.fail()
                raise
            finally:
                await upstream.aclose()
            await call.done(_timings(data) if upstream.status_code == 200 else None)
            return Response(data, status_code=upstream.status_code, headers=_reply_headers(upstream, extra))
        return StreamingResponse(call.relay(upstream), status_code=200, headers=_reply_headers(upstream, extra))

    async def _bypass(self, route: str, body: dict[str, Any], headers: dict[str, str], why: str) -> Response:
        self.engine.count_bypass(why)
        upstream_request = self.client.build_request("POST", route, content=json.dumps(body).encode(),
                                                     headers={**headers, "content-type": "application/json"})
        return await self._relay(upstream_request, BYPASS)

    async def _tokens(self, body: dict[str, Any], how: inputs.Plan, headers: dict[str, str]) -> list[int] | Response:
        """The prompt's token ids as llama-server will process them, or llama-server's refusal as a response."""
        auth = {k: v for k, v in headers.items() if k.lower() in ("authorization", "x-api-key")}
        try:
            prompt = how.prompt
            if how.chat:
                rendered = await self.client.post("/apply-template", json=body, headers=auth)
                if rendered.status_code != 200:
                    return Response(rendered.content, status_code=rendered.status_code,
                                    headers=_reply_headers(rendered, BYPASS))
                prompt = rendered.json().get("prompt")
            # what llama-server's completion does with a prompt: special tokens parsed, BOS added to a leading string
            tokenized = await self.client.post("/tokenize", json={"content": prompt, "add_special": True,
                                                                  "parse_special": True}, headers=auth)
        except httpx.TransportError as exc:
            raise unavailable(exc) from None
        if tokenized.status_code != 200:
            return Response(tokenized.content, status_code=tokenized.status_code,
                            headers=_reply_headers(tokenized, BYPASS))
        return [int(t) for t in tokenized.json().get("tokens", [])]


def _timings(data: bytes) -> dict[str, Any] | None:
    try:
        return inputs.timings_of(json.loads(data))
    except ValueError:
        return None


class _Call:
    """One cached completion in flight: its slots, and the write-back once llama-server has replied."""

    def __init__(self, side: Passthrough, pipeline: Pipeline, ticket: Ticket, view: CacheView, lease: SlotLease,
                 salt: bytes) -> None:
        self.side, self.pipeline, self.ticket, self.view, self.lease, self.salt = (side, pipeline, ticket, view,
                                                                                   lease, salt)
        self.settled = False

    def fail(self) -> None:
        """The request failed or the client left: the slots go back holding what nobody knows, and nothing is
        written."""
        if not self.settled:
            self.settled = True
            self.side.engine.abandon(self.lease)
            self.ticket.release()

    async def done(self, timings: dict[str, Any] | None) -> None:
        """Check the reuse, save the slot and write its KV back (bounded by the write budget), then release."""
        if self.settled:
            return
        self.settled = True
        engine = self.side.engine
        try:
            if timings is None:  # an error reply, or one without timings: nothing known to write back
                engine.abandon(self.lease)
                return
            reused = int(timings.get("cache_n", 0))
            writes = self.pipeline.writes_back  # --no-cache: nothing is written, so nothing saved
            saved = await asyncio.to_thread(engine.finish, self.lease, reused, self.pipeline.keep_from(self.view),
                                            writes)
            if saved is None:
                return
            prompt = self.lease.prompt
            gen = Generation(text="", token_ids=saved.tokens[len(prompt):], finish_reason="stop",
                             prompt_tokens=len(prompt), cached_tokens=reused, ttft_s=0.0, total_s=0.0,
                             seq_ids=saved.tokens, kv=saved.kv, reply_ids=None, kv_from=saved.kv_from,
                             boundaries=((len(saved.tokens), saved.boundary),) if saved.boundary else ())
            await self.pipeline.finish(self.salt, gen, self.view, prompt_tokens=len(prompt))
        finally:
            self.ticket.release()

    async def relay(self, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """llama-server's events as they come; from the first that ends a choice on, held until the write-back."""
        held: list[bytes] = []
        cache_n: int | None = None
        pending = b""
        try:
            async for chunk in upstream.aiter_raw():
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                out = []
                for raw in events:
                    event = raw + b"\n\n"
                    parsed = inputs.event_json(event)
                    if parsed is not None:
                        timings = inputs.timings_of(parsed)
                        if timings is not None and isinstance(timings.get("cache_n"), int):
                            cache_n = max(cache_n or 0, timings["cache_n"])
                        if held or inputs.is_final(parsed):
                            held.append(event)
                            continue
                    elif held or raw.strip() == b"data: [DONE]":
                        held.append(event)
                        continue
                    out.append(event)
                if out:
                    yield b"".join(out)
            if pending.strip():
                held.append(pending)
            await self.done({"cache_n": cache_n} if cache_n is not None else None)
            if held:
                yield b"".join(held)
        finally:
            self.fail()  # a stream cut short (the client left, llama-server failed): nothing written
            await upstream.aclose()

