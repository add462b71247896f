"""One admitted generation, start to finish: admission, cache lookup, generation, the reply (JSON or SSE), write-back.

Every completion route (chat, text, server-side sessions) parses its request, then hands this module a `Turn`
(service.http.turn): the story from route to engine to store reads in one place, and what the write-back did comes back
as an outcome that this module turns into the client's status.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cachestore.outcome import Outcome
from cachestore.sessions import SessionRecord
from service.cache.cacheview import CacheView
from service.cache.pipeline import Pipeline
from service.engines import Generation, GenParams
from service.engines.generation import Choice, ParamError, TokenLogprob
from service.engines.tools import parse_calls
from service.http.admission import Ticket
from service.http.errors import ApiError, bad_request, error_body, redis_unavailable, session_conflict
from service.http.params import ToolSpec
from service.http.turn import SessionTurn, Turn
from service.state import PodState


class StreamClosed(Exception):
    """Raised from the token callback once the client has gone: it stops the generation."""


def pod(request: Request) -> PodState:
    state: PodState = request.app.state.pod
    return state


def ready_pipeline(state: PodState) -> Pipeline:
    """The pod's pipeline (the lifespan builds it before the server takes a request)."""
    assert state.pipeline is not None
    return state.pipeline


def check_model(state: PodState, model: str) -> None:
    assert state.engine is not None
    if model != state.engine.name:
        raise ApiError(404, f"model {model!r} is not served here; this pod serves {state.engine.name!r}",
                       code="model_not_found", param="model")


def check_context(state: PodState, prompt_ids: list[int], params: GenParams) -> None:
    assert state.engine is not None
    limit = state.engine.geometry.max_context
    if len(prompt_ids) + params.max_tokens > limit:
        raise bad_request(
            f"the prompt has {len(prompt_ids)} tokens and max_tokens is {params.max_tokens}; "
            f"together they exceed the model's context of {limit} tokens",
            param="messages", code="context_length_exceeded",
        )


def cache_headers(view: CacheView) -> dict[str, str]:
    return {"X-KV-Cache": view.status, "X-KV-Cached-Tokens": str(view.cached_tokens)}


def usage(gen: Generation) -> dict[str, Any]:
    completion = len(gen.token_ids) + sum(len(c.token_ids) for c in gen.choices)  # every choice's tokens
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": gen.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def _choice(chat: bool, text: str, finish_reason: str | None, delta: bool, first: bool = False) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if delta:
        body: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": body if text or first else {}, "finish_reason": finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}


def _chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token_bytes),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top]}
                        for e in entries], "refusal": None}


def _text_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for t, _, lp in e.top} for e in entries], "text_offset": offsets}


def choices(gen: Generation, chat: bool, tools: ToolSpec | None) -> list[dict[str, Any]]:
    """Every choice of a finished generation in OpenAI's shape; with tools, `<tool_call>` blocks become
    `tool_calls` (finish_reason "tool_calls")."""
    every = [Choice(gen.text, gen.token_ids, gen.finish_reason, gen.logprobs), *gen.choices]
    out = []
    for index, c in enumerate(every):
        if not chat:
            out.append({"index": index, "text": c.text, "logprobs": _text_logprobs(c.logprobs),
                        "finish_reason": c.finish_reason})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if tools is not None:
            cut = c.finish_reason == "length"
            content, calls = parse_calls(c.text, tools.parallel, cut=cut)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                finish = "length" if cut else "tool_calls"  # a reply cut at max_tokens says so
        out.append({"index": index, "message": message, "logprobs": _chat_logprobs(c.logprobs),
                    "finish_reason": finish})
    return out


