"""Hostile HTTP input: the API fuzzed from its own OpenAPI description, oversized, deep, invalid and odd input.

KVSTASH_API_FUZZ_EXAMPLES sets the schemathesis examples per generation mode (default 150).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.core import NotSet
from schemathesis.generation.modes import GenerationMode
from starlette.routing import Route
from starlette.testclient import TestClient

from cachestore.keys import ENTRY_KINDS
from ops.redisproc import RedisProcess
from tests.support import make_client, wait_written

EXAMPLES = int(os.environ.get("KVSTASH_API_FUZZ_EXAMPLES", "150"))
NS = "hostile"
POSTS = ["/v1/chat/completions", "/v1/completions", "/v1/sessions", "/v1/sessions/victim/messages",
         "/v1/sessions/victim/fork"]
KEY_PREFIXES = tuple(f"{NS}:{kind}:" for kind in (*ENTRY_KINDS, "idx", "sess"))  # every key shape kvstash writes


@pytest.fixture
def client(redis_server: RedisProcess, tiny_model: Any) -> Iterator[TestClient]:
    with make_client(redis_server, tiny_model, namespace=NS, max_tokens_limit=8, default_max_tokens=4,
                     max_body_bytes=64 << 10) as c:
        yield c


def assert_clean_error(resp: Any, statuses: tuple[int, ...] = ()) -> dict[str, Any]:
    """A 4xx with the OpenAI error shape as JSON (never a 5xx, never HTML or a traceback)."""
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    if statuses:
        assert resp.status_code in statuses, (resp.status_code, resp.text[:300])
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    return dict(error)


def seed_victim(client: TestClient) -> dict[str, Any]:
    """A session and its blocks that hostile requests must leave exactly as they were."""
    created = client.post("/v1/sessions", json={"session_id": "victim", "messages": [
        {"role": "system", "content": "Keep this conversation safe. " * 8}]})
    assert created.status_code == 201, created.text
    turn = client.post("/v1/sessions/victim/messages", json={"content": "Hello there", "max_tokens": 4})
    assert turn.status_code == 200, turn.text
    wait_written(client)
    return dict(client.get("/v1/sessions/victim").json())


def redis_snapshot(redis: RedisProcess) -> dict[bytes, bytes]:
    """Every value and session key with its DUMP (index keys change on reads by design)."""
    r = redis.client()
    try:
        out = {}
        for key in r.scan_iter(count=1000):
            assert key.decode().startswith(KEY_PREFIXES), f"unexpected key {key!r}"
            if b":idx:" not in key:
                out[key] = r.dump(key) or b""
        return out
    finally:
        r.close()


def test_openapi_describes_every_route(client: TestClient) -> None:
    resp = client.get("/openapi.json")
    assert resp.status_code == 200
    schema = resp.json()
    assert schema["openapi"].startswith("3.")
    routes = {(r.path, m.lower()) for r in client.app.routes if isinstance(r, Route)  # type: ignore[attr-defined]
              for m in (r.methods or ()) if m != "HEAD"}
    described = {(path, method) for path, ops in schema["paths"].items() for method in ops}
    assert routes == described
    schemathesis.openapi.from_dict(schema)  # a loadable, valid description


def test_schemathesis_no_5xx_and_json_errors(client: TestClient, redis_server: RedisProcess,
                                             figures: dict[str, object]) -> None:
    victim = seed_victim(client)
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    seen: dict[str, int] = {}

    def send(case: Any) -> None:
        kwargs: dict[str, Any] = {"headers": dict(case.headers or {}), "params": dict(case.query or {})}
        if not isinstance(case.body, NotSet):
            if isinstance(case.body, bytes | str):
                kwargs["content"] = case.body
            else:
                kwargs["content"] = json.dumps(case.body).encode()
            kwargs["headers"].setdefault("content-type", "application/json")
        path = case.formatted_path
        if "/victim" in path or path.endswith("/victim"):
            return  # the fuzzer must not be the one to change the session whose safety is checked
        resp = client.request(case.method, path, **kwargs)
        seen[str(resp.status_code)] = seen.get(str(resp.status_code), 0) + 1
        assert resp.status_code < 500, (case.method, path, kwargs, resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            assert_clean_error(resp)

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        run = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                       suppress_health_check=list(HealthCheck))(given(schema.as_strategy(mode))(send))
        run()
    wait_written(client)
    assert client.get("/v1/sessions/victim").json() == victim
    redis_snapshot(redis_server)  # only kvstash's own key shapes exist
    figures.update(cases=sum(seen.values()), statuses=seen, server_errors=0)
    assert sum(seen.values()) >= EXAMPLES  # the fuzzer really ran


@pytest.mark.parametrize("path", POSTS)
def test_oversized_bodies_get_413(client: TestClient, path: str) -> None:
    big = json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "x" * (200 << 10)}]})
    assert_clean_error(client.post(path, content=big, headers={"content-type": "application/json"}), (413,))

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while streaming in
        for _ in range(100):
            yield b" " * (4 << 10)

    assert_clean_error(client.post(path, content=chunks(), headers={"content-type": "application/json"}), (413,))


@pytest.mark.parametrize("path", POSTS)
def test_deep_invalid_and_non_object_bodies_get_400(client: TestClient, path: str) -> None:
    seed_victim(client) if path.endswith(("messages", "fork")) else None
    bodies = [
        b"[" * 20_000 + b"]" * 20_000,  # past the JSON parser's recursion limit
        b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
        json.dumps({"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
                    "extra": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}).encode(),
        b'{"model": "tiny-random", "content": "\xff\xfe caf\xc3"}',
        b'{"model": "tiny-random", "content": "\xed\xa0\x80"}',  # an encoded surrogate is not UTF-8
        b"\x00\x01\x02",
        b'"just a string"',
        b"null",
    ]
    for body in bodies:
        assert_clean_error(client.post(path, content=body, headers={"content-type": "application/json"}), (400,))


HOSTILE_IDS = ["a*b", "*", "a:b", "tenant:other", "{ns:s00}", "a\nb", "a\r\nSET x y", "x" * 10_000, "",
               "../etc", "a b", "ü", "\x00"]


def test_hostile_session_ids_get_400_and_touch_nothing(client: TestClient, redis_server: RedisProcess) -> None:
    seed_victim(client)
    before = redis_snapshot(redis_server)
    chat = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for bad in HOSTILE_IDS:
        for resp in (
            client.post("/v1/sessions", json={"session_id": bad}),
            client.post("/v1/sessions/victim/fork", json={"session_id": bad}),
            client.post("/v1/chat/completions", json={**chat, "session_id": bad}),
        ):
            assert_clean_error(resp, (400,))
        if bad and bad.isascii() and bad.isprintable():
            header = client.post("/v1/chat/completions", json=chat, headers={"x-session-id": bad})
            assert_clean_error(header, (400,))
        if not bad:
            continue  # /v1/sessions/ is the collection, not a session
        quoted = bad.replace("%", "%25").replace("/", "%2F").replace("\n", "%0A").replace("\r", "%0D") \
            .replace("\x00", "%00").replace(" ", "%20").replace("*", "%2A")
        for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/messages"), ("POST", "/fork")):
            resp = client.request(method, f"/v1/sessions/{quoted}{suffix}", json={"content": "hi"})
            assert_clean_error(resp, (400, 404, 405))
    wait_written(client)
    assert redis_snapshot(redis_server) == before
    assert client.get("/v1/sessions/victim").status_code == 200


@pytest.mark.parametrize(("temperature", "top_p"), [(5e-324, 1.0), (1e-300, 1e-300), (1e-45, 0.5), (2.0, 5e-324),
                                                    (2.0, 1.0)])
def test_extreme_sampling_parameters_are_served(client: TestClient, temperature: float, top_p: float) -> None:
    """Found by schemathesis: a temperature or top_p below float32's range made sampling fail with a 500."""
    body = {"model": "tiny-random", "prompt": "Once upon a time", "max_tokens": 3, "temperature": temperature,
            "top_p": top_p, "seed": 7}
    for path, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"stream": True})):
        payload = {**body, **extra}
        if "chat" in path:
            payload.pop("prompt")
            payload["messages"] = [{"role": "user", "content": "hi"}]
        resp = client.post(path, json=payload)
        assert resp.status_code == 200, resp.text
        assert "generation failed" not in resp.text
