"""One admitted generation, start to finish: admission, cache lookup, generation, the reply (JSON or SSE), write-back.

Every completion route (chat, text, server-side sessions) parses its request, then hands this module a
prompt, a lookup and an `after` step; the story from route to engine to store reads in one place.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from service.engines import Generation, GenParams
from service.engines.generation import Choice, ParamError, TokenLogprob
from service.engines.tools import parse_calls
from service.errors import ApiError, bad_request, error_body
from service.params import ToolSpec
from service.pipeline import CacheView, Pipeline
from service.state import PodState

# Called once generation is done with the generation and, for a chat, the assistant message as the reply gives it
# (its `tool_calls` and their ids included); returns an error message (409) or an ApiError when the reply could not
# be recorded.
AfterGeneration = Callable[[Generation, CacheView, "dict[str, Any] | None"], Awaitable[str | ApiError | None]]


class StreamClosed(Exception):
    """Raised from the token callback once the client has gone: it stops the generation."""


def _as_api_error(problem: str | ApiError) -> ApiError:
    return problem if isinstance(problem, ApiError) else ApiError(409, problem, code="session_conflict")


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
            content, calls = parse_calls(c.text, tools.parallel)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls"
        out.append({"index": index, "message": message, "logprobs": _chat_logprobs(c.logprobs),
                    "finish_reason": finish})
    return out


class Responder:
    """Runs one admitted generation and shapes it as a JSON reply or an SSE stream."""

    def __init__(self, state: PodState, chat: bool, model: str, view: CacheView, token_ids: bool = False,
                 tools: ToolSpec | None = None) -> None:
        self.state = state
        self.tools = tools
        self.token_ids = token_ids  # vLLM's `return_token_ids`: the prompt's and the reply's ids in the body
        self.chat = chat
        self.model = model
        self.view = view
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    async def reply(self, prompt_ids: list[int], params: GenParams, after: AfterGeneration) -> Response:
        pipeline = ready_pipeline(self.state)
        try:
            gen = await pipeline.generate(prompt_ids, self.view, params)
        except ParamError as exc:  # a parameter the engine cannot honour as given
            raise bad_request(str(exc), param=exc.param) from None
        except ValueError as exc:  # the runner refuses an input the parsers let through: the client's, not ours
            raise bad_request(str(exc), code="invalid_prompt") from None
        shaped = choices(gen, self.chat, self.tools)
        problem = await after(gen, self.view, shaped[0]["message"] if self.chat else None)
        if problem is not None:
            raise _as_api_error(problem)
        self._with_ids(shaped[0], gen)
        body = self._envelope(shaped, chunk=False)
        body["usage"] = usage(gen)
        if self.token_ids:
            body["prompt_token_ids"] = prompt_ids
        return JSONResponse(body, headers=cache_headers(self.view))

    def _with_ids(self, choice: dict[str, Any], gen: Generation) -> dict[str, Any]:
        if self.token_ids:
            choice["token_ids"] = gen.token_ids
        return choice

    def stream(
        self, prompt_ids: list[int], params: GenParams, include_usage: bool, after: AfterGeneration,
        release: Callable[[], None],
    ) -> Response:
        return StreamingResponse(
            self._events(prompt_ids, params, include_usage, after, release),
            media_type="text/event-stream",
            headers={**cache_headers(self.view), "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, prompt_ids: list[int], params: GenParams, include_usage: bool, after: AfterGeneration,
        release: Callable[[], None],
    ) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[str | None] = asyncio.Queue()
        pipeline = ready_pipeline(self.state)
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
            task = asyncio.ensure_future(pipeline.generate(prompt_ids, self.view, params, on_text))
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
            problem = await after(gen, self.view, {"role": "assistant", "content": gen.text} if self.chat else None)
            if problem is not None:
                err = _as_api_error(problem)
                yield self._sse(error_body(err.status, err.message, err.type, err.code, err.param))
            last = self._envelope([self._with_ids(_choice(self.chat, "", gen.finish_reason, delta=True), gen)],
                                  chunk=True)
            if self.token_ids:
                last["prompt_token_ids"] = prompt_ids
            yield self._sse(last)
            if include_usage:
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


async def run_admitted(
    state: PodState,
    *,
    chat: bool,
    model: str,
    prompt_ids: list[int],
    params: GenParams,
    stream: bool,
    include_usage: bool,
    lookup: Callable[[], Awaitable[CacheView]],
    after: AfterGeneration,
    token_ids: bool = False,
    tools: ToolSpec | None = None,
) -> Response:
    """Admission, lookup and generation for every completion route (sessions included)."""
    pipeline = ready_pipeline(state)
    pipeline.admit()
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            pipeline.release()

    handed_over = False  # a stream releases its admission when it ends
    try:
        view = await lookup()
        responder = Responder(state, chat, model, view, token_ids, tools)
        if stream:
            response = responder.stream(prompt_ids, params, include_usage, after, release)
            handed_over = True
            return response
        return await responder.reply(prompt_ids, params, after)
    finally:
        if not handed_over:
            release()
