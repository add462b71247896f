"""End to end with real processes: Redis + two uvicorn pods + a no-cache pod, turns alternating pods."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from tests.support import settle, tiny_pods

QUESTIONS = ["Tell me a story about a lighthouse keeper.", "What happened next?", "How did it end?",
             "Give it a title."]
SYSTEM = {"role": "system", "content": "You are a storyteller who answers at length. " * 6}


@pytest.fixture
def pods(redis_server: RedisProcess) -> Iterator[dict[str, PodProcess]]:
    with tiny_pods(redis_server.url) as procs:
        yield procs


def _chat(url: str, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 10, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_turns_alternate_pods_with_hits_and_identical_replies(pods: dict[str, PodProcess]) -> None:
    messages = [SYSTEM]
    previous_prompt = 0
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        pod = pods["a"] if turn % 2 == 0 else pods["b"]
        resp = _chat(pod.url, messages)
        plain = _chat(pods["plain"].url, messages)
        assert resp.status_code == 200 and plain.status_code == 200
        assert resp.headers["x-kv-pod"] == pod.name
        assert plain.headers["x-kv-cache"] == "bypass"
        reply = resp.json()["choices"][0]["message"]["content"]
        assert reply == plain.json()["choices"][0]["message"]["content"], f"turn {turn} differs"
        usage = resp.json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if turn == 0:
            assert cached == 0
        else:  # everything the other pod processed, up to its last full block
            assert cached >= (previous_prompt // 16) * 16 > 0
        previous_prompt = usage["prompt_tokens"]
        messages.append({"role": "assistant", "content": reply})
        settle(pod.url)


def test_session_resumes_on_another_pod_after_the_first_stops(pods: dict[str, PodProcess]) -> None:
    a, b = pods["a"], pods["b"]
    assert httpx.post(a.url + "/v1/sessions", json={"session_id": "resume-1", "messages": [SYSTEM]}).status_code == 201
    first = httpx.post(a.url + "/v1/sessions/resume-1/messages", json={"content": QUESTIONS[0], "max_tokens": 10},
                       timeout=60)
    assert first.status_code == 200
    a.stop()  # graceful: drains its write queue before exiting
    second = httpx.post(b.url + "/v1/sessions/resume-1/messages", json={"content": QUESTIONS[1], "max_tokens": 10},
                        timeout=60)
    assert second.status_code == 200, second.text
    assert second.headers["x-kv-cache"] == "hit"
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first.json()["usage"]["prompt_tokens"]
    session = httpx.get(b.url + "/v1/sessions/resume-1").json()
    messages = session["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    replay = _chat(pods["plain"].url, messages[:-1])
    assert replay.json()["choices"][0]["message"]["content"] == messages[-1]["content"]
