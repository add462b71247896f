"""The sidecar is llama-server plus a shared cache: a matrix of requests sent to a llama-server directly and through a
sidecar in front of the same build gets the same replies (greedy, fresh slots); the official client's structured
output parses; bad input gets llama-server's answer or today's 4xx; an agent conversation alternating two sidecars
hits on every later turn and replies as one llama-server that kept the conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from cachestore.errors import ConfigError
from ops.llamaserver_build import binary_path
from ops.redisproc import RedisProcess
from ops.sidecar_cmd import sidecar_app
from ops.sidecarproc import SidecarProcess
from service.engines.llama.llamaserver import LlamaServerEngine
from service.engines.llama.llamaserverproc import LlamaServerProcess
from service.engines.llama.models import resolve_gguf
from service.settings import PodSettings
from tests.paths import ROOT
from tests.replies import reply
from tests.support import running, settle

pytestmark = pytest.mark.skipif(binary_path() is None, reason="no llama-server built: run `make setup`")

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
ASK = [SYSTEM, {"role": "user", "content": "Name three colours of the rainbow."}]
WEATHER = [SYSTEM, {"role": "user", "content": "What is the weather in Paris right now?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
AGENT = [*WEATHER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "cloudy"}'}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "country": {"type": "string", "maxLength": 12}},
          "required": ["city", "country"], "additionalProperties": False}
CAPITAL = [SYSTEM, {"role": "user", "content": "Give the capital of France as JSON."}]
PNG = "data:image/png;base64,iVBORw0KGgo="
IMAGE = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                      {"type": "image_url", "image_url": {"url": PNG}}]}]
CHAT, TEXT, NATIVE = "/v1/chat/completions", "/v1/completions", "/completion"
GREEDY = {"temperature": 0, "max_tokens": 16}

ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (CHAT, {"messages": ASK, **GREEDY}),
    "json_object": (CHAT, {"messages": CAPITAL, "response_format": {"type": "json_object"}, **GREEDY}),
    "json_schema": (CHAT, {"messages": CAPITAL, **GREEDY, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True}}}),
    "agent_history": (CHAT, {"messages": AGENT, "tools": TOOLS, **GREEDY}),
    "tool_choice": (CHAT, {"messages": WEATHER, "tools": TOOLS, "tool_choice": "required", **GREEDY, "max_tokens": 40}),
    "n2": (CHAT, {"messages": ASK, "n": 2, **GREEDY}),
    "logprobs": (CHAT, {"messages": ASK, "logprobs": True, "top_logprobs": 3, **GREEDY}),
    "samplers": (CHAT, {"messages": ASK, "top_k": 1, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                        "repeat_penalty": 1.1, **GREEDY}),
    "seed": (CHAT, {"messages": ASK, "temperature": 0.9, "seed": 7, "max_tokens": 16}),
    "stop": (CHAT, {"messages": ASK, "stop": [","], **GREEDY}),
    "stream": (CHAT, {"messages": ASK, "stream": True, **GREEDY}),
    "stream_tools_usage": (CHAT, {"messages": WEATHER, "tools": TOOLS, "tool_choice": "required", "stream": True,
                                  "stream_options": {"include_usage": True}, **GREEDY, "max_tokens": 40}),
    "stream_n2_logprobs": (CHAT, {"messages": ASK, "n": 2, "logprobs": True, "stream": True, **GREEDY}),
    "text": (TEXT, {"prompt": "The three primary colours are", "stop": ["\n\n"], **GREEDY}),
    "text_stream": (TEXT, {"prompt": "The three primary colours are", "stream": True, **GREEDY}),
    "native_probs": (NATIVE, {"prompt": "The three primary colours are", "n_probs": 2, "n_predict": 12,
                              "temperature": 0}),
    "native_ids_stream": (NATIVE, {"prompt": [1, 504, 1347, 3495, 9523, 359], "n_predict": 12, "temperature": 0,
                                   "stream": True}),
    "image": (CHAT, {"messages": IMAGE, **GREEDY}),
    "refused": (CHAT, {"messages": "not a list", **GREEDY}),
    "refused_text": (TEXT, {"prompt": "x", "echo": True, **GREEDY}),
}


@pytest.fixture(scope="module")
def redis(module_redis_server: RedisProcess) -> RedisProcess:
    return module_redis_server


@pytest.fixture(scope="module")
def direct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerProcess]:
    """llama-server asked directly: the reference."""
    proc = LlamaServerProcess(resolve_gguf("smollm2"), tmp_path_factory.mktemp("direct"), parallel=2,
                              ctx_per_slot=4096, threads=1, extra_args=("--jinja",))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def side(redis: RedisProcess) -> Iterator[tuple[TestClient, LlamaServerEngine]]:
    """A sidecar in front of the same build and flags (the app `kvstash sidecar` serves), in this process."""
    engine = LlamaServerEngine.spawn("smollm2", parallel=2, threads=1, ctx_per_slot=4096, extra_args=("--jinja",))
    # no pod-local tier in front of Redis: an emptied Redis is an empty cache
    settings = PodSettings(engine="llama-server", redis_url=redis.url, codec="exact", block_tokens=16, parallel=2,
                           max_body_bytes=1 << 16, local_tier_bytes=0)
    try:
        with TestClient(sidecar_app(settings, engine)) as client:
            yield client, engine
    finally:
        engine.close()


def _fresh(direct: LlamaServerProcess, side: tuple[TestClient, LlamaServerEngine], redis: RedisProcess) -> None:
    """Nothing kept anywhere: both llama-servers' slots empty, the cache empty (its last writes done)."""
    client, engine = side
    for slot in range(2):
        assert httpx.post(f"{direct.url}/slots/{slot}?action=erase", json={}).status_code == 200
    settle(client)
    engine.forget()
    redis.client().flushdb()


