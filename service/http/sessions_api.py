"""Server-side sessions for clients that send only the new turn: create, add messages, read, fork, delete."""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cachestore.sessions import SessionRecord
from cachestore.store import BlockStore
from service.cache.pipeline import Pipeline
from service.engines.generation import ParamError
from service.http.errors import ApiError, bad_request, not_found, redis_unavailable
from service.http.params import (
    SESSION_TURN,
    check_engine,
    check_keys,
    check_stream,
    check_stream_tools,
    parse_tools,
    with_tools,
)
from service.http.requests import (
    check_session_id,
    parse_flag,
    parse_message,
    parse_messages,
    parse_params,
    read_json,
    stream_flags,
)
from service.http.respond import check_context, pod, ready_pipeline, run_admitted
from service.http.tenancy import Tenant, resolve_tenant
from service.http.turn import SessionTurn, Turn
from service.state import PodState


def _store(state: PodState) -> BlockStore:
    if state.store is None:
        raise ApiError(501, "server-side sessions need the cache; this pod runs with --no-cache",
                       type_="server_error", code="sessions_disabled")
    return state.store


MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")  # what a session shows of a message


def session_json(record: SessionRecord) -> dict[str, Any]:
    return {
        "id": record.session_id,
        "object": "session",
        "model": record.model,
        "messages": [{k: m.get(k) for k in MESSAGE_FIELDS if k in ("role", "content") or m.get(k) is not None}
                     for m in record.messages],
        "tokens": len(record.token_ids),
        "version": record.version,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
    }


async def _load(state: PodState, tenant: Tenant, session_id: str) -> SessionRecord:
    read = await _store(state).read_session(tenant.name, session_id)
    if read.unavailable:  # Redis failed: not a "not found"
        raise redis_unavailable()
    if read.value is None:
        raise not_found(f"session {session_id!r} not found")
    return read.value


def _new_session_id(body: dict[str, Any]) -> str:
    """The id a client asked for (validated), else a random one."""
    if body.get("session_id") is not None:
        return check_session_id(body["session_id"])
    return "s-" + secrets.token_hex(12)


def _path_id(request: Request) -> str:
    return check_session_id(request.path_params["session_id"], param="session_id")


async def create_session(request: Request) -> Response:
    state = pod(request)
    tenant = resolve_tenant(request, state.settings)
    store = _store(state)
    body = await read_json(request, state.settings.max_body_bytes, state.settings.body_timeout_s, optional=True)
    check_keys(body, chat=True, known=("session_id", "messages"))
    session_id = _new_session_id(body)
    messages = parse_messages(body.get("messages", []), allow_empty=True)
    now = time.time()
    pipeline = ready_pipeline(state)
    record = SessionRecord(tenant=tenant.name, session_id=session_id, model=pipeline.model_key, token_ids=[],
                           messages=messages, created_at=now, updated_at=now)
    stored = await store.write_session(record, None)
    if stored.unavailable:
        raise redis_unavailable()
    if stored.value is None:
        raise ApiError(409, f"session {session_id!r} already exists", code="session_exists")
    return JSONResponse(session_json(stored.value), status_code=201)


async def get_session(request: Request) -> Response:
    state = pod(request)
    tenant = resolve_tenant(request, state.settings)
    return JSONResponse(session_json(await _load(state, tenant, _path_id(request))))


async def list_sessions(request: Request) -> Response:
    state = pod(request)
    tenant = resolve_tenant(request, state.settings)
    store = _store(state)
    ids = [session_id for _, session_id in await store.list_sessions(tenant.name)]
    return JSONResponse({"object": "list", "data": [{"id": i, "object": "session"} for i in sorted(ids)]})


async def delete_session(request: Request) -> Response:
    state = pod(request)
    tenant = resolve_tenant(request, state.settings)
    session_id = _path_id(request)
    if not await _store(state).delete_session(tenant.name, session_id):
        raise not_found(f"session {session_id!r} not found")
    return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})


