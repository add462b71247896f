"""End to end with real processes: Redis + two uvicorn pods + a no-cache pod, turns alternating pods."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import httpx
import pytest

from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from tests.support import cached_as_a_later_turn, post_chat, resume_session, settle, tiny_pods

QUESTIONS = ["Tell me a story about a lighthouse keeper.", "What happened next?", "How did it end?",
             "Give it a title."]
SYSTEM = {"role": "system", "content": "You are a storyteller who answers at length. " * 6}


@pytest.fixture
def pods(redis_server: RedisProcess) -> Iterator[dict[str, PodProcess]]:
    with tiny_pods(redis_server.url) as procs:
        yield procs


_chat = partial(post_chat, max_tokens=10)


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
        cached_as_a_later_turn(resp, turn, previous_prompt)
        previous_prompt = resp.json()["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": reply})
        settle(pod.url)


def test_session_resumes_on_another_pod_after_the_first_stops(pods: dict[str, PodProcess]) -> None:
    a, b = pods["a"], pods["b"]
    # a.stop() is graceful: it drains its write queue before exiting
    resume_session(a.url, b.url, "resume-1", [SYSTEM], QUESTIONS, max_tokens=10, timeout_s=60, between=a.stop)
    session = httpx.get(b.url + "/v1/sessions/resume-1").json()
    messages = session["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    replay = _chat(pods["plain"].url, messages[:-1])
    assert replay.json()["choices"][0]["message"]["content"] == messages[-1]["content"]
