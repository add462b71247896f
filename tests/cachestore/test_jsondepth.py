"""JSON depth measured before parsing: untrusted text never drives the parser to the recursion limit."""

from __future__ import annotations

import json

import pytest

from cachestore import jsondepth
from cachestore.jsondepth import MAX_JSON_DEPTH, nesting_depth
from cachestore.sessions import SessionRecord, from_fields, to_fields
from service.engines.tools import parse_calls


@pytest.mark.parametrize(("text", "depth"), [
    (b"null", 0), (b'"[[[{"', 0), (b"[]", 1), (b'{"a": [1, {"b": []}]}', 4),
    (b'{"a": "\\"[[[[\\\\", "b": [[]]}', 3),  # escaped quotes and backslashes inside a string
    (b"[" * 20_000 + b"]" * 20_000, 20_000), (b'{"a":' * 5_000 + b"1" + b"}" * 5_000, 5_000),
    (b'["unterminated [[[', 4),  # no closing quote: its brackets count, the parser refuses it anyway
    ("[\"caf\u00e9\", [\"\ud800\"]]", 2),  # str input, a lone surrogate included
])
def test_nesting_depth(text: bytes | str, depth: int) -> None:
    assert nesting_depth(text) == depth


def test_matches_the_parsed_depth_on_real_documents() -> None:
    def parsed(value: object) -> int:
        if isinstance(value, dict):
            return 1 + max(map(parsed, value.values()), default=0)
        if isinstance(value, list):
            return 1 + max(map(parsed, value), default=0)
        return 0

    docs = [{"messages": [{"role": "user", "content": "a ] } [ { \" \\ b"}], "tools": [{"function": {
        "parameters": {"type": "object", "properties": {"x": {"enum": [[1], [2, [3]]]}}}}}]}, [], {}, [[[[]]]]]
    for doc in docs:
        assert nesting_depth(json.dumps(doc)) == parsed(doc)


def test_loads_refuses_deep_text_as_a_decode_error() -> None:
    assert jsondepth.loads('{"a": [1]}') == {"a": [1]}
    with pytest.raises(json.JSONDecodeError, match="nests deeper than 32"):
        jsondepth.loads("[" * 10_000 + "]" * 10_000)
    assert jsondepth.loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None


def test_a_model_reply_with_a_deep_tool_call_stays_text() -> None:
    deep = "<tool_call>\n" + '{"name": "f", "arguments": ' + "[" * 5_000 + "]" * 5_000 + "}\n</tool_call>"
    content, calls = parse_calls("before " + deep)
    assert calls == [] and content is not None and content.endswith("</tool_call>")


def test_a_session_record_with_deep_messages_reads_as_malformed() -> None:
    record = SessionRecord(tenant="t", session_id="s", model="m", token_ids=[1, 2], messages=[{"role": "user"}])
    pairs = to_fields(record, now=1.0)
    raw = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in zip(pairs[::2], pairs[1::2], strict=True)}
    raw |= {b"version": b"1", b"created_at": b"1.0"}  # what the write script adds
    assert from_fields(raw, "t", "s") is not None
    raw[b"messages"] = b"[" * 20_000 + b"]" * 20_000  # what any Redis writer could put there
    assert from_fields(raw, "t", "s") is None
