"""OpenAI-compatible completions: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from service.engines.generation import ParamError
from service.http.errors import bad_request
from service.http.params import check_engine
from service.http.requests import parse_completion, read_json
from service.http.respond import check_context, check_model, pod, ready_pipeline, run_admitted
from service.http.tenancy import resolve_tenant
from service.http.turn import SessionTurn, Turn


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
    engine = state.engine
    assert engine is not None  # the lifespan loads it before the pipeline
    check_engine(req.params, body, honours_all=engine.honours_all_params)
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
        prompt_ids = engine.prompt_ids(req.prompt or "")
    check_context(state, prompt_ids, req.params)
    session = SessionTurn(req.session_id, req.messages) if req.session_id is not None else None
    return await run_admitted(state, Turn(
        chat=chat, model=req.model, tenant=tenant, prompt_ids=prompt_ids, params=req.params, stream=req.stream,
        include_usage=req.include_usage, session=session, token_ids=req.return_token_ids, tools=req.tools))


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

