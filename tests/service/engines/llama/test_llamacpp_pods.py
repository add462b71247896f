"""llama.cpp pods as real processes: a conversation alternating between two pods hits on every turn after the
first and replies as a pod that prefilled everything; sessions resume on the other pod. Twice: with the lossless
codec over llama.cpp's f16 cache, and with q8 over its q8_0 cache (frames that are the cache's own bytes)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import httpx
import pytest
import redis

from cachestore.codec import read_header
from ops.chatclient import stream_chat
from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from service.engines import GenParams
from service.engines.generation import GenRequest
from service.engines.llama import kv_cache_type
from service.engines.llama.llamacpp import LlamaCppEngine
from tests.support import cached_as_a_later_turn, post_chat, resume_session, running, settle

ARGS = ("--engine", "llamacpp", "--block-tokens", "16", "--parallel", "2", "--threads", "1")
SYSTEM = {"role": "system", "content": "You are a concise science tutor. Answer in two or three sentences."}
QUESTIONS = ["What is photosynthesis?", "Where in the cell does it happen?", "What gas does it release?",
             "Why does that matter for animals?"]


@pytest.fixture(scope="module", params=["exact", "q8"])
def codec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def redis_url(codec: str) -> Iterator[str]:
    redis = RedisProcess().start()
    try:
        yield redis.url
    finally:
        redis.cleanup()


@pytest.fixture(scope="module")
def pods(redis_url: str, codec: str) -> Iterator[dict[str, PodProcess]]:
    args = (*ARGS, "--codec", codec)
    with running({
        "a": PodProcess("llama-a", redis_url, "smollm2", args),
        "b": PodProcess("llama-b", redis_url, "smollm2", args),
        "plain": PodProcess("llama-plain", redis_url, "smollm2", args, no_cache=True),
    }) as procs:
        yield procs


_chat = partial(post_chat, model="smollm2", max_tokens=48, timeout_s=120)


def test_ready_reports_the_engine(pods: dict[str, PodProcess]) -> None:
    ready = httpx.get(pods["a"].url + "/readyz").json()
    assert (ready["engine"], ready["model"]) == ("llamacpp", "smollm2")
    models = httpx.get(pods["a"].url + "/v1/models").json()["data"]
    assert models[0]["engine"] == "llamacpp" and models[0]["context_length"] == 8192


def test_turns_alternate_llama_pods_with_hits_and_exact_replies(
    pods: dict[str, PodProcess], redis_url: str, codec: str, figures: dict[str, object]
) -> None:
    """Every turn after the first hits on the other pod, and its reply is exactly that of one llama.cpp that kept
    the conversation in memory and reused the same number of tokens: the KV crossed Redis bit for bit, as token
    rows (the pods write them so, and a hit is received into the rows of a sequence state). With q8 the pods run a
    q8_0 cache, as the reference does, and the frames are that cache's bytes: no more lossy than the cache itself.

    Against a pod that prefilled everything the reply may differ on a near-tie: llama.cpp's logits depend on how
    tokens were batched (a reply's tokens were decoded one at a time, a no-cache pod prefills them together).
    Such turns are counted and reported, never asserted away."""
    reference = LlamaCppEngine.load("smollm2", parallel=1, threads=1, kv_type=kv_cache_type(codec))
    messages = [SYSTEM]
    previous_prompt, previous_kv, differs = 0, None, []
    try:
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            pod = pods["a"] if turn % 2 == 0 else pods["b"]
            resp, plain = _chat(pod.url, messages), _chat(pods["plain"].url, messages)
            assert resp.status_code == 200 and plain.status_code == 200, resp.text
            reply = resp.json()["choices"][0]["message"]["content"]
            usage = resp.json()["usage"]
            cached = cached_as_a_later_turn(resp, turn, previous_prompt)
            prompt = reference.chat_ids(messages)
            assert usage["prompt_tokens"] == len(prompt)
            kept = previous_kv[:, :, :, :cached] if cached else None
            expected = reference.generate(GenRequest(prompt, kept, GenParams(max_tokens=48)))
            assert reply == expected.text, f"turn {turn}: the cache changed the reply"
            no_cache = plain.json()["choices"][0]["message"]["content"]
            if turn == 0:
                assert reply == no_cache  # the same computation exactly
            elif reply != no_cache:
                differs.append({"turn": turn, "cached": reply, "no_cache": no_cache})
            previous_prompt, previous_kv = usage["prompt_tokens"], expected.kv
            messages.append({"role": "assistant", "content": reply})
            settle(pod.url)
    finally:
        reference.close()
    figures[f"turns_differing_from_no_cache_{codec}"] = differs
    client = redis.Redis.from_url(redis_url)
    try:
        frames = [client.get(key) for key in client.scan_iter("*:blk:*")]
    finally:
        client.close()
    assert frames and all(read_header(f).rows and read_header(f).mode == codec for f in frames)


def test_streamed_reply_equals_the_whole_one(pods: dict[str, PodProcess]) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Name the planets of the solar system."}]
    whole = _chat(pods["a"].url, messages).json()["choices"][0]["message"]["content"]
    with httpx.Client(timeout=120) as client:
        streamed = stream_chat(client, pods["b"].url, {"model": "smollm2", "messages": messages, "max_tokens": 48})
    assert streamed.status == 200 and streamed.text == whole


def test_session_resumes_on_the_other_llama_pod(pods: dict[str, PodProcess]) -> None:
    a, b = pods["a"], pods["b"]
    resume_session(a.url, b.url, "llama-1", [SYSTEM], QUESTIONS, max_tokens=24, timeout_s=120,
                   between=lambda: settle(a.url))
