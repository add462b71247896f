"""Another model than SmolLM2 through llama.cpp pods: the tiny Llama 3 of head_dim 128 and 4 query heads a KV head
(tests.tinymodels) alternates between two pods, hits on every later turn, replies as one engine that kept the
conversation in memory, and a session resumes on the other pod."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pytest

from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from service.engines import GenParams
from service.engines.generation import GenRequest
from service.engines.llama.llamacpp import LlamaCppEngine
from tests.support import cached_as_a_later_turn, post_chat, resume_session, running, settle
from tests.tinymodels import converter_missing, tiny_gguf

pytestmark = pytest.mark.skipif(converter_missing() is not None, reason=converter_missing() or "")

MODEL = "llama3-hd128"
ARGS = ("--engine", "llamacpp", "--block-tokens", "16", "--parallel", "2", "--threads", "1", "--codec", "exact")
SYSTEM = {"role": "system", "content": "You are a concise science tutor. Answer in two or three sentences."}
QUESTIONS = ["What is photosynthesis?", "Where in the cell does it happen?", "What gas does it release?",
             "Why does that matter for animals?"]


@pytest.fixture(scope="module")
def gguf() -> str:
    return str(tiny_gguf(MODEL))


@pytest.fixture(scope="module")
def pods(gguf: str) -> Iterator[dict[str, PodProcess]]:
    server = RedisProcess().start()
    try:
        with running({
            "a": PodProcess("hd128-a", server.url, gguf, ARGS),
            "b": PodProcess("hd128-b", server.url, gguf, ARGS),
        }) as procs:
            yield procs
    finally:
        server.cleanup()


_chat = partial(post_chat, model=f"tiny-{MODEL}", max_tokens=24, timeout_s=120)


def test_the_engine_reads_the_geometry_of_another_model(gguf: str) -> None:
    engine = LlamaCppEngine.load(gguf, parallel=1, threads=1)
    try:
        g = engine.geometry
        assert (g.num_layers, g.kv_heads, g.head_dim, g.max_context) == (2, 1, 128, 2048)
        assert engine.layout.full_attention_only and engine.layout.kv_row_bytes == (256, 256)
        assert engine.fingerprint(16, "exact").head_dim == 128
    finally:
        engine.close()


def test_turns_alternate_pods_with_hits_and_exact_replies(pods: dict[str, PodProcess], gguf: str) -> None:
    reference = LlamaCppEngine.load(gguf, parallel=1, threads=1)
    messages = [SYSTEM]
    previous_prompt, previous_kv = 0, None
    # the ids each reply was generated as: random weights reply in text that tokenizes back to other ids, and the
    # pods go on from the generated ones
    known: dict[int, list[int]] = {}
    try:
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            pod = pods["a"] if turn % 2 == 0 else pods["b"]
            resp = _chat(pod.url, messages)
            assert resp.status_code == 200, resp.text
            reply = resp.json()["choices"][0]["message"]["content"]
            usage = resp.json()["usage"]
            cached = cached_as_a_later_turn(resp, turn, previous_prompt)
            prompt = reference.chat_ids(messages, known)
            assert usage["prompt_tokens"] == len(prompt), turn
            kept = previous_kv[:, :, :, :cached] if cached else None
            expected = reference.generate(GenRequest(prompt, kept, GenParams(max_tokens=24)))
            assert reply == expected.text, f"turn {turn}: the cache changed the reply"
            previous_prompt, previous_kv = usage["prompt_tokens"], expected.kv
            if expected.reply_ids is not None:
                known[len(messages)] = expected.reply_ids
            messages.append({"role": "assistant", "content": reply})
            settle(pod.url)
    finally:
        reference.close()


def test_session_resumes_on_the_other_pod(pods: dict[str, PodProcess]) -> None:
    a, b = pods["a"], pods["b"]
    resume_session(a.url, b.url, "hd128-1", [SYSTEM], QUESTIONS, max_tokens=24, timeout_s=120,
                   between=lambda: settle(a.url))
