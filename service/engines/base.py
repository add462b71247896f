"""The engine seam: everything the request path needs from a model runtime, and nothing more.

The pipeline knows token ids, KV tensors in the codec's layout [layers, 2, kv_heads, tokens,
head_dim] and a fingerprint. How a runtime (transformers, llama.cpp, a future one) keeps its
cache is the engine's business alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cachestore.errors import ConfigError
from cachestore.hashing import ModelFingerprint
from service.engines.generation import Generation, GenParams
from service.rehydrate import LayerGate

# on_prefill(get_kv): get_kv(start, end) -> [layers, 2, kv_heads, end - start, head_dim], a CPU copy; called
# during the hook (llama.cpp's reads a pooled snapshot of the sequence, reused once the hook returns)
PrefillHook = Callable[[Callable[[int, int], torch.Tensor]], None]

ENGINES = ("hf", "llamacpp", "llama-server")
# llama.cpp's flash attention, by the setting's name (KVSTASH_FLASH_ATTN): llama_context_params.flash_attn_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def check_flash_attn(flash_attn: str, kv_type: str = "f16") -> None:
    """A ConfigError unless `flash_attn` is one of FLASH_ATTN's names, and "off" is asked of an F16 cache only."""
    if flash_attn not in FLASH_ATTN:
        raise ConfigError(f"flash attention must be one of {', '.join(FLASH_ATTN)}, got {flash_attn!r}")
    if flash_attn == "off" and kv_type != "f16":
        raise ConfigError(f"a {kv_type} KV cache (codec q8) needs llama.cpp's flash attention: "
                          "run it with flash attention auto or on")


@dataclass(frozen=True)
class KvGeometry:
    """The shape and dtype of the KV an engine hands over and takes back."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the KV tensors exchanged with the pipeline
    max_context: int  # tokens one sequence may hold (prompt + reply)


def gguf_fingerprint(
    engine_id: str, weights_digest: str, template: str, add_bos: bool, geometry: KvGeometry, block_tokens: int,
    codec_name: str,
) -> ModelFingerprint:
    """The fingerprint of a GGUF served by a llama.cpp runtime: `engine_id` names the runtime, its version and
    the state layout; the GGUF's digest, chat template and BOS rule name the model and its tokens."""
    template_digest = hashlib.blake2b(template.encode(), digest_size=16).hexdigest()
    return ModelFingerprint(
        model_id=f"{engine_id}/{weights_digest}",
        tokenizer_digest=f"gguf/bos={int(add_bos)}/tpl=b2:{template_digest}",
        dtype="float16",
        num_layers=geometry.num_layers,
        kv_heads=geometry.kv_heads,
        head_dim=geometry.head_dim,
        block_tokens=block_tokens,
        codec=codec_name,
    )


class Engine(Protocol):
    """A loaded model runtime. `generate` may be called from up to `parallel` threads at once."""

    kind: str  # "hf" | "llamacpp": blocks of different engines never mix (it is in the fingerprint)
    name: str  # the model name clients send
    geometry: KvGeometry
    parallel: int
    layerwise: bool  # runs the cached context layer by layer: `generate` waits on `kv_ready` per layer
    runs_torch: bool  # `generate` runs torch on the calling thread: the pod calls it on its compute thread
    row_frames: bool  # exact and fp16 frames as token rows (`CodecSpec.rows`): the order its lent contexts hold

    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        """Names the engine, its version, the weights and every setting that changes the KV bits."""
        ...

    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        """The chat's token ids ending with the assistant generation prompt; content is plain text, or the
        ids in `known` (message index -> the ids a pod generated for that message's exact text). `tools` and
        the messages' `tool_calls` are rendered as service.engines.tools says."""
        ...

    def text_ids(self, text: str) -> list[int]:
        """Plain text as token ids (no special tokens, no BOS)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        ...

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
        """Generate after `prompt_ids`, reusing `cached_kv` [layers, 2, kv_heads, n, head_dim] for
        prompt_ids[:n]; returns the reply and the KV of the whole fed sequence, or of its tokens from
        `keep_from` on if the engine can copy out less (then `Generation.kv_from` says so: a hit's cached
        blocks need no write-back, so their copy is skipped). Blocks until done.
        `on_prefill` is called once, after the first token, with a function that copies out the KV of
        prompt tokens [start, end) (so their blocks can be written while the reply is generated).
        `kv_ready`, when given, says which layers of `cached_kv` are in place yet: a `layerwise` engine
        waits for each layer as it reaches it, any other engine for all of them before reading any."""
        ...

    def context_for(self, tokens: int) -> torch.Tensor | None:
        """A [layers, 2, kv_heads, tokens, head_dim] tensor of the engine's dtype that a hit of up to `tokens` tokens
        may be dequantized into, where the engine reads it (llama.cpp: inside a sequence state); None: the pipeline
        uses its own. Handed back with `give_context`."""
        ...

    def give_context(self, kv: torch.Tensor) -> bool:
        """Take back a tensor `context_for` returned; False for any other."""
        ...

    def close(self) -> None:
        ...