@pytest.mark.parametrize("row", list(ROWS))
def test_a_request_gets_the_reply_llama_server_gives(
    row: str, direct: LlamaServerProcess, side: tuple[TestClient, LlamaServerEngine], redis: RedisProcess
) -> None:
    route, body = ROWS[row]
    client, engine = side
    _fresh(direct, side, redis)
    expected = reply(httpx.post(direct.url + route, json=body, timeout=120), bool(body.get("stream")))
    got_resp = client.post(route, json=body)
    got = reply(got_resp, bool(body.get("stream")))
    assert got == expected, json.dumps({"direct": expected, "sidecar": got})[:4000]
    assert "x-kv-cache" in got_resp.headers
    if row in ("image",):
        assert got_resp.headers["x-kv-cache"] == "bypass"
    if expected["status"] == 200 and row not in ("native_probs", "native_ids_stream"):
        if "body" in expected:
            assert expected["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_a_cached_turn_is_restored_and_the_reply_is_llama_servers(
    direct: LlamaServerProcess, side: tuple[TestClient, LlamaServerEngine], redis: RedisProcess
) -> None:
    """A second turn after the sidecar forgot its slots: its prefix comes from Redis (X-KV-Cached-Tokens), llama-server
    reports having reused it (cached_tokens, timings), and the reply is the one llama-server gives a request whose
    slot kept the first turn."""
    client, engine = side
    _fresh(direct, side, redis)
    first = client.post(CHAT, json={"messages": AGENT, "tools": TOOLS, **GREEDY})
    assert first.status_code == 200 and first.headers["x-kv-cache"] == "miss"
    answer = first.json()["choices"][0]["message"]
    history = [*AGENT, {"role": "assistant", "content": answer["content"]},
               {"role": "user", "content": "Should I take an umbrella?"}]
    engine.forget()
    restores = engine.stats.restores
    second = client.post(CHAT, json={"messages": history, "tools": TOOLS, **GREEDY})
    assert second.status_code == 200 and engine.stats.restores == restores + 1
    cached = int(second.headers["x-kv-cached-tokens"])
    usage, timings = second.json()["usage"], second.json()["timings"]
    assert cached >= (first.json()["usage"]["prompt_tokens"] // 16) * 16 > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"] >= cached
    assert timings["prompt_n"] == usage["prompt_tokens"] - timings["cache_n"]
    kept = httpx.post(direct.url + CHAT, json={"messages": AGENT, "tools": TOOLS, **GREEDY, "id_slot": 0}, timeout=120)
    assert kept.json()["choices"][0]["message"] == answer
    again = httpx.post(direct.url + CHAT, json={"messages": history, "tools": TOOLS, **GREEDY, "id_slot": 0},
                       timeout=120)
    assert again.json()["choices"] == second.json()["choices"]
    assert engine.stats.reuse_misses == 0


def test_the_official_clients_structured_output_parses(side: tuple[TestClient, LlamaServerEngine]) -> None:
    """`client.chat.completions.parse` with a pydantic model: llama-server's grammar makes the reply match it."""
    import openai  # noqa: PLC0415
    from pydantic import BaseModel, Field  # noqa: PLC0415

    class Capital(BaseModel):
        city: str = Field(max_length=12)
        country: str = Field(max_length=12)

    client, _ = side
    oai = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    done = oai.chat.completions.parse(model="smollm2", messages=CAPITAL, response_format=Capital,  # type: ignore[arg-type]
                                      temperature=0, max_tokens=60)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.city and parsed.country


def test_bad_input_gets_todays_limits_and_a_json_error(side: tuple[TestClient, LlamaServerEngine]) -> None:
    client, _ = side
    huge = client.post(CHAT, content=b'{"messages": "' + b"x" * (1 << 17) + b'"}')
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"
    assert client.post("/tokenize", content=b"x" * (1 << 17)).status_code == 413  # every route, the same limit
    for raw in (b"{not json", b"[1, 2]", b"", b"\xff\xfe"):
        bad = client.post(CHAT, content=raw)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json", raw
    assert client.post("/slots/0?action=restore", json={"filename": "x"}).status_code == 403
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/health").json() == {"status": "ok"}  # llama-server's own


def test_a_llama_server_that_is_down_is_a_503_with_a_json_body(tmp_path: Path) -> None:
    proc = LlamaServerProcess(resolve_gguf("smollm2"), tmp_path, parallel=1, ctx_per_slot=1024, threads=1)
    proc.start()
    engine = LlamaServerEngine(proc.url, tmp_path, "smollm2")
    try:
        settings = PodSettings(engine="llama-server", cache_enabled=False, parallel=1)
        with TestClient(sidecar_app(settings, engine)) as client:
            proc.stop()
            for route, body in ((CHAT, {"messages": ASK}), (TEXT, {"prompt": "hi"}), ("/tokenize", {"content": "a"})):
                down = client.post(route, json=body)
                assert down.status_code == 503 and down.json()["error"]["code"] == "upstream_unavailable", route
            assert client.get("/v1/models").status_code == 503
    finally:
        engine.close()


def test_a_llama_server_with_an_api_key_works_behind_the_sidecar(tmp_path: Path) -> None:
    """The sidecar presents its upstream key; a pod of tenants checks its own keys and shows llama-server only the
    upstream one; without tenants the client's key is llama-server's to check. A sidecar without the key refuses to
    start, saying which setting it needs."""
    engine = LlamaServerEngine.spawn("smollm2", tmp_path, parallel=1, threads=1, ctx_per_slot=1024, api_key="up-key")
    try:
        assert httpx.post(engine.url + "/tokenize", json={"content": "a"}).status_code == 401
        with pytest.raises(ConfigError, match="upstream-api-key|UPSTREAM_API_KEY"):
            LlamaServerEngine(engine.url, tmp_path, "smollm2")
        tenants = PodSettings(engine="llama-server", cache_enabled=False, parallel=1, api_keys={"kv-a": "team-a"},
                              upstream_api_key="up-key")
        with TestClient(sidecar_app(tenants, engine)) as client:
            body = {"messages": ASK, **GREEDY}
            assert client.post(CHAT, json=body).status_code == 401
            assert client.post(CHAT, json=body, headers={"Authorization": "Bearer up-key"}).status_code == 401
            ok = client.post(CHAT, json=body, headers={"Authorization": "Bearer kv-a"})
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
            assert client.get("/props", headers={"Authorization": "Bearer kv-a"}).status_code == 200
        plain = PodSettings(engine="llama-server", cache_enabled=False, parallel=1, upstream_api_key="up-key")
        with TestClient(sidecar_app(plain, engine)) as client:
            refused = client.post(CHAT, json={"messages": ASK, **GREEDY}, headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 401 and refused.json()["error"]["message"] == "Invalid API Key"
            ok = client.post(CHAT, json={"messages": ASK, **GREEDY}, headers={"Authorization": "Bearer up-key"})
            assert ok.status_code == 200
    finally:
        engine.close()


# -- an agent alternating two sidecar processes ------------------------------------------------------------------------
SIDE_ARGS = ("--codec", "exact", "--block-tokens", "16", "--ctx-per-slot", "4096", "--", "--jinja")
CITIES = ["Paris", "Oslo", "Lima"]


@pytest.fixture(scope="module")
def sidecars(redis: RedisProcess) -> Iterator[dict[str, SidecarProcess]]:
    with running({"a": SidecarProcess("agent-a", redis.url, "smollm2", SIDE_ARGS),
                  "b": SidecarProcess("agent-b", redis.url, "smollm2", SIDE_ARGS)}, ready_s=180) as procs:
        yield procs


def _turn(url: str, messages: list[dict[str, Any]], tool_choice: str) -> httpx.Response:
    body = {"messages": messages, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0, "max_tokens": 40}
    return httpx.post(url + CHAT, json=body, timeout=180)


def test_an_agent_alternating_two_sidecars_hits_on_every_later_turn(
    sidecars: dict[str, SidecarProcess], direct: LlamaServerProcess, redis: RedisProcess
) -> None:
    """Six turns (a tool call, its result answered, three times) sent round robin to two sidecars: every turn after the
    first restores the conversation from Redis on the other sidecar, llama-server processes only what is new since the
    last turn (its timings and its log), and every reply is the one llama-server gives when it kept the
    conversation in one slot."""
    redis.client().flushdb()
    for slot in range(2):
        httpx.post(f"{direct.url}/slots/{slot}?action=erase", json={})
    messages: list[dict[str, Any]] = [SYSTEM]
    previous = 0
    for turn in range(6):
        pod = sidecars["a" if turn % 2 == 0 else "b"]
        if turn % 2 == 0:
            messages.append({"role": "user", "content": f"What is the weather in {CITIES[turn // 2]}?"})
        choice = "required" if turn % 2 == 0 else "none"
        got, kept = _turn(pod.url, messages, choice), _turn(direct.url, messages, choice)
        assert got.status_code == 200 and kept.status_code == 200, got.text
        message = got.json()["choices"][0]["message"]
        assert message == kept.json()["choices"][0]["message"] or _same_calls(message, kept.json()), turn
        usage, timings = got.json()["usage"], got.json()["timings"]
        assert timings["prompt_n"] == usage["prompt_tokens"] - timings["cache_n"] == pod.prompt_evals()[-1]
        if turn:
            assert int(got.headers["x-kv-cached-tokens"]) >= (previous // 16) * 16 > 0, turn
            assert usage["prompt_tokens_details"]["cached_tokens"] >= previous // 16 * 16
        previous = usage["prompt_tokens"]
        if message.get("tool_calls"):
            messages.append({"role": "assistant", "content": None, "tool_calls": message["tool_calls"]})
            city = CITIES[turn // 2]
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": json.dumps({"city": city, "temperature_c": 10 + turn, "sky": "clear"})})
        else:
            messages.append({"role": "assistant", "content": message["content"]})
        settle(pod.url)
    events = {line.split('"')[1]: float(line.split()[-1]) for line in httpx.get(sidecars["b"].url + "/metrics").text
              .splitlines() if line.startswith("kvstash_sidecar_events_total{")}
    assert events["restores"] >= 2 and events["reuse_misses"] == 0


def _same_calls(message: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Tool calls equal but for their random ids."""
    theirs = kept["choices"][0]["message"]
    strip = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls") or []]
    return bool(strip) and strip == [{k: v for k, v in c.items() if k != "id"} for c in theirs.get("tool_calls") or []]


def test_a_session_agent_with_tool_calls_alternating_two_sidecars_hits(
    sidecars: dict[str, SidecarProcess], direct: LlamaServerProcess, redis: RedisProcess
) -> None:
    """Server-side sessions on the sidecar engine: an agent history (an assistant turn of `tool_calls` with null
    content, the tool's result) sent turn by turn to two sidecars in round robin. llama-server renders the calls (the
    prompt is the one llama-server itself renders for the whole history), the session keeps them, and every later
    turn resumes from Redis on the other sidecar, llama-server processing only what is new."""
    redis.client().flushdb()
    a, b = sidecars["a"], sidecars["b"]
    paris = {**CALL, "id": "call_p"}
    oslo = {"id": "call_o", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    turns = [
        [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [paris]},
         {"role": "tool", "tool_call_id": "call_p", "content": '{"temperature_c": 18, "sky": "cloudy"}'}],
        [{"role": "user", "content": "And in Oslo?"}, {"role": "assistant", "content": None, "tool_calls": [oslo]},
         {"role": "tool", "tool_call_id": "call_o", "content": '{"temperature_c": 4, "sky": "snow"}'}],
        [{"role": "user", "content": "Where should I go?"}],
    ]
    assert httpx.post(a.url + "/v1/sessions", json={"session_id": "agent-1", "messages": [SYSTEM]}).status_code == 201
    history: list[dict[str, Any]] = [SYSTEM]
    previous = 0
    for turn, new in enumerate([*turns, [{"role": "user", "content": "Thanks!"}]]):
        pod = (a, b)[turn % 2]
        r = httpx.post(f"{pod.url}/v1/sessions/agent-1/messages", json={"messages": new, "temperature": 0,
                                                                         "max_tokens": 16}, timeout=180)
        assert r.status_code == 200, r.text
        history += new
        rendered = httpx.post(direct.url + "/apply-template", json={"messages": history}).json()["prompt"]
        expected = httpx.post(direct.url + "/tokenize", json={"content": rendered, "add_special": True,
                                                               "parse_special": True}).json()["tokens"]
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(expected), turn  # the calls were rendered, by llama-server
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert pod.prompt_evals()[-1] == usage["prompt_tokens"] - cached
        if turn:
            assert r.headers["x-kv-cache"] == "hit" and cached >= previous // 16 * 16 > 0, turn
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        previous = usage["prompt_tokens"]
        settle(pod.url)
    kept = httpx.get(b.url + "/v1/sessions/agent-1").json()["messages"]
    assert [m.get("tool_calls") for m in kept if m.get("tool_calls")] == [[paris], [oslo]]
    assert [m["tool_call_id"] for m in kept if m["role"] == "tool"] == ["call_p", "call_o"]


# -- a template that renders tools: llama-server parses the calls, the sidecar passes them through ---------------------
TOOLS_TEMPLATE = ROOT / "ops" / "llamaserver" / "chatml-tools.jinja"


@pytest.fixture(scope="module")
def tooled(redis: RedisProcess) -> Iterator[list[tuple[TestClient, LlamaServerEngine]]]:
    """Two sidecars (in this process, each with its own llama-server) whose template renders tools in the Hermes
    format, which llama-server parses into `tool_calls`."""
    args = ("--jinja", "--chat-template-file", str(TOOLS_TEMPLATE))
    engines = [LlamaServerEngine.spawn("smollm2", parallel=1, threads=1, ctx_per_slot=4096, extra_args=args)
               for _ in range(2)]
    settings = PodSettings(engine="llama-server", redis_url=redis.url, codec="exact", block_tokens=16, parallel=1,
                           fetch_policy="always", local_tier_bytes=0, namespace="kvstash-tooled")
    try:
        with TestClient(sidecar_app(settings, engines[0])) as one, TestClient(sidecar_app(settings, engines[1])) as two:
            yield [(one, engines[0]), (two, engines[1])]
    finally:
        for engine in engines:
            engine.close()


def test_a_tool_call_agent_through_two_sidecars_with_the_openai_client(
    tooled: list[tuple[TestClient, LlamaServerEngine]]
) -> None:
    """The official client asks for a forced call (llama-server's grammar; the call format llama-server worked out of
    ops/llamaserver/chatml-tools.jinja), reads the parsed `tool_calls`, answers with the tool's result on the other
    sidecar, and so on for four turns: every later turn hits (its prefix restored from Redis)."""
    import openai  # noqa: PLC0415

    clients = [openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="unused", http_client=c) for c, _ in tooled]
    messages: list[Any] = [SYSTEM]
    previous = 0
    for turn in range(4):
        if turn % 2 == 0:  # a 135M model calls when asked to
            messages.append({"role": "user", "content": f"Call get_weather for {CITIES[turn // 2]}."})
        raw = clients[turn % 2].chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, tools=TOOLS, tool_choice="required" if turn % 2 == 0 else "none",
            parallel_tool_calls=False, temperature=0, max_tokens=64)
        done = raw.parse()
        choice = done.choices[0]
        if turn % 2 == 0:
            (call,) = choice.message.tool_calls or []  # parsed by llama-server, typed by the client
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            assert isinstance(json.loads(call.function.arguments)["city"], str)  # type: ignore[union-attr]
            messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"temperature_c": 10 + turn, "sky": "clear"})})
        else:
            assert choice.message.content and not choice.message.tool_calls
            messages.append({"role": "assistant", "content": choice.message.content})
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        cached = done.usage.prompt_tokens_details.cached_tokens or 0
        if turn:
            assert int(raw.headers["x-kv-cached-tokens"]) >= previous // 16 * 16 > 0, turn
            assert cached >= int(raw.headers["x-kv-cached-tokens"])
        previous = done.usage.prompt_tokens
        client, _ = tooled[turn % 2]
        settle(client)
    assert all(engine.stats.reuse_misses == 0 for _, engine in tooled)
    assert sum(engine.stats.restores for _, engine in tooled) >= 3


# -- LoRA: KV computed under one adapter is never another's -----------------------------------------------------------
@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.loras import write_lora  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("lora")
    model = resolve_gguf("smollm2")
    return write_lora(folder / "a.gguf", model, seed=1), write_lora(folder / "b.gguf", model, seed=2)


def test_lora_adapters_never_share_cache_entries(redis: RedisProcess, loras: tuple[Path, Path],
                                                 tmp_path: Path) -> None:
    """Two adapters of SmolLM2's K and V (built here) loaded in llama-server: the same tokens under adapter a, under b
    and under neither (scales 0) are three cache entries. Each identity misses the first time even though the others
    were written, hits its own entry the second time, and replies as llama-server does with that adapter; a request
    at the global scales bypasses the cache."""
    flags = ("--lora", str(loras[0]), "--lora", str(loras[1]))
    reference = LlamaServerProcess(resolve_gguf("smollm2"), tmp_path, parallel=1, ctx_per_slot=2048, threads=1,
                                   extra_args=flags)
    reference.start()
    engine = LlamaServerEngine.spawn("smollm2", parallel=1, threads=1, ctx_per_slot=2048, extra_args=flags)
    settings = PodSettings(engine="llama-server", redis_url=redis.url, codec="exact", block_tokens=16, parallel=1,
                           local_tier_bytes=0, namespace="kvstash-lora")
    identities = {"a": [{"id": 0, "scale": 1.0}], "b": [{"id": 1, "scale": 1.0}],
                  "none": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]}
    messages = [{"role": "system", "content": "You are a concise assistant. " * 6}, *ASK[1:]]
    try:
        assert [a for _, a in engine.adapters] == [str(p) for p in loras]
        with TestClient(sidecar_app(settings, engine)) as client:
            replies: dict[str, Any] = {}
            for name, lora in identities.items():
                expected = httpx.post(reference.url + CHAT, json={"messages": messages, "lora": lora, **GREEDY},
                                      timeout=120).json()["choices"][0]["message"]
                for attempt in ("miss", "hit"):
                    engine.forget()  # nothing in the slot the sidecar counts on: whatever it reuses comes from Redis
                    r = client.post(CHAT, json={"messages": messages, "lora": lora, **GREEDY})
                    assert r.status_code == 200, r.text
                    assert r.headers["x-kv-cache"] == attempt, (name, attempt)
                    assert r.json()["choices"][0]["message"] == expected, (name, attempt)
                    settle(client)
                replies[name] = expected
                assert r.json()["timings"]["cache_n"] >= int(r.headers["x-kv-cached-tokens"]) > 0  # reused
            assert replies["a"] != replies["none"] and replies["b"] != replies["none"]  # the adapters change the KV
            plain = client.post(CHAT, json={"messages": messages, **GREEDY})
            assert plain.status_code == 200 and plain.headers["x-kv-cache"] == "bypass"
            assert engine.stats.bypassed.get("global-lora") == 1 and engine.stats.reuse_misses == 0
    finally:
        engine.close()
        reference.stop()