async def fork_session(request: Request) -> Response:
    state = pod(request)
    tenant = resolve_tenant(request, state.settings)
    parent_id = _path_id(request)
    body = await read_json(request, state.settings.max_body_bytes, state.settings.body_timeout_s, optional=True)
    check_keys(body, chat=True, known=("session_id",))
    child_id = _new_session_id(body)
    await _load(state, tenant, parent_id)
    child = await _store(state).fork_session(tenant.name, parent_id, child_id)
    if child.unavailable:
        raise redis_unavailable()
    if child.value is None:
        raise ApiError(409, f"session {child_id!r} already exists", code="session_exists")
    return JSONResponse(session_json(child.value), status_code=201)


def _own_reply_ids(pipeline: Pipeline, messages: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Message index -> the ids recorded for an assistant reply, when they decode to exactly its text (a record
    is read from Redis: untrusted, like everything there)."""
    known: dict[int, list[int]] = {}
    for i, m in enumerate(messages):
        ids = m.get("token_ids")
        if (m.get("role") == "assistant" and isinstance(ids, list) and ids and len(ids) <= 1 << 16
                and all(isinstance(t, int) and 0 <= t < 2**31 for t in ids)
                and pipeline.decode(ids) == m.get("content")):
            known[i] = ids
    return known


def _history(record: SessionRecord) -> list[dict[str, Any]]:
    """The recorded conversation as the chat route would take it (tool calls, tool results and names kept), each
    message checked like a client's: the record comes from Redis."""
    try:
        return [parse_message({k: v for k, v in m.items() if k != "token_ids"}, f"session.messages[{i}]")
                for i, m in enumerate(record.messages)]
    except ApiError:
        raise ApiError(500, f"session {record.session_id!r} holds a message this pod cannot read; delete it",
                       type_="server_error", code="session_unreadable") from None


def _new_turn(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in body:
        if body.get("content") is not None:
            raise bad_request("send `messages` or `content`, not both", param="content")
        return parse_messages(body["messages"])
    if isinstance(body.get("content"), str):
        return [{"role": "user", "content": body["content"]}]
    raise bad_request("send `messages` (an array) or `content` (a string)", param="messages")


async def add_messages(request: Request) -> Response:
    """Append the new turn, generate the reply, and record both with compare-and-set. The body takes every parameter
    of a chat completion (service.http.params, SESSION_TURN), refused by name like there."""
    state = pod(request)
    tenant = resolve_tenant(request, state.settings)
    session_id = _path_id(request)
    body = await read_json(request, state.settings.max_body_bytes, state.settings.body_timeout_s)
    check_keys(body, chat=True, known=SESSION_TURN)
    new = _new_turn(body)
    pipeline = ready_pipeline(state)
    engine = state.engine
    assert engine is not None  # the lifespan loads it before the pipeline
    if body.get("model") is not None and body["model"] != engine.name:
        raise ApiError(404, f"model {body['model']!r} is not served here", code="model_not_found", param="model")
    params = parse_params(body, state.settings.max_tokens_limit, state.settings.default_max_tokens)
    stream, include_usage = stream_flags(body)
    check_stream(params, stream)
    tools = parse_tools(body)
    check_stream_tools(tools, stream)
    params = with_tools(params, tools)
    check_engine(params, body, honours_all=engine.honours_all_params)
    token_ids = parse_flag(body, "return_token_ids")
    record = await _load(state, tenant, session_id)
    messages = [*_history(record), *new]
    offered = tools.tools if tools is not None else None
    # the session keeps the ids this service generated for its own replies: its turns never re-tokenize them
    known = _own_reply_ids(pipeline, record.messages)
    try:
        prompt_ids = (engine.chat_ids(messages, known) if offered is None and not any(m.get("tool_calls")
                                                                                   for m in messages)
                      else engine.chat_ids(messages, known, offered))
    except ParamError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    check_context(state, prompt_ids, params)
    session = SessionTurn(session_id, [*record.messages, *new], record=record, server_side=True)  # recorded ids kept
    return await run_admitted(state, Turn(
        chat=True, model=engine.name, tenant=tenant, prompt_ids=prompt_ids, params=params, stream=stream,
        include_usage=include_usage, session=session, token_ids=token_ids, tools=tools))
