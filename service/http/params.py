"""Every OpenAI request parameter of the completion routes: honoured, a known no-op, or refused with a 400 naming it.

The tables below are the one list (docs/parameters.md explains each row). A body key in none of them is refused
as unknown: a client that asks for something kvstash does not know must not get a reply that ignored it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from service.engines import GenParams
from service.engines.generation import ParamError, ResponseFormat
from service.engines.guides import llg_grammar, schema_text
from service.engines.tools import call_schema
from service.http.errors import ApiError, bad_request

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20  # chat (OpenAI's bound)
MAX_TEXT_LOGPROBS = 5  # text completions (OpenAI's bound)
MAX_N = 8
MAX_LOGIT_BIAS = 300

# parsed and honoured (see parse_params, parse_tools and the routes)
COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
          "top_k", "min_p", "repetition_penalty",  # vLLM's and llama-server's extensions
          "session_id", "return_token_ids")  # kvstash's own
CHAT = (*COMMON, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
        "parallel_tool_calls", "modalities", "store", "metadata", "service_tier")
TEXT = (*COMMON, "prompt", "echo", "suffix", "best_of")
# a turn of a server-side session (POST /v1/sessions/{id}/messages): the chat's, the session named by the path, and
# `content` (one user message) instead of `messages`
SESSION_TURN = (*(k for k in CHAT if k != "session_id"), "content")
# accepted and without effect on the reply, by their definition
NO_OPS = ("user", "safety_identifier", "prompt_cache_key")
# refused whatever their value (but null): why, in the 400
REFUSED = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the served model has no reasoning setting",
    "verbosity": "the served model has no verbosity setting",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated `functions` is not supported: send `tools`",
    "function_call": "the deprecated `function_call` is not supported: send `tool_choice`",
}


def unsupported(name: str, why: str) -> ApiError:
    return bad_request(f"{name}: {why}", param=name, code="unsupported_parameter")


def check_keys(body: dict[str, Any], chat: bool, known: tuple[str, ...] | None = None) -> None:
    """Refuse a key no table holds (`known`, by default the chat's or the text route's), and the REFUSED ones unless
    null."""
    known = known if known is not None else CHAT if chat else TEXT
    for key, value in body.items():
        if key in known or key in NO_OPS:
            continue
        if key in REFUSED:
            if value is not None:
                raise unsupported(key, REFUSED[key])
            continue
        raise bad_request(f"unknown parameter {key!r}: kvstash refuses what it does not know rather than ignore "
                          "it (docs/parameters.md lists every parameter)", param=key, code="unknown_parameter")
    _check_values(body, chat)


def _check_values(body: dict[str, Any], chat: bool) -> None:
    """The parameters honoured only at some values: the others are refused by name."""
    if body.get("modalities") not in (None, ["text"]):
        raise unsupported("modalities", 'only ["text"] is supported')
    if body.get("store") not in (None, False):
        raise unsupported("store", "kvstash does not store completions for later retrieval")
    if body.get("metadata") not in (None, {}):
        raise unsupported("metadata", "metadata is kept only with `store`, which is not supported")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier", 'only "auto" and "default" are served')
    if not chat:
        if body.get("echo") not in (None, False):
            raise unsupported("echo", "echoing the prompt is not supported")
        if body.get("suffix") not in (None, ""):
            raise unsupported("suffix", "insertion after a suffix is not supported")
        if body.get("best_of") not in (None, 1, body.get("n", 1)):
            raise unsupported("best_of", "best_of is supported only equal to n (no server-side ranking)")


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name} must be a number", param=name)
    if not lo <= float(value) <= hi:
        raise bad_request(f"{name} must be between {lo} and {hi}", param=name)
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", param=name)
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be between {lo} and {hi}", param=name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) and s for s in stop):
        return tuple(stop)
    raise bad_request(f"stop must be a string or an array of at most {MAX_STOP} non-empty strings", param="stop")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives to report per token (0: the chosen token only); None: no logprobs."""
    if not chat:  # text completions: `logprobs` is the number of alternatives
        return _int(body, "logprobs", None, 0, MAX_TEXT_LOGPROBS)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request("logprobs must be a boolean", param="logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids", param="logit_bias")
    out = []
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < 2**31):
            raise bad_request("logit_bias keys must be token ids", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise bad_request("logit_bias values must be numbers in [-100, 100]", param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _response_format(body: dict[str, Any]) -> ResponseFormat | None:
    raw = body.get("response_format")
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        fmt = ResponseFormat()
    elif kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              param="response_format")
        fmt = ResponseFormat(schema_text(schema))
    else:
        raise bad_request('response_format.type must be "text", "json_object" or "json_schema"',
                          param="response_format")
    try:
        llg_grammar(fmt)  # an unusable schema is the client's 400 now, not a failed generation later
    except ParamError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    return fmt


def parse_params(body: dict[str, Any], max_tokens_limit: int, default_max_tokens: int,
                 chat: bool = True) -> GenParams:
    """The sampling parameters of a completion body (validated; a bad one is a 400 naming it)."""
    max_tokens = _int(body, "max_completion_tokens", None, 1, max_tokens_limit) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", default_max_tokens, 1, max_tokens_limit)
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:  # only the most likely token survives: that is greedy decoding
        temperature, top_p = 0.0, 1.0
    return GenParams(
        max_tokens=int(max_tokens or default_max_tokens),
        temperature=temperature,
        top_p=top_p,
        seed=_int(body, "seed", None, -(2**63), 2**63 - 1),
        stop=_stop(body),
        n=int(_int(body, "n", 1, 1, MAX_N) or 1),
        top_k=max(0, int(_int(body, "top_k", 0, -1, 1 << 20) or 0)),  # -1: vLLM's "no limit"
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logprobs=_logprobs(body, chat),
        logit_bias=_logit_bias(body),
        response_format=_response_format(body) if chat else None,
    )


def check_stream(params: GenParams, stream: bool) -> None:
    """What a stream does not carry yet: several choices, logprobs."""
    if not stream:
        return
    if params.n > 1:
        raise unsupported("n", "n > 1 is supported without stream only")
    if params.logprobs is not None:
        raise unsupported("logprobs", "logprobs are supported without stream only")


def check_stream_tools(tools: ToolSpec | None, stream: bool) -> None:
    """Tool calls are parsed out of a whole reply: a stream cannot carry them yet."""
    if stream and tools is not None:
        raise unsupported("tools", "tool calls are parsed out of a reply without stream only")


def check_engine(params: GenParams, body: dict[str, Any], honours_all: bool) -> None:
    """An engine that honours the basic sampling parameters only (the llama-server sidecar's, which passes the
    rest on its own) refuses every other one that is set."""
    if honours_all:
        return
    for name in ("tools", "tool_choice"):
        if body.get(name) is not None:
            raise unsupported(name, "this engine does not honour it")
    basic = GenParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                      seed=params.seed, stop=params.stop)
    wanted, plain = dataclasses.asdict(params), dataclasses.asdict(basic)
    for name, value in wanted.items():
        if value != plain[name]:
            raise unsupported(name, "this engine does not honour it")


