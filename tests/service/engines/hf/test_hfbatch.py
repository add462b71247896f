"""The hf engine decodes concurrent generations together: the same greedy tokens as one at a time, in shared steps."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from cachestore.errors import ConfigError
from service.engines import GenParams, load_engine
from service.engines.generation import GenRequest
from service.engines.hf import hfcache
from service.engines.hf.batch import PREFILL_CHUNK
from service.engines.hf.engine import HfEngine
from service.runtime import threads
from service.settings import PodSettings
from tests.timing import wait_for

GREEDY = GenParams(max_tokens=20)
QUESTIONS = ["Name three rivers of Europe.", "What is the capital of Peru, and why is it there?",
             "Say something about owls.", " ".join(["Count from one to ten in French, please."] * 30)]


@pytest.fixture(scope="module")
def engine(tiny_model: Any) -> HfEngine:
    return HfEngine(tiny_model, parallel=3)


def _prompt(engine: HfEngine, question: str) -> list[int]:
    return engine.chat_ids([{"role": "system", "content": "You are terse."}, {"role": "user", "content": question}])


def _all_waiting(engine: HfEngine, n: int) -> None:
    """Until `n` generations wait for the scheduler (held off the compute thread meanwhile by the caller)."""
    wait_for(lambda: engine.batcher.waiting() >= n, f"{n} generations waiting for the scheduler", 30)


def test_concurrent_requests_decode_in_shared_steps_with_the_greedy_tokens_of_one_at_a_time(engine: HfEngine) -> None:
    """Four requests at once on a pod of three sequences: one resumes a cached prefix, one streams, one has a prompt
    of several prefill chunks, fed between the others' decoding steps."""
    prompts = [_prompt(engine, q) for q in QUESTIONS]
    assert len(prompts[3]) > 2 * PREFILL_CHUNK
    alone = [engine.runner.generate(GenRequest(p, None, GREEDY)) for p in prompts]  # sequential, never batched
    with torch.inference_mode():
        _, cache = hfcache.forward(engine.runner.model, prompts[0], None)
    hit_kv = hfcache.tensor_from_cache(cache)[:, :, :, :16]  # one of them resumes a cached prefix
    deltas: list[str] = []
    before = (engine.batcher.stats.steps, engine.batcher.stats.rows)
    release = threading.Event()
    holding = threads.compute_executor().submit(release.wait)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(engine.generate, GenRequest(p, hit_kv if i == 0 else None, GREEDY,
                               deltas.append if i == 1 else None)) for i, p in enumerate(prompts)]
        _all_waiting(engine, len(prompts))  # the compute thread is held: they begin together once it is free
        release.set()
        holding.result()
        together = [f.result(timeout=120) for f in futures]
    for one, both in zip(alone, together, strict=True):
        assert both.token_ids == one.token_ids and both.text == one.text
        assert both.seq_ids == one.seq_ids and both.finish_reason == one.finish_reason
        torch.testing.assert_close(both.kv, one.kv, rtol=1e-4, atol=1e-4)
    assert together[0].cached_tokens == 16 and "".join(deltas) == together[1].text
    steps, rows = (engine.batcher.stats.steps - before[0], engine.batcher.stats.rows - before[1])
    decoded = sum(len(g.token_ids) - 1 for g in together)  # each token but the first comes from a step
    assert rows == decoded and steps < decoded  # steps were shared
    assert engine.batcher.stats.widest == engine.parallel == 3  # never more than `parallel` at once


def test_a_short_prompt_is_prefilled_before_a_long_one_that_came_first(engine: HfEngine) -> None:
    """A hit's few uncached tokens do not wait behind a miss's whole prefill: the prompt with the fewest tokens left
    is fed first, whatever the order they came in."""
    long, short = _prompt(engine, QUESTIONS[3]), _prompt(engine, QUESTIONS[0])
    assert len(long) > 2 * PREFILL_CHUNK > PREFILL_CHUNK > len(short)
    release = threading.Event()
    holding = threads.compute_executor().submit(release.wait)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(engine.generate, GenRequest(long, None, GREEDY))
        _all_waiting(engine, 1)
        second = pool.submit(engine.generate, GenRequest(short, None, GREEDY))
        _all_waiting(engine, 2)
        release.set()
        holding.result()
        slow, quick = first.result(timeout=120), second.result(timeout=120)
    assert quick.ttft_s < slow.ttft_s  # first come, first fed would give the long prompt its first token first
    assert quick.token_ids == engine.runner.generate(GenRequest(short, None, GREEDY)).token_ids
    assert slow.token_ids == engine.runner.generate(GenRequest(long, None, GREEDY)).token_ids


def test_a_request_of_several_choices_and_a_failing_one_leave_the_others_alone(engine: HfEngine) -> None:
    prompt = _prompt(engine, QUESTIONS[0])
    two = engine.generate(GenRequest(prompt, None, GenParams(max_tokens=8, n=2, temperature=1.0, seed=3)))
    assert len(two.choices) == 1 and len(two.token_ids) >= 1

    def hang_up(_: str) -> None:
        raise ConnectionError("the client went away")

    release = threading.Event()
    holding = threads.compute_executor().submit(release.wait)
    with ThreadPoolExecutor(2) as pool:
        gone = pool.submit(engine.generate, GenRequest(prompt, None, GREEDY, hang_up))
        kept = pool.submit(engine.generate, GenRequest(_prompt(engine, QUESTIONS[1]), None, GREEDY))
        _all_waiting(engine, 2)
        release.set()
        holding.result()
        with pytest.raises(ConnectionError):
            gone.result(timeout=120)
        assert kept.result(timeout=120).token_ids == engine.runner.generate(GenRequest(_prompt(engine, QUESTIONS[1]),
                                                                                       None,
                                                                            GREEDY)).token_ids
    with pytest.raises(ValueError, match="token ids"):
        engine.generate(GenRequest([10**9], None, GREEDY))


def test_a_pod_that_names_no_parallel_gets_its_engines_own_and_a_number_outside_0_to_64_is_refused() -> None:
    """0 (the settings' default) is the engine's own: 8 for hf, whose sequences cost nothing until they exist."""
    assert PodSettings().parallel == 0
    assert load_engine("hf", "tiny-random").parallel == 8
    assert load_engine("hf", "tiny-random", parallel=2).parallel == 2
    for bad in (-1, 65):
        with pytest.raises(ConfigError, match="parallel must be in 0..64"):
            PodSettings(parallel=bad)
