"""Tools and tool calls in a chat: handed to the model's own template, or written into the conversation as text.

A template that renders `tools` (it names the variable) gets them, and the assistant messages' `tool_calls`, as
transformers would hand them (arguments as objects). A template that does not (SmolLM2's) would drop them without
a word: kvstash then writes them in the Hermes format that many models are trained on, as message content (plain
text, never special tokens): the tools into the system message, each call as `<tool_call>{"name", "arguments"}
</tool_call>` after the assistant's content. Replies are parsed for `<tool_call>` blocks either way.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from typing import Any

from cachestore import jsondepth
from service.engines.generation import Detokenizer, GenParams, ParamError, TextStream

Message = dict[str, Any]

HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with the function name and arguments within <tool_call>"
    "</tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # what a forced call's grammar writes around its JSON
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def renders_tools(template: str) -> bool:
    """Whether a chat template renders the `tools` it is given (it names the variable)."""
    return re.search(r"\btools\b", template) is not None


def _arguments(call: dict[str, Any]) -> Any:
    raw = call["function"].get("arguments")
    if isinstance(raw, str):
        try:
            return jsondepth.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw if raw is not None else {}


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _check_plain(value: Any, specials: frozenset[str], param: str) -> None:
    """Template text is tokenized with special tokens recognised: a tool or a call may not spell one."""
    for text in _strings(value):
        for special in specials:
            if special and special in text:
                raise ParamError(f"{param} contains the model's special token {special!r}", param)


def for_template(messages: list[Message], tools: tuple[dict[str, Any], ...] | None, template: str,
                 specials: frozenset[str]) -> tuple[list[Message], list[dict[str, Any]] | None, dict[int, int]]:
    """The messages and tools to render with `template`: natively when it renders tools, else folded into the
    messages' content (the module's docstring); and where each message whose content is unchanged now stands."""
    has_calls = any(m.get("tool_calls") for m in messages)
    same = {i: i for i in range(len(messages))}
    if not tools and not has_calls:
        return messages, None, same
    if renders_tools(template):
        _check_plain(list(tools or ()), specials, "tools")
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in m["tool_calls"]]
                _check_plain(calls, specials, "messages")
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out, list(tools) if tools else None, same
    folded = fold(messages, tools)
    shift = len(folded) - len(messages)  # a system message inserted first
    kept = {i: i + shift for i, m in enumerate(messages) if not m.get("tool_calls") and not (shift == 0 and i == 0
                                                                                             and tools)}
    return folded, None, kept


def fold(messages: list[Message], tools: tuple[dict[str, Any], ...] | None) -> list[Message]:
    """Tools and tool calls written into the messages' content in the Hermes format."""
    out: list[Message] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": _arguments(c)}) + "\n</tool_call>"
                              for c in m["tool_calls"])
            content = m.get("content") or ""
            m = {"role": m["role"], "content": f"{content}\n{calls}" if content else calls}
        else:
            m = {k: v for k, v in m.items() if k in ("role", "content")}
        out.append(m)
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = HERMES_SYSTEM.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{system}\n\n{out[0].get('content') or ''}".rstrip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def repeated_call(text: str) -> int | None:
    """Where to end a reply of forced calls whose last `<tool_call>` block repeats an earlier one word for word (a
    small model loops so until max_tokens): the end of the block before it. None while the reply does not."""
    if not text.rstrip().endswith(CALL_CLOSE.strip()):
        return None
    blocks = list(_CALL.finditer(text))
    if len(blocks) < 2 or blocks[-1].group(1) not in {b.group(1) for b in blocks[:-1]}:
        return None
    return blocks[-2].end()


def _open_fragment(text: str) -> int:
    """Where a `<tool_call>` block the reply was cut inside begins, or its tag was cut (len(text) when none is)."""
    opened = text.rfind("<tool_call>")
    if opened >= 0 and text.find("</tool_call>", opened) < 0:
        return opened
    tag = next((k for k in range(len("<tool_call>") - 1, 0, -1) if text.endswith("<tool_call>"[:k])), 0)
    return len(text) - tag


def parse_calls(text: str, parallel: bool = True,
                cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's content without its `<tool_call>` blocks, and the calls in OpenAI's shape (the blocks that are
    JSON objects with a string `name`; any other block stays in the content). A call repeated word for word is one
    call. `cut`: the reply ended at max_tokens, so a block it was cut inside is dropped, not left as content."""
    if cut:
        text = text[:_open_fragment(text)]
    calls: list[dict[str, Any]] = []
    seen: set[str] = set()
    kept: list[str] = []
    at = 0
    for match in _CALL.finditer(text):
        try:
            call = jsondepth.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        if match.group(1) in seen:
            continue
        seen.add(match.group(1))
        if parallel or not calls:
            arguments = call.get("arguments", {})
            calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
    if not calls:
        return (text.strip() or None) if cut else text, []
    kept.append(text[at:])
    content = "".join(kept).strip()
    return content or None, calls


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with no property the tool does not name, unless it says otherwise (as llama.cpp's
    grammars and OpenAI's strict mode read them): a forced call of a small model otherwise fills one invented
    property after another until max_tokens."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def call_schema(tools: Iterable[dict[str, Any]], names: Iterable[str]) -> dict[str, Any]:
    """The JSON schema of one call to any of `names` among `tools`: `{"name": <one of them>, "arguments": <its
    parameters>}` (a tool without `parameters` takes none)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": name},
                               "arguments": _closed(by_name[name].get("parameters") or NO_ARGUMENTS)}}
               for name in dict.fromkeys(names)]
    return options[0] if len(options) == 1 else {"anyOf": options}


def text_stream(tokenizer: Detokenizer, params: GenParams, on_text: Callable[[str], None] | None) -> TextStream:
    """The reply's text stream for `params`: its stop strings, and for forced parallel tool calls the end of a reply
    that starts repeating a call."""
    forced_calls = params.response_format is not None and params.response_format.calls > 1
    return TextStream(tokenizer, params.stop, on_text, repeated_call if forced_calls else None)
