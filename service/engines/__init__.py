"""Model runtimes behind one seam: `hf` (transformers) and `llamacpp` (llama-cpp-python)."""

from __future__ import annotations

from service.engines.base import ENGINES, Engine, KvGeometry
from service.engines.generation import Generation, GenParams

__all__ = ["ENGINES", "Engine", "GenParams", "Generation", "KvGeometry", "load_engine"]


def load_engine(kind: str, model: str, *, device: str = "cpu", parallel: int = 4, threads: int = 0) -> Engine:
    """Load `model` under engine `kind`; imports only the runtime that is asked for."""
    from cachestore.errors import ConfigError  # noqa: PLC0415

    if kind == "hf":
        from service.engines.hf import HfEngine  # noqa: PLC0415

        return HfEngine.load(model, device=device)
    if kind == "llamacpp":
        from service.engines.llamacpp import LlamaCppEngine  # noqa: PLC0415

        return LlamaCppEngine.load(model, parallel=parallel, threads=threads)
    if kind == "llama-server":  # spawns its own llama-server; `kvstash sidecar` also fronts a running one
        from service.engines.llamaserver import LlamaServerEngine  # noqa: PLC0415

        return LlamaServerEngine.spawn(model, parallel=parallel, threads=threads)
    raise ConfigError(f"engine {kind!r} is not one of {', '.join(ENGINES)}")