@dataclass(frozen=True)
class ToolSpec:
    """The tools a chat request offers, and whether the reply is parsed for calls to them."""

    tools: tuple[dict[str, Any], ...]  # OpenAI's [{"type": "function", "function": {...}}]
    parallel: bool = True
    forced: tuple[str, ...] = ()  # tool_choice "required" (every tool) or a named function: the reply calls one

    def response_format(self) -> ResponseFormat | None:
        """The grammar of a forced call (None when the model may answer in prose)."""
        if not self.forced:
            return None
        # not schema_text: key order kept, so the grammar writes the name before the arguments it chooses
        schema = json.dumps(call_schema(self.tools, self.forced), separators=(",", ":"))
        return ResponseFormat(schema, calls=2 if self.parallel else 1)


def _forced(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, ...]:
    """The functions `tool_choice` forces a call to (none for "auto" and "none")."""
    names = [t["function"]["name"] for t in tools]
    if choice == "required":
        return tuple(names)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              '{"name": ...}}', param="tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
        return (name,)
    return ()


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """`tools` and `tool_choice`: "none" (the tools are not rendered), "auto" (the default), "required" or a named
    function (a call forced by a grammar: ToolSpec.response_format)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise bad_request("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if choice not in (None, "none", "auto", "required") and not isinstance(choice, dict):
        raise bad_request('tool_choice must be "none", "auto", "required" or a named function', param="tool_choice")
    if choice is not None and choice not in ("none", "auto") and not raw:
        raise bad_request("tool_choice forces a call: it needs `tools`", param="tool_choice")
    if raw is None or choice == "none":
        return None
    if not isinstance(raw, list) or len(raw) > 128:
        raise bad_request("tools must be an array of at most 128 tools", param="tools")
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    if not raw:
        return None
    spec = ToolSpec(tuple(raw), parallel is not False, _forced(choice, raw))
    fmt = spec.response_format()
    if fmt is not None:
        try:
            llg_grammar(fmt)  # a tool schema no grammar can follow is the client's 400 now
        except ParamError as exc:
            raise bad_request(str(exc), param=exc.param) from None
    return spec


def with_tools(params: GenParams, tools: ToolSpec | None) -> GenParams:
    """The parameters with a forced call's grammar; a forced call and `response_format` together are refused (the
    reply cannot be both)."""
    fmt = tools.response_format() if tools is not None else None
    if fmt is None:
        return params
    if params.response_format is not None:
        raise unsupported("response_format", "a forced tool call (tool_choice) and response_format cannot both "
                          "constrain the reply")
    return dataclasses.replace(params, response_format=fmt)
