"""The llamacpp engine honours the OpenAI parameters too: SmolLM2's GGUF in llama.cpp, in-process, real Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from ops.redisproc import RedisProcess
from service.engines.llama.llamacpp import LlamaCppEngine
from tests.support import chat, make_client, wait_written

ask = partial(chat, model="smollm2", max_tokens=16)  # this file's model, a short reply unless told

HISTORY = [{"role": "system", "content": "You are a helpful assistant. Answer briefly. " * 6},
           {"role": "user", "content": "Name a city in Norway and say whether it is a capital."}]


class City(BaseModel):
    city: str = Field(max_length=20)
    capital: bool


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaCppEngine]:
    eng = LlamaCppEngine.load("smollm2", parallel=2, threads=2)
    try:
        yield eng
    finally:
        eng.close()


@pytest.fixture
def client(redis_server: RedisProcess, engine: LlamaCppEngine) -> Iterator[TestClient]:
    with make_client(redis_server, engine, engine="llamacpp", model="smollm2", pod_name="pod-llama-params") as c:
        yield c


def test_json_schema_with_llama_grammar(client: TestClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}}
    r = ask(client, HISTORY, response_format=fmt, max_tokens=48)
    assert r.status_code == 200, r.text
    City.model_validate_json(r.json()["choices"][0]["message"]["content"])


def test_logprobs_n_top_k_and_penalty(client: TestClient) -> None:
    greedy = ask(client, HISTORY, logprobs=True, top_logprobs=2).json()["choices"][0]
    for entry in greedy["logprobs"]["content"]:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and entry["top_logprobs"][0]["token"] == entry["token"]
    assert "".join(e["token"] for e in greedy["logprobs"]["content"]) == greedy["message"]["content"]
    two = ask(client, HISTORY, n=2, temperature=1.0, seed=5).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    top1 = ask(client, HISTORY, temperature=1.0, top_k=1, seed=9).json()["choices"][0]
    assert top1["message"] == greedy["message"]
    counting = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
    long = ask(client, counting, max_tokens=48, return_token_ids=True).json()["choices"][0]
    assert len(set(long["token_ids"])) < len(long["token_ids"])  # a repeated token: the penalty bites
    penalised = ask(client, counting, max_tokens=48, frequency_penalty=2.0).json()["choices"][0]
    assert penalised["message"]["content"] != long["message"]["content"]


# a penalty can make a near-tie that llama.cpp's batch-size-dependent numerics (prefill vs a resumed tail) flip:
# repetition_penalty 1.2 on this prompt does at an 80-token hit; the parameters here leave the argmax alone
@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2, "top_k": 1, "temperature": 1.0,
                                        "seed": 1}], ids=["plain", "params"])
def test_hit_with_parameters_replies_as_cold(client: TestClient, extra: dict[str, Any]) -> None:
    cold = ask(client, HISTORY, **extra)
    wait_written(client)
    hit = ask(client, HISTORY, **extra)
    assert hit.headers["x-kv-cache"] == "hit"
    assert hit.json()["choices"][0]["message"] == cold.json()["choices"][0]["message"]
    if extra:
        for a, b in zip(hit.json()["choices"][0]["logprobs"]["content"],
                        cold.json()["choices"][0]["logprobs"]["content"], strict=True):
            # the same tokens; their logprobs are not bit-identical (nor the order of near-tied alternatives): a
            # resumed tail runs through llama.cpp's small-batch kernels, a prefill through its large-batch ones
            assert a["token"] == b["token"] and a["top_logprobs"][0]["token"] == b["top_logprobs"][0]["token"]


def test_agent_history_and_refusals(client: TestClient, engine: LlamaCppEngine) -> None:
    messages = [*HISTORY,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q":"Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "OSLO-IS-CAPITAL"}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    r = client.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages, "tools": tools,
                                                   "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert "OSLO-IS-CAPITAL" in engine.decode(engine.chat_ids(messages, None, tuple(tools)))
    for param, value in (("tool_choice", "required"), ("audio", {}), ("n_probs", 3)):
        bad = ask(client, HISTORY, **{param: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param


def test_a_forced_tool_call_follows_llama_cpps_grammar(client: TestClient) -> None:
    """tool_choice "required" or a named function: llama.cpp's grammar sampler makes SmolLM2 (whose template renders no
    tools) reply with one call whose arguments validate against the tool's parameters."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
    clock = {"type": "function", "function": {"name": "clock"}}
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = ask(client, question, tools=[weather, clock], tool_choice=choice, parallel_tool_calls=False,
                max_tokens=40)
        assert r.status_code == 200, r.text
        body = r.json()["choices"][0]
        assert body["finish_reason"] == "tool_calls", body
        (call,) = body["message"]["tool_calls"]
        if call["function"]["name"] == "get_weather":
            city = json.loads(call["function"]["arguments"])["city"]
            assert isinstance(city, str) and len(city) <= 20
        else:
            assert choice == "required" and json.loads(call["function"]["arguments"]) == {}
