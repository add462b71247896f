"""A hit on the llamacpp engine continues to the bit as the engine continues from its own cache (tests.keptseq: one
sequence kept in memory between turns), at the engine's default threads, for full-attention (SmolLM2), sliding-window
(Gemma 3, gpt-oss: blocks and a boundary record) and hybrid recurrent (LFM2) models. Each later turn resumes on a
second engine from the first turn's KV and its boundary state, as a pod resumes from another pod's records.

The opening is ~240 tokens: later turns decode at positions 256-290, where llama.cpp's CPU attention splits a cache of
512 cells between two threads at cell 256, inside the tiny models' 32-token window; a window restored into cells 0-31
is summed in one piece and rounds differently (this failed before the window was restored in place)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from service.engines import LLAMACPP_MISSING, GenParams
from service.engines.generation import GenRequest
from service.engines.ggufpath import smollm2_gguf
from service.engines.llama.llamacpp import LlamaCppEngine
from tests.keptseq import KeptSequence
from tests.tinymodels import converter_missing, tiny_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason=LLAMACPP_MISSING)

TURNS = 3
MAX_TOKENS = 8
OPENING = " ".join(f"Step {i}: weigh the flour, note the time, and write down how the dough rose." for i in range(12))


def _model(name: str) -> Path:
    if name == "smollm2":
        return smollm2_gguf()
    if converter_missing() is not None:
        pytest.skip(converter_missing() or "")
    return tiny_gguf(name)


@pytest.mark.parametrize("name", ["smollm2", "gemma3", "gpt-oss", "lfm2"])
def test_a_hit_continues_as_the_engine_continues_from_memory(name: str) -> None:
    path = _model(name)
    engines = [LlamaCppEngine.load(str(path), parallel=1) for _ in range(2)]
    kept = KeptSequence(path)
    try:
        prompt = engines[0].prompt_ids(OPENING)
        assert len(prompt) > 4 * max(engines[0].layout.n_swa, 32)
        previous = None
        for turn in range(TURNS):
            engine = engines[turn % 2]
            params = GenParams(max_tokens=MAX_TOKENS, logprobs=0)
            if previous is None:
                gen = engine.generate(GenRequest(prompt, None, params))
            else:
                cached = len(previous.seq_ids)
                boundary = dict(previous.boundaries)[cached] if engine.boundary_records else None
                gen = engine.generate(GenRequest(prompt, previous.kv[:, :, :, :cached], params, boundary=boundary))
                assert gen.cached_tokens == cached, turn
            ids, logprobs = kept.complete(prompt, MAX_TOKENS)
            assert gen.logprobs is not None
            assert gen.token_ids == ids[:len(gen.token_ids)], (name, turn)
            assert [t.logprob for t in gen.logprobs] == logprobs[:len(gen.logprobs)], (name, turn)  # to the bit
            previous = gen
            prompt = gen.seq_ids + engine.text_ids(f" Note {turn}: and then?")
    finally:
        kept.close()
        for engine in engines:
            engine.close()
