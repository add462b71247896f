"""Model runtimes behind one seam: `hf` (transformers) and `llamacpp` (llama-cpp-python)."""

from __future__ import annotations

from service.engines.base import ENGINES, Engine, KvGeometry
from service.engines.generation import Generation, GenParams

__all__ = ["ENGINES", "Engine", "GenParams", "Generation", "KvGeometry", "kv_cache_type", "load_engine"]


def kv_cache_type(codec: str) -> str:
    """The KV cache type of the llama.cpp a pod runs for its codec (the llamacpp engine, a spawned llama-server): q8_0
    for q8 (its frames are that cache's bytes, stored and restored exactly), else f16."""
    from cachestore.codec import CodecSpec  # noqa: PLC0415

    return "q8_0" if codec and CodecSpec.parse(codec).mode == "q8" else "f16"


def load_engine(kind: str, model: str, *, device: str = "cpu", parallel: int = 4, threads: int = 0,
                codec: str = "", flash_attn: str = "auto") -> Engine:
    """Load `model` under engine `kind`, for a pod of codec `codec` (a llama.cpp cache type follows it, the llamacpp
    engine's and a spawned llama-server's: `kv_cache_type`), with llama.cpp's flash attention `flash_attn` (auto, on
    or off; the hf engine takes auto only); imports only the runtime that is asked for."""
    from cachestore.errors import ConfigError  # noqa: PLC0415

    if kind == "hf":
        if flash_attn != "auto":
            raise ConfigError("flash attention is a setting of the llama.cpp engines (llamacpp, llama-server)")
        from service.engines.hf import HfEngine  # noqa: PLC0415

        return HfEngine.load(model, device=device, parallel=parallel)
    if kind == "llamacpp":
        from service.engines.llamacpp import LlamaCppEngine  # noqa: PLC0415

        return LlamaCppEngine.load(model, parallel=parallel, threads=threads, kv_type=kv_cache_type(codec),
                                   flash_attn=flash_attn)
    if kind == "llama-server":  # spawns its own llama-server; `kvstash sidecar` also fronts a running one
        from service.engines.llamaserver import LlamaServerEngine  # noqa: PLC0415

        return LlamaServerEngine.spawn(model, parallel=parallel, threads=threads, kv_type=kv_cache_type(codec),
                                       flash_attn=flash_attn)
    raise ConfigError(f"engine {kind!r} is not one of {', '.join(ENGINES)}")
