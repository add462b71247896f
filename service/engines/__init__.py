"""Model runtimes behind one seam (service.engines.base): a subpackage per runtime, found by engine name.

`hf` (transformers) lives in service.engines.hf, `llamacpp` (llama-cpp-python) and `llama-server` (a sidecar of a
stock llama-server) in service.engines.llama. Each subpackage has a `load(kind, model, **options)`; adding an engine is
adding a subpackage and its names to `ENGINES`.
"""

from __future__ import annotations

import importlib

from service.engines.base import Engine, KvGeometry, KvLayout
from service.engines.generation import Generation, GenParams

__all__ = ["ENGINES", "Engine", "GenParams", "Generation", "KvGeometry", "KvLayout", "load_engine"]

# engine name -> the subpackage that loads it; only the subpackage asked for is imported (and its runtime with it)
ENGINES = {"hf": "service.engines.hf", "llamacpp": "service.engines.llama", "llama-server": "service.engines.llama"}


def load_engine(kind: str, model: str, *, device: str = "cpu", parallel: int = 4, threads: int = 0,
                codec: str = "", flash_attn: str = "auto") -> Engine:
    """Load `model` under engine `kind`, for a pod of codec `codec` (a llama.cpp cache type follows it), with
    llama.cpp's flash attention `flash_attn` (auto, on or off; the hf engine takes auto only)."""
    from cachestore.errors import ConfigError  # noqa: PLC0415

    if kind not in ENGINES:
        raise ConfigError(f"engine {kind!r} is not one of {', '.join(ENGINES)}")
    package = importlib.import_module(ENGINES[kind])
    engine: Engine = package.load(kind, model, device=device, parallel=parallel, threads=threads, codec=codec,
                                  flash_attn=flash_attn)
    return engine
