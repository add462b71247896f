"""The llama.cpp engines and what they share: `llamacpp` (llama-cpp-python in the pod, llamacpp), `llama-server` (a
sidecar of a stock llama-server, llamaserver); GGUF files (gguf, ggufmeta), llama.cpp's sequence state (llamastate,
statewrite, statelayout), slot files (slotfile) and the states lent as landing targets (lending, targets)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.engines.base import Engine

PARALLEL = 4  # sequences decoded together unless told (llama-server: its slots): the context is sized for them all


def kv_cache_type(codec: str) -> str:
    """The KV cache type of the llama.cpp a pod runs for its codec (the llamacpp engine, a spawned llama-server): q8_0
    for q8 (its frames are that cache's bytes, stored and restored exactly), else f16."""
    from cachestore.codec import CodecSpec  # noqa: PLC0415

    return "q8_0" if codec and CodecSpec.parse(codec).mode == "q8" else "f16"


def load(kind: str, model: str, *, device: str = "cpu", parallel: int = PARALLEL, threads: int = 0, codec: str = "",
         flash_attn: str = "auto") -> Engine:
    """The `llamacpp` or `llama-server` engine of `model`, its cache type following `codec` (`kv_cache_type`)."""
    if kind == "llamacpp":
        from service.engines.llama.llamacpp import LlamaCppEngine  # noqa: PLC0415

        return LlamaCppEngine.load(model, parallel=parallel, threads=threads, kv_type=kv_cache_type(codec),
                                   flash_attn=flash_attn)
    # llama-server: spawns its own; `kvstash sidecar` also fronts a running one
    from service.engines.llama.llamaserver import LlamaServerEngine  # noqa: PLC0415

    return LlamaServerEngine.spawn(model, parallel=parallel, threads=threads, kv_type=kv_cache_type(codec),
                                   flash_attn=flash_attn)
