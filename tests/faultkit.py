"""Test helpers (no tests) shared by the fault, hostile-input and security suites: in-process pods, a reference."""

from __future__ import annotations

import time
from typing import Any

from starlette.testclient import TestClient

from service.app import create_app
from service.settings import PodSettings

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers at length and in order. " * 6}
QUESTIONS = ["Tell me about lighthouses.", "Who kept them?", "What did they eat?", "How did it end?",
             "Give it a title.", "Summarise that.", "And the moral?", "One more thing?"]


def pod_client(redis_url: str, loaded: Any, **overrides: Any) -> TestClient:
    """An in-process pod (exact codec, greedy-friendly, 16-token blocks); use it as a context manager."""
    defaults: dict[str, Any] = {"model": "tiny-random", "redis_url": redis_url, "codec": "exact",
                                "block_tokens": 16, "local_tier_bytes": 0, "pod_name": "pod-fault"}
    settings = PodSettings(**{**defaults, **overrides})
    return TestClient(create_app(settings, engine=loaded), raise_server_exceptions=False)


def chat(client: TestClient, messages: list[dict[str, str]], max_tokens: int = 8, **extra: Any) -> Any:
    headers = extra.pop("headers", None) or {}
    body = {"model": "tiny-random", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    return client.post("/v1/chat/completions", json=body, headers=headers)


def reference_reply(reference: TestClient, resp: Any, max_tokens: int = 8) -> str:
    """What a pod without the cache replies when handed exactly the tokens `resp`'s pod used (a pod turns an
    assistant message some pod generated into the very ids it generated, not a re-tokenization)."""
    ids = resp.json()["prompt_token_ids"]
    body = {"model": "tiny-random", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    got = reference.post("/v1/completions", json=body)
    assert got.status_code == 200, got.text
    return str(got.json()["choices"][0]["text"])


def reply_of(resp: Any) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def write_depth(client: TestClient) -> int:
    """Background write jobs queued or being written, as the pod exports them (kvstash_write_queue_depth)."""
    return int(metric(client, "kvstash_write_queue_depth"))


def wait_written(client: TestClient, timeout_s: float = 15.0) -> None:
    """Until the pod's background write queue is empty and nothing is being written."""
    deadline = time.monotonic() + timeout_s
    while write_depth(client):
        if time.monotonic() > deadline:
            raise AssertionError("background writes did not finish")
        time.sleep(0.02)


def state_of(client: TestClient) -> Any:
    return client.app.state.pod  # type: ignore[attr-defined]


def metric(client: TestClient, name: str, labels: str = "") -> float:
    """A sample's value from /metrics (0 when absent), e.g. metric(c, "kvstash_cache_rejected_total",
    'reason="checksum"')."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