class Responder:
    """Runs one admitted turn and shapes it as a JSON reply or an SSE stream."""

    def __init__(self, state: PodState, turn: Turn, view: CacheView, previous: SessionRecord | None) -> None:
        self.state = state
        self.turn = turn
        self.chat = turn.chat
        self.view = view
        self.previous = previous  # the session's record before this turn (read by the route or the lookup)
        self.id = ("chatcmpl-" if turn.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if turn.chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.turn.model, "choices": choices}

    async def _write_back(self, gen: Generation, reply: dict[str, Any] | None) -> ApiError | None:
        """Write back once generation is done (`reply`: for a chat, the assistant message as the reply gives it);
        the next turn may be sent the moment this reply ends, to any pod: its blocks go first. An error when the
        turn's session had to record the reply and could not."""
        pipeline = ready_pipeline(self.state)
        turn, session = self.turn, self.turn.session
        write = session.write(pipeline, turn.tenant.name, gen, reply, self.previous) if session is not None else None
        outcome = await pipeline.finish(turn.tenant.salt, gen, self.view, write)
        if write is None or not write.strict or outcome is Outcome.STORED:
            return None
        assert session is not None
        return session_conflict(session.session_id) if outcome is Outcome.CONFLICT else redis_unavailable()

    async def reply(self) -> Response:
        pipeline = ready_pipeline(self.state)
        turn = self.turn
        try:
            gen = await pipeline.generate(turn.prompt_ids, self.view, turn.params)
        except ParamError as exc:  # a parameter the engine cannot honour as given
            raise bad_request(str(exc), param=exc.param) from None
        except ValueError as exc:  # the runner refuses an input the parsers let through: the client's, not ours
            raise bad_request(str(exc), code="invalid_prompt") from None
        shaped = choices(gen, self.chat, turn.tools)
        problem = await self._write_back(gen, shaped[0]["message"] if self.chat else None)
        if problem is not None:
            raise problem
        self._with_ids(shaped[0], gen)
        body = self._envelope(shaped, chunk=False)
        body["usage"] = usage(gen)
        if turn.token_ids:
            body["prompt_token_ids"] = turn.prompt_ids
        return JSONResponse(body, headers=cache_headers(self.view))

    def _with_ids(self, choice: dict[str, Any], gen: Generation) -> dict[str, Any]:
        if self.turn.token_ids:
            choice["token_ids"] = gen.token_ids
        return choice

    def stream(self, release: Callable[[], None]) -> Response:
        return StreamingResponse(
            self._events(release),
            media_type="text/event-stream",
            headers={**cache_headers(self.view), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(self, release: Callable[[], None]) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[str | None] = asyncio.Queue()
        pipeline = ready_pipeline(self.state)
        turn = self.turn
        closed = threading.Event()

        def on_text(delta: str) -> None:  # runs on the inference thread
            if closed.is_set():
                raise StreamClosed  # the client hung up: stop generating for nobody
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        def finished(task: asyncio.Future[Generation]) -> None:
            deltas.put_nowait(None)
            if not task.cancelled():
                task.exception()  # retrieved here, so an abandoned stream logs no "never retrieved" warning

        try:
            task = asyncio.ensure_future(pipeline.generate(turn.prompt_ids, self.view, turn.params, on_text))
            task.add_done_callback(finished)
            yield self._sse(self._envelope([_choice(self.chat, "", None, delta=True, first=True)], chunk=True))
            while (delta := await deltas.get()) is not None:
                if delta:
                    yield self._sse(self._envelope([_choice(self.chat, delta, None, delta=True)], chunk=True))
            try:
                gen = task.result()
            except ValueError as exc:
                yield self._sse(error_body(400, str(exc), "invalid_request_error", "invalid_prompt", None))
                yield "data: [DONE]\n\n"
                return
            except Exception:  # noqa: BLE001 - any engine failure ends the stream with a 500 event
                yield self._sse(error_body(500, "generation failed", "server_error", "internal_error", None))
                yield "data: [DONE]\n\n"
                return
            # a stream carries no tool calls (refused with one): its message is the text
            err = await self._write_back(gen, {"role": "assistant", "content": gen.text} if self.chat else None)
            if err is not None:
                yield self._sse(error_body(err.status, err.message, err.type, err.code, err.param))
            last = self._envelope([self._with_ids(_choice(self.chat, "", gen.finish_reason, delta=True), gen)],
                                  chunk=True)
            if turn.token_ids:
                last["prompt_token_ids"] = turn.prompt_ids
            yield self._sse(last)
            if turn.include_usage:
                final = self._envelope([], chunk=True)
                final["usage"] = usage(gen)
                yield self._sse(final)
            yield "data: [DONE]\n\n"
        finally:
            closed.set()
            release()

    @staticmethod
    def _sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def admitted_lookup(state: PodState, tenant_salt: bytes, prompt_ids: list[int], tenant: str,
                          session: SessionTurn | None = None) -> tuple[Ticket, CacheView, SessionRecord | None]:
    """The one way in for every cached request, the routes' turns and the sidecar's completions alike: admission
    (or a 503), then the cache lookup; the ticket is the caller's to release once the reply has ended (a failed
    lookup releases it here)."""
    pipeline = ready_pipeline(state)
    ticket = state.admission.admit()
    try:
        view, previous = await pipeline.lookup(
            tenant_salt, prompt_ids, session=session.record if session is not None else None,
            session_key=session.lookup_key(tenant) if session is not None else None, tenant=tenant)
    except BaseException:
        ticket.release()
        raise
    return ticket, view, previous


async def run_admitted(state: PodState, turn: Turn) -> Response:
    """Admission, lookup, generation, reply and write-back of one turn, for every completion route (sessions
    included)."""
    ticket, view, previous = await admitted_lookup(state, turn.tenant.salt, turn.prompt_ids, turn.tenant.name,
                                                   turn.session)
    try:
        responder = Responder(state, turn, view, previous)
        if turn.stream:
            return responder.stream(ticket.release)  # the stream releases its admission when it ends
    except BaseException:
        ticket.release()
        raise
    try:
        return await responder.reply()
    finally:
        ticket.release()
