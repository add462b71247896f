"""OpenAI-compatible completions: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cachestore.sessions import SessionRecord
from service.engines import Generation
from service.engines.generation import ParamError
from service.errors import bad_request
from service.params import IN_PROCESS, check_engine
from service.pipeline import CacheView
from service.requests import parse_completion, read_json
from service.respond import check_context, check_model, pod, ready_pipeline, run_admitted
from service.tenancy import resolve_tenant


async def _completion(request: Request, chat: bool) -> Response:
    state = pod(request)
    pipeline = ready_pipeline(state)
    tenant = resolve_tenant(request, state.settings)
    body = await read_json(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    req = parse_completion(
        body, chat=chat, header_session=request.headers.get("x-session-id"),
        max_tokens_limit=state.settings.max_tokens_limit, default_max_tokens=state.settings.default_max_tokens,
    )
    check_model(state, req.model)
    engine = pipeline.engine
    check_engine(req.params, body, honours_all=engine.kind in IN_PROCESS)
    tools = req.tools.tools if req.tools is not None else None
    if req.messages is not None:  # assistant messages some pod generated keep the very ids it generated
        known = await pipeline.known_replies(tenant.salt, req.messages)
        try:
            prompt_ids = (engine.chat_ids(req.messages, known) if tools is None and not _calls(req.messages)
                          else engine.chat_ids(req.messages, known, tools))
        except ParamError as exc:
            raise bad_request(str(exc), param=exc.param) from None
    elif req.prompt_ids is not None:
        prompt_ids = list(req.prompt_ids)
    else:
        prompt_ids = engine.text_ids(req.prompt or "")
    check_context(state, prompt_ids, req.params)
    previous: SessionRecord | None = None

    async def lookup() -> CacheView:
        nonlocal previous
        key = (tenant.name, req.session_id) if req.session_id else None
        view, previous = await pipeline.lookup(tenant.salt, prompt_ids, session_key=key, tenant=tenant.name)
        return view

    async def after(gen: Generation, view: CacheView) -> str | None:
        record = None
        if req.session_id is not None and req.messages is not None:
            messages = [*req.messages, {"role": "assistant", "content": gen.text}]
            record = pipeline.session_record(tenant.name, req.session_id, messages, gen, previous)
        # the next turn may be sent the moment this reply ends, to any pod: its blocks go first
        await pipeline.settle(pipeline.write_back(tenant.salt, gen, view, record,
                                                  previous.version if previous else None), view)
        return None

    return await run_admitted(
        state, chat=chat, model=req.model, prompt_ids=prompt_ids, params=req.params, stream=req.stream,
        include_usage=req.include_usage, lookup=lookup, after=after, token_ids=req.return_token_ids,
        tools=req.tools,
    )


def _calls(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") for m in messages)


async def chat_completions(request: Request) -> Response:
    return await _completion(request, chat=True)


async def completions(request: Request) -> Response:
    return await _completion(request, chat=False)


async def list_models(request: Request) -> Response:
    state = pod(request)
    resolve_tenant(request, state.settings)
    data = []
    if state.engine is not None:
        data.append({"id": state.engine.name, "object": "model", "created": int(state.started_at),
                     "owned_by": "kvstash", "context_length": state.engine.geometry.max_context,
                     "engine": state.engine.kind})
    return JSONResponse({"object": "list", "data": data})

