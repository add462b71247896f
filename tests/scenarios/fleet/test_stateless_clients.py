"""Stateless OpenAI clients (the official `openai` package, no session id) resend the whole conversation to the
next pod of a round robin the moment a reply ends: every token some pod already computed comes from the cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from tests.support import POD_ARGS

TURNS = ["Tell me a story about a lighthouse.", "What happened next?", "Who else was there?", "Describe the sea.",
         "Was there a storm?", "How did it end?", "Give it a title.", "Summarise it.", "Who would like it?",
         "Thank you."]


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    redis = RedisProcess().start()
    pods = [PodProcess(f"pod-{c}", redis.url, "tiny-random", POD_ARGS) for c in "abc"]
    plain = PodProcess("pod-plain", redis.url, "tiny-random", POD_ARGS, no_cache=True)
    try:
        for p in [*pods, plain]:
            p.start()
        for p in [*pods, plain]:
            p.wait_ready(120)
        yield {"redis": redis, "pods": pods, "plain": plain}
    finally:
        for p in [*pods, plain]:
            p.cleanup()
        redis.cleanup()


def _client(pod: PodProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=pod.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_ten_turns_round_robin_hit_everything_already_computed(
    cluster: dict[str, Any], figures: dict[str, object]
) -> None:
    pods, plain = cluster["pods"], cluster["plain"]
    messages: list[dict[str, str]] = [{"role": "system", "content": "You tell long stories."}]
    possible = cached_sum = 0
    previous: tuple[int, int] | None = None  # (prompt tokens, completion tokens) of the turn before
    per_turn = []
    for turn, question in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        resp = _client(pods[turn % 3]).chat.completions.create(
            model="tiny-random", messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
            extra_body={"return_token_ids": True},
        )
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        cached = resp.usage.prompt_tokens_details.cached_tokens or 0
        if previous is not None:  # the previous prompt and its reply, less the reply's last (never fed) token
            computed = previous[0] + previous[1] - 1
            possible += computed
            cached_sum += min(cached, computed)
            per_turn.append((turn + 1, cached, computed))
        prompt_ids = (resp.model_extra or {})["prompt_token_ids"]
        assert len(prompt_ids) == resp.usage.prompt_tokens
        # a pod without the cache, handed exactly those tokens, replies the same (the codec is lossless)
        same = httpx.post(plain.url + "/v1/completions", timeout=120, json={
            "model": "tiny-random", "prompt": prompt_ids, "max_tokens": 24, "temperature": 0})
        reply = resp.choices[0].message.content or ""
        assert same.status_code == 200, same.text
        assert same.json()["choices"][0]["text"] == reply, f"turn {turn + 1}"
        previous = (resp.usage.prompt_tokens, resp.usage.completion_tokens)
        messages.append({"role": "assistant", "content": reply})
    figures.update({"possible": possible, "cached": cached_sum, "per_turn": per_turn})
    assert cached_sum >= 0.99 * possible, per_turn


def test_sessions_api_hits_everything(cluster: dict[str, Any]) -> None:
    pods = cluster["pods"]
    sid = "stateless-s1"
    assert httpx.post(pods[0].url + "/v1/sessions", json={"session_id": sid}).status_code == 201
    previous: int | None = None
    for turn, question in enumerate(TURNS[:6]):
        r = httpx.post(f"{pods[turn % 3].url}/v1/sessions/{sid}/messages", timeout=120,
                       json={"content": question, "max_tokens": 24})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        if previous is not None:
            assert usage["prompt_tokens_details"]["cached_tokens"] == previous, turn
        previous = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    shown = httpx.get(f"{pods[1].url}/v1/sessions/{sid}").json()
    assert all(set(m) == {"role", "content"} for m in shown["messages"])


def test_an_edited_reply_is_tokenized_as_text(cluster: dict[str, Any]) -> None:
    pods = cluster["pods"]
    messages = [{"role": "user", "content": "Say something long about ships."}]
    first = httpx.post(pods[0].url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-random", "messages": messages, "max_tokens": 24, "return_token_ids": True}).json()
    reply = first["choices"][0]["message"]["content"]
    edited = reply[:-1] + ("x" if not reply.endswith("x") else "y")
    follow = [*messages, {"role": "assistant", "content": edited}, {"role": "user", "content": "More."}]
    second = httpx.post(pods[1].url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-random", "messages": follow, "max_tokens": 8, "return_token_ids": True}).json()
    plain = httpx.post(cluster["plain"].url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-random", "messages": follow, "max_tokens": 8, "return_token_ids": True}).json()
    # the edited text is tokenized as text (as by a pod that never saw the reply), and nothing cached past the
    # first token that differs is reused: the reply equals a no-cache pod's
    assert second["prompt_token_ids"] == plain["prompt_token_ids"]
    assert second["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    first_ids = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    agree = next((i for i, (a, b) in enumerate(zip(first_ids, second["prompt_token_ids"], strict=False)) if a != b),
                 len(first_ids))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] <= agree
