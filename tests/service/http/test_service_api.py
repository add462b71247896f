"""The pod's HTTP API in-process (Starlette TestClient) against a real private Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from ops.redisproc import RedisProcess
from tests.support import HISTORY, chat, make_client, wait_written
from tests.timing import wait_for


@pytest.fixture
def client(redis_server: RedisProcess, tiny_model: Any) -> Iterator[TestClient]:
    with make_client(redis_server, tiny_model) as c:
        yield c


def test_health_ready_models_metrics(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert ready.json()["redis"].startswith("up")
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny-random"]
    metrics = client.get("/metrics").text
    assert "kvstash_requests_total" in metrics and "kvstash_write_queue_depth" in metrics


def test_second_request_hits_and_replies_identically(client: TestClient) -> None:
    first = chat(client, HISTORY)
    assert first.status_code == 200, first.text
    assert first.headers["x-kv-cache"] == "miss"
    assert first.headers["x-kv-pod"] == "pod-test"
    body = first.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_written(client)
    second = chat(client, HISTORY)
    assert second.headers["x-kv-cache"] == "hit"
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    prompt = second.json()["usage"]["prompt_tokens"]
    assert cached == ((prompt - 1) // 16) * 16 and cached > 0
    assert second.json()["choices"][0]["message"] == body["choices"][0]["message"]


def test_stream_assembles_to_the_same_text(client: TestClient) -> None:
    plain = chat(client, HISTORY).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={
        "model": "tiny-random", "messages": HISTORY, "max_tokens": 12, "stream": True,
        "stream_options": {"include_usage": True},
    }) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


def test_text_completion(client: TestClient) -> None:
    resp = client.post("/v1/completions", json={"model": "tiny-random", "prompt": "Once upon a time",
                                                  "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b"\xff\xfe\x00", 400, "invalid_json"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "invalid_value"),
        (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404,
         "model_not_found"),
        (json.dumps({"model": "tiny-random", "messages": "hi"}).encode(), 400, "invalid_value"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400,
         "invalid_value"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": 5}]}).encode(), 400,
         "invalid_value"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 0}).encode(), 400, "invalid_value"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 10**9}).encode(), 400, "invalid_value"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
                     "temperature": "hot"}).encode(), 400, "invalid_value"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
                     "session_id": "a*b"}).encode(), 400, "invalid_session_id"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
                     "session_id": "x" * 10_000}).encode(), 400, "invalid_session_id"),
        (b"[" * 100 + b"]" * 100, 400, "invalid_json"),
        (json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "x" * 2_000_000}]}).encode(),
         413, "body_too_large"),
    ],
)
def test_bad_input_gets_a_json_error(client: TestClient, body: bytes, status: int, code: str) -> None:
    resp = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and error["message"]


def test_prompt_longer_than_context_is_refused(client: TestClient) -> None:
    words = "lorem ipsum " * 3000
    resp = chat(client, [{"role": "user", "content": words}])
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_route_and_method_are_json(client: TestClient) -> None:
    assert client.get("/nope").json()["error"]["code"] == "404"
    resp = client.get("/v1/chat/completions")
    assert resp.status_code == 405 and "error" in resp.json()


def test_sessions_lifecycle_and_fork(client: TestClient) -> None:
    created = client.post("/v1/sessions", json={"session_id": "trip-1", "messages": HISTORY[:1]})
    assert created.status_code == 201, created.text
    assert client.post("/v1/sessions", json={"session_id": "trip-1"}).status_code == 409
    turn1 = client.post("/v1/sessions/trip-1/messages", json={"content": "Where should I start?", "max_tokens": 8})
    assert turn1.status_code == 200, turn1.text
    wait_written(client)
    turn2 = client.post("/v1/sessions/trip-1/messages", json={"content": "And then?", "max_tokens": 8})
    assert turn2.status_code == 200
    assert turn2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert turn2.headers["x-kv-cache"] == "hit"
    record = client.get("/v1/sessions/trip-1").json()
    assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    wait_written(client)
    fork = client.post("/v1/sessions/trip-1/fork", json={"session_id": "trip-2"})
    assert fork.status_code == 201
    branch = client.post("/v1/sessions/trip-2/messages", json={"content": "Something else.", "max_tokens": 8})
    assert branch.status_code == 200
    assert branch.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert len(client.get("/v1/sessions/trip-2").json()["messages"]) == 7
    assert len(client.get("/v1/sessions/trip-1").json()["messages"]) == 5
    listed = {s["id"] for s in client.get("/v1/sessions").json()["data"]}
    assert {"trip-1", "trip-2"} <= listed
    assert client.delete("/v1/sessions/trip-1").json()["deleted"] is True
    assert client.get("/v1/sessions/trip-1").status_code == 404
    assert client.delete("/v1/sessions/trip-1").status_code == 404
    assert client.get("/v1/sessions/bad*id").status_code == 400


def test_tenants_are_isolated(redis_server: RedisProcess, tiny_model: Any) -> None:
    keys = {"key-a": "alpha", "key-b": "beta"}
    with make_client(redis_server, tiny_model, api_keys=keys, tenant_secret="s3cret") as c:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        body = {"model": "tiny-random", "messages": HISTORY, "max_tokens": 4}
        assert c.post("/v1/chat/completions", json=body).status_code == 401
        assert c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.post("/v1/chat/completions", json=body, headers=a).status_code == 200
        wait_written(c)
        assert c.post("/v1/chat/completions", json=body, headers=a).headers["x-kv-cache"] == "hit"
        other = c.post("/v1/chat/completions", json=body, headers=b)
        assert other.headers["x-kv-cache"] == "miss"
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert c.post("/v1/sessions", json={"session_id": "private"}, headers=a).status_code == 201
        assert c.get("/v1/sessions/private", headers=b).status_code == 404
        assert c.post("/v1/sessions/private/fork", json={"session_id": "stolen"}, headers=b).status_code == 404
        assert c.delete("/v1/sessions/private", headers=b).status_code == 404
        assert c.get("/v1/sessions/private", headers=a).status_code == 200


def test_no_cache_pod_bypasses(redis_server: RedisProcess, tiny_model: Any) -> None:
    with make_client(redis_server, tiny_model, cache_enabled=False) as c:
        resp = chat(c, HISTORY)
        assert resp.status_code == 200 and resp.headers["x-kv-cache"] == "bypass"
        assert c.post("/v1/sessions", json={}).status_code == 501


def test_redis_down_bypasses_and_recovers(redis_server: RedisProcess, tiny_model: Any) -> None:
    with make_client(redis_server, tiny_model, local_tier_bytes=0) as c:  # no pod-local copy to hide the outage
        reference = chat(c, HISTORY).json()["choices"][0]["message"]
        wait_written(c)
        redis_server.kill()
        for _ in range(3):
            resp = chat(c, HISTORY)
            assert resp.status_code == 200
            assert resp.headers["x-kv-cache"] == "bypass"
            assert resp.json()["choices"][0]["message"] == reference
        assert c.get("/readyz").status_code == 200
        redis_server.start()
        deadline = time.monotonic() + 30
        statuses = []
        while time.monotonic() < deadline:
            resp = chat(c, HISTORY)
            statuses.append(resp.headers["x-kv-cache"])
            assert resp.json()["choices"][0]["message"] == reference
            if resp.headers["x-kv-cache"] == "hit":
                break
            wait_written(c)
            time.sleep(0.5)
        assert statuses[-1] == "hit", statuses


def test_overload_gets_503_with_retry_after(redis_server: RedisProcess, tiny_model: Any) -> None:
    with make_client(redis_server, tiny_model, max_queue=1) as c:
        body = {"model": "tiny-random", "messages": HISTORY, "max_tokens": 30, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as held:  # admitted until fully read
            assert held.status_code == 200
            refused = chat(c, HISTORY)
            assert refused.status_code == 503
            assert refused.headers["retry-after"].isdigit()
            assert refused.json()["error"]["code"] == "overloaded"
            held.read()
        assert chat(c, HISTORY).status_code == 200


def test_every_pod_exports_the_namespace_bytes_budget_and_entries(redis_server: RedisProcess, tiny_model: Any) -> None:
    with make_client(redis_server, tiny_model, usage_sample_s=0.1, budget_bytes=3 << 30) as c:
        assert chat(c, HISTORY).status_code == 200  # its blocks are in Redis before the reply ends

        def gauge(name: str) -> float:
            line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith(name + " "))
            return float(line.split()[1])

        wait_written(c)
        store = c.app.state.pod.store  # type: ignore[attr-defined]
        held = c.portal.call(store.usage)  # type: ignore[attr-defined]
        # the next sample (every 0.1 s) sees what the store holds now
        wait_for(lambda: gauge("kvstash_cache_bytes_held") == held.bytes_held, "a sample of the bytes held", 10)
        assert held.bytes_held > 0
        assert gauge("kvstash_cache_entries") == held.blocks > 0
        assert gauge("kvstash_cache_budget_bytes") == 3 << 30
        assert gauge("kvstash_cache_dead_bytes") == c.portal.call(store.dead).bytes == 0  # type: ignore[attr-defined]
        client = redis_server.client()  # the pod told the budget each block's place in its chain: depth and parent
        facts = [v.decode() for shard in store.keys.all_shards() for v in client.hvals(shard.chain)]
        assert "0" in facts and any(f.startswith("1:") and len(f) == 34 for f in facts)
