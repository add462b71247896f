"""Every OpenAI parameter honoured or refused by name: the hf engine in-process against a real private Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from ops.redisproc import RedisProcess
from tests.support import chat, make_client, wait_written

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
HISTORY = [{"role": "system", "content": "You are a helpful assistant. " * 8},
           {"role": "user", "content": "Tell me about the printing press."}]


class Reply(BaseModel):
    name: str = Field(max_length=6)  # bounded: the random test model would fill an unbounded string
    ok: bool
    n: int = Field(ge=0, le=99)


@pytest.fixture
def client(redis_server: RedisProcess, tiny_model: Any) -> Iterator[TestClient]:
    with make_client(redis_server, tiny_model, pod_name="pod-params") as c:
        yield c


def test_json_schema_reply_validates(client: TestClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    r = chat(client, HISTORY, response_format=fmt, max_tokens=64)
    assert r.status_code == 200, r.text
    Reply.model_validate_json(r.json()["choices"][0]["message"]["content"])
    obj = chat(client, HISTORY, response_format={"type": "json_object"}, max_tokens=64, logit_bias={"92": 5})
    assert obj.status_code == 200, obj.text


def test_logprobs_shapes(client: TestClient) -> None:
    r = chat(client, HISTORY, logprobs=True, top_logprobs=3)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert content and len(content) <= r.json()["usage"]["completion_tokens"]
    for entry in content:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the chosen token is the likeliest
        assert entry["logprob"] == pytest.approx(tops[0])
    text = client.post("/v1/completions", json={"model": "tiny-random", "prompt": "Once upon a time",
                                                "max_tokens": 6, "logprobs": 2}).json()
    lp = text["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert "".join(lp["tokens"]) == text["choices"][0]["text"]


def test_n_top_k_and_penalties(client: TestClient) -> None:
    greedy = chat(client, HISTORY).json()
    two = chat(client, HISTORY, n=2, temperature=1.0, seed=7).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["completion_tokens"] >= 2
    top1 = chat(client, HISTORY, temperature=1.0, top_k=1, seed=3).json()
    assert top1["choices"][0]["message"] == greedy["choices"][0]["message"]
    long = chat(client, HISTORY, max_tokens=64, return_token_ids=True).json()["choices"][0]
    assert len(set(long["token_ids"])) < len(long["token_ids"])  # the greedy reply repeats a token: penalties bite
    for penalty in ({"repetition_penalty": 3.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalised = chat(client, HISTORY, max_tokens=64, **penalty).json()["choices"][0]["message"]["content"]
        assert penalised != long["message"]["content"], penalty
    assert chat(client, HISTORY, min_p=0.5, temperature=1.0, seed=1).status_code == 200


def test_hit_with_parameters_replies_as_cold(client: TestClient) -> None:
    extra = {"logprobs": True, "top_logprobs": 2, "repetition_penalty": 1.3}
    cold = chat(client, HISTORY, **extra)
    wait_written(client)
    hit = chat(client, HISTORY, **extra)
    assert hit.headers["x-kv-cache"] == "hit"
    (got,), (want,) = hit.json()["choices"], cold.json()["choices"]
    assert got["message"] == want["message"] and got["finish_reason"] == want["finish_reason"]
    for a, b in zip(got["logprobs"]["content"], want["logprobs"]["content"], strict=True):
        # the same tokens and alternatives; the logprobs agree to float32 noise (~1e-6 measured: the hit's step and
        # the prefill's last row are different matrix shapes)
        assert a["token"] == b["token"] and [t["token"] for t in a["top_logprobs"]] == [
            t["token"] for t in b["top_logprobs"]]
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


def test_agent_history_is_rendered(client: TestClient, tiny_model: Any) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [*HISTORY,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "RAINY-17C"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny-random", "messages": messages, "tools": tools,
                                                   "max_tokens": 4})
    assert r.status_code == 200, r.text
    state = client.app.state.pod  # type: ignore[attr-defined]
    prompt = state.engine.decode(state.engine.chat_ids(messages, None, tuple(tools)))
    assert "RAINY-17C" in prompt and '"city": "Oslo"' in prompt and "weather" in prompt


def test_deeply_nested_call_arguments_are_rendered_as_text(client: TestClient, tiny_model: Any) -> None:
    """A history's `arguments` string that nests past the JSON depth limit is not parsed (the parser would recurse
    to the interpreter's limit): it reaches the template as the string it is."""
    deep = "[" * 1_200 + "]" * 1_200  # past the parser's recursion limit, within the tiny model's context
    messages = [*HISTORY, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "RAINY-17C"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny-random", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    state = client.app.state.pod  # type: ignore[attr-defined]
    assert deep in state.engine.decode(state.engine.chat_ids(messages, None, None))


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}


