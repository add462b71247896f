"""The `hf` engine: a transformers causal LM (models) run by the runner, one generation at a time."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from cachestore.hashing import ModelFingerprint
from service.engines.base import Engine, KvGeometry, PrefillHook
from service.engines.gate import LayerGate
from service.engines.generation import Generation, GenParams
from service.engines.hf.models import LoadedModel, load_model
from service.engines.hf.runner import ModelRunner


class HfEngine(Engine):
    """transformers behind the engine seam; its blocks are named by the weights digest, as before. A hit is
    dequantized into the pipeline's pooled context, which generation grows in (`context_for`'s default)."""

    kind = "hf"
    parallel = 1  # one forward at a time: the model is not batched across requests
    layerwise = True  # a cached layer is waited for when the forward step reaches it (hfcache.GrowingLayer)
    runs_torch = True  # the forward step runs on the calling thread

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.runner = ModelRunner(loaded)
        self.name = loaded.name
        self.geometry = KvGeometry(loaded.num_layers, loaded.kv_heads, loaded.head_dim, loaded.dtype,
                                   loaded.max_context)

    @classmethod
    def load(cls, model: str, *, device: str = "cpu") -> HfEngine:
        return cls(load_model(model, device=device))

    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        # unchanged from before the seam, so blocks written by earlier hf pods still hit
        return self.loaded.fingerprint(block_tokens, codec_name)

    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        return self.runner.chat_ids(messages, known, tools)

    def text_ids(self, text: str) -> list[int]:
        return self.runner.text_ids(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.runner.decode(ids)

    def generate(
        self,
        prompt_ids: list[int],
        cached_kv: torch.Tensor | None,
        params: GenParams,
        on_text: Callable[[str], None] | None = None,
        on_prefill: PrefillHook | None = None,
        kv_ready: LayerGate | None = None,
        keep_from: int = 0,
    ) -> Generation:
        return self.runner.generate(prompt_ids, cached_kv, params, on_text, on_prefill, kv_ready, keep_from)

