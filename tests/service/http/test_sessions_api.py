"""The server-side sessions route takes a chat's parameters and refuses the same ones by name, and keeps an agent's
tool calls and tool results in the session: the hf engine in-process against a real private Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from ops.redisproc import RedisProcess
from tests.support import make_client, wait_written

SYSTEM = {"role": "system", "content": "You are a helpful assistant with tools. " * 6}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture
def client(redis_server: RedisProcess, tiny_model: Any) -> Iterator[TestClient]:
    with make_client(redis_server, tiny_model, pod_name="pod-sessions") as c:
        yield c



def _turn(client: TestClient, session: str, **body: Any) -> Any:
    return client.post(f"/v1/sessions/{session}/messages", json={"max_tokens": 8, "temperature": 0, **body})


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"mirostat": 2}, "mirostat", "unknown_parameter"),
    ({"session_id": "other"}, "session_id", "unknown_parameter"),  # the path names the session
    ({"functions": []}, "functions", "unsupported_parameter"),
    ({"store": True}, "store", "unsupported_parameter"),
    ({"stream": True, "n": 2}, "n", "unsupported_parameter"),
    ({"stream": True, "logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"stream": True, "tools": [WEATHER]}, "tools", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"messages": [{"role": "user", "content": "x"}]}, "content", None),  # and content: one or the other
])
def test_a_turn_refuses_what_the_chat_route_refuses(client: TestClient, extra: dict[str, Any], param: str,
                                                    code: str | None) -> None:
    assert client.post("/v1/sessions", json={"session_id": "s-refuse", "messages": [SYSTEM]}).status_code == 201
    r = _turn(client, "s-refuse", **{"content": "Hello?", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and (code is None or r.json()["error"]["code"] == code), r.text
    assert client.post("/v1/sessions", json={"session_id": "s-x", "colour": "red"}).json()["error"]["param"] == \
        "colour"
    assert client.post("/v1/sessions/s-refuse/fork", json={"messages": []}).json()["error"]["param"] == "messages"


def test_a_turn_honours_the_chats_parameters(client: TestClient) -> None:
    assert client.post("/v1/sessions", json={"session_id": "s-params", "messages": [SYSTEM]}).status_code == 201
    r = _turn(client, "s-params", content="Hello?", n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["content"][0]["top_logprobs"]) == 2 for c in r.json()["choices"])


def test_an_agents_tool_calls_and_results_are_kept(client: TestClient) -> None:
    """A forced call through the session route is recorded with the ids the client got; the tool result answering
    it is rendered after it on the next turn, which resumes from the cache."""
    assert client.post("/v1/sessions", json={"session_id": "s-agent", "messages": [SYSTEM]}).status_code == 201
    first = _turn(client, "s-agent", content="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=40)
    assert first.status_code == 200, first.text
    message = first.json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    recorded = client.get("/v1/sessions/s-agent").json()["messages"]
    assert [m["role"] for m in recorded] == ["system", "user", "assistant"]
    assert recorded[-1]["tool_calls"] == [call] and recorded[-1]["content"] == message["content"]
    wait_written(client)
    result = {"role": "tool", "tool_call_id": call["id"], "content": "RAINY-17C"}
    second = _turn(client, "s-agent", messages=[result], tools=[WEATHER])
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    recorded = client.get("/v1/sessions/s-agent").json()["messages"]
    assert recorded[3] == result and [m["role"] for m in recorded] == ["system", "user", "assistant", "tool",
                                                                       "assistant"]
    state = client.app.state.pod  # type: ignore[attr-defined]
    prompt = state.engine.decode(state.engine.chat_ids(recorded[:4], None, (WEATHER,)))
    arguments = json.loads(call["function"]["arguments"])
    assert "RAINY-17C" in prompt and json.dumps({"name": "weather", "arguments": arguments}) in prompt