@pytest.mark.parametrize(("choice", "names"), [("required", {"weather", "clock"}),
                                               ({"type": "function", "function": {"name": "weather"}}, {"weather"})])
def test_a_forced_tool_call_is_a_valid_call(client: TestClient, choice: Any, names: set[str]) -> None:
    """tool_choice "required" or a named function: a grammar makes the reply a call to one of those tools, with
    arguments that validate against its parameters, even from a model of random weights."""
    for parallel in (False, True):
        r = chat(client, HISTORY, tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=parallel,
                 max_tokens=48)
        assert r.status_code == 200, r.text
        choice_ = r.json()["choices"][0]
        assert choice_["finish_reason"] == "tool_calls", choice_
        calls = choice_["message"]["tool_calls"]
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert call["function"]["name"] in names and call["id"].startswith("call_")
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "weather":
                assert set(arguments) == {"city"} and len(arguments["city"]) <= 8
            else:
                assert arguments == {}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "stream": True}, "tools"),
    ({"stream": True}, "tools"),
])
def test_a_call_that_cannot_be_forced_is_refused_by_name(client: TestClient, extra: dict[str, Any],
                                                         param: str) -> None:
    r = chat(client, HISTORY, tools=[WEATHER], **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert chat(client, HISTORY, tool_choice="required").json()["error"]["param"] == "tool_choice"  # no tools to call


@pytest.mark.parametrize(("param", "value"), [
    ("audio", {"voice": "x"}), ("modalities", ["text", "audio"]),
    ("store", True), ("reasoning_effort", "low"), ("functions", []), ("mirostat", 2),
    ("stream_options", {"include_obfuscation": True}),
])
def test_refused_parameters_are_named(client: TestClient, param: str, value: Any) -> None:
    r = chat(client, HISTORY, **{param: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("extra", "param"), [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                              ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
                                              ({"tools": [WEATHER]}, "tools")])
def test_stream_refuses_what_it_does_not_carry(client: TestClient, extra: dict[str, Any], param: str) -> None:
    """A stream carries one choice's text: several choices, logprobs and tool calls are refused by name, never
    dropped; text completions alike."""
    r = chat(client, HISTORY, stream=True, **extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["code"] == "unsupported_parameter"
    text = client.post("/v1/completions", json={"model": "tiny-random", "prompt": "Once", "stream": True,
                                                "max_tokens": 4, **({"logprobs": 1} if param == "logprobs" else extra)})
    if param != "tools":
        assert text.status_code == 400 and text.json()["error"]["param"] == param, text.text
    assert chat(client, HISTORY, user="someone").status_code == 200  # a known no-op


def test_openai_parse_helper(client: TestClient) -> None:
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(api_key="x", base_url="http://testserver/v1", http_client=client)  # TestClient is httpx's
    done = api.chat.completions.parse(model="tiny-random", messages=HISTORY, response_format=Reply, max_tokens=64,
                                      temperature=0)
    assert isinstance(done.choices[0].message.parsed, Reply)
    json.dumps(done.model_dump())
