"""The `hf` engine: a transformers causal LM (models) run by the runner, concurrent generations decoded together
(batch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cachestore.hashing import ModelFingerprint
from service.engines.base import Engine, KvGeometry, KvLayout
from service.engines.generation import Generation, GenRequest
from service.engines.hf import PARALLEL, boundarystate
from service.engines.hf.batch import DecodeBatcher
from service.engines.hf.layout import rope_of
from service.engines.hf.models import LoadedModel, load_model
from service.engines.hf.runner import ModelRunner


class HfEngine(Engine):
    """transformers behind the engine seam; its blocks are named by the weights digest, as before. A hit is
    dequantized into the pipeline's pooled context, which generation grows in (`context_for`'s default).

    A model with sliding-window or linear (conv / recurrent) layers beside its full-attention ones (Gemma 3, gpt-oss,
    LFM2: service.engines.hf.layout) keeps its full-attention layers in blocks, and the others' state at each prompt's
    and reply's end in boundary records (service.engines.hf.boundarystate); it resumes only at such a boundary."""

    kind = "hf"
    layerwise = True  # a cached layer is waited for when the forward step reaches it (hfcache.GrowingLayer)
    runs_torch = False  # the scheduler (batch.DecodeBatcher) runs the model on the process's compute thread

    def __init__(self, loaded: LoadedModel, parallel: int = PARALLEL) -> None:
        self.loaded = loaded
        self.runner = ModelRunner(loaded)
        self.batcher = DecodeBatcher(self.runner, parallel)
        # sequences decoded together (one when the model's attention cannot take a batch of rows)
        self.parallel = parallel if self.batcher.batched else 1
        self.name = loaded.name
        self.geometry = KvGeometry(loaded.num_layers, loaded.kv_heads, loaded.head_dim, loaded.dtype,
                                   loaded.max_context)
        layout = self.layout = loaded.layout
        self.boundary_records = layout.boundary_records
        self.kv_layout = KvLayout(sliding=layout.sliding, window=layout.window, recurrent=layout.recurrent,
                                  tag=layout.tag(), rope=rope_of(loaded.model, loaded.head_dim))

    @classmethod
    def load(cls, model: str, *, device: str = "cpu", parallel: int = PARALLEL) -> HfEngine:
        return cls(load_model(model, device=device), parallel)

    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        # unchanged from before the seam for full attention, so blocks written by earlier hf pods still hit; a layout
        # with other layers is named in it (`kv_layout.tag`)
        return self.loaded.fingerprint(block_tokens, codec_name)

    def boundary_problem(self, state: bytes, position: int) -> str | None:
        """Why a boundary state read back from Redis (untrusted) cannot resume a sequence at `position`, or None."""
        if not self.boundary_records:
            return super().boundary_problem(state, position)
        return boundarystate.state_problem(state, self.layout, position, self.loaded.dtype)

    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        return self.runner.chat_ids(messages, known, tools)

    def text_ids(self, text: str) -> list[int]:
        return self.runner.text_ids(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.runner.decode(ids)

    def generate(self, request: GenRequest) -> Generation:
        """As Engine.generate: a sliding-window or hybrid model resumes only with `boundary` (`boundary_problem`
        checked), and returns its boundary states at the prompt's end and the sequence's."""
        return self.batcher.generate(request)

