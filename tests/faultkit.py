"""Test helpers (no tests) shared by the fault, hostile-input and security suites: in-process pods, a reference."""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
from starlette.testclient import TestClient

from tests.support import chat as support_chat
from tests.support import complete, make_client, ok, wait_written

__all__ = ["chat", "metric", "pod_client", "reference_reply", "reply_of", "state_of", "uncached_pod", "wait_written",
           "write_depth"]

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers at length and in order. " * 6}
QUESTIONS = ["Tell me about lighthouses.", "Who kept them?", "What did they eat?", "How did it end?",
             "Give it a title.", "Summarise that.", "And the moral?", "One more thing?"]


# a pod without the local tier, and chats that return their token ids (reference_reply replays them)
pod_client = partial(make_client, local_tier_bytes=0, pod_name="pod-fault")
chat = partial(support_chat, max_tokens=8, return_token_ids=True)
NO_REDIS = "redis://127.0.0.1:1/0"  # nothing listens there


def uncached_pod(engine: Any) -> TestClient:
    """A pod without the cache: the answer every cached pod must give (the `plain_pod` fixture)."""
    return pod_client(NO_REDIS, engine, cache_enabled=False, pod_name="plain")


def reference_reply(reference: TestClient | str, resp: Any, max_tokens: int = 8) -> str:
    """What a pod without the cache (in-process, or a process at that URL) replies when handed exactly the tokens
    `resp`'s pod used (a pod turns an assistant message some pod generated into the very ids it generated, not a
    re-tokenization)."""
    ids = resp.json()["prompt_token_ids"]
    if isinstance(reference, str):
        body = {"model": "tiny-random", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        return str(ok(httpx.post(reference + "/v1/completions", json=body, timeout=60)).json()["choices"][0]["text"])
    return str(complete(reference, ids, max_tokens=max_tokens)["choices"][0]["text"])


def reply_of(resp: Any) -> str:
    """A chat completion's reply, checked to be a 200."""
    return str(ok(resp).json()["choices"][0]["message"]["content"])


def write_depth(client: TestClient) -> int:
    """Background write jobs queued or being written, as the pod exports them (kvstash_write_queue_depth)."""
    return int(metric(client, "kvstash_write_queue_depth"))


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
