"""Model runtimes behind one seam (service.engines.base): a subpackage per runtime, found by engine name.

`hf` (transformers) lives in service.engines.hf, `llamacpp` (llama-cpp-python) and `llama-server` (a sidecar of a
stock llama-server) in service.engines.llama. Each subpackage has a `load(kind, model, **options)`; adding an engine is
adding a subpackage and its names to `ENGINES`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.engines.base import Engine, KvGeometry, KvLayout
    from service.engines.generation import Generation, GenParams, GenRequest

__all__ = ["ENGINES", "IN_POD", "LLAMACPP_MISSING", "Engine", "GenParams", "GenRequest", "Generation", "KvGeometry",
           "KvLayout", "check_runtime", "default_parallel", "load_engine"]

# engine name -> the subpackage that loads it; only the subpackage asked for is imported (and its runtime with it)
ENGINES = {"hf": "service.engines.hf", "llamacpp": "service.engines.llama", "llama-server": "service.engines.llama"}
# the engines that compute in the pod's own process (`kvstash serve`); the others are a server's SlotServer
IN_POD = ("hf", "llamacpp")
LLAMACPP_MISSING = ("the llamacpp engine needs llama-cpp-python, an optional extra: "
                    "pip install -e '.[llamacpp]' (make setup installs it)")


_LAZY = {"Engine": "service.engines.base", "KvGeometry": "service.engines.base", "KvLayout": "service.engines.base",
         "Generation": "service.engines.generation", "GenParams": "service.engines.generation",
         "GenRequest": "service.engines.generation"}


def __getattr__(name: str) -> Any:
    """The seam's classes, imported when first asked for: the registry above is read without torch (the CLI's
    choices, the settings' check)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_runtime(kind: str) -> None:
    """Refuse, in one line, an engine whose runtime is not installed (llama-cpp-python is an optional extra)."""
    from cachestore.errors import ConfigError  # noqa: PLC0415

    if kind == "llamacpp" and importlib.util.find_spec("llama_cpp") is None:
        raise ConfigError(LLAMACPP_MISSING)


def default_parallel(kind: str) -> int:
    """The sequences engine `kind` decodes together unless told (its package's PARALLEL)."""
    return int(importlib.import_module(ENGINES[kind]).PARALLEL)


def load_engine(kind: str, model: str, *, device: str = "cpu", parallel: int = 0, threads: int = 0,
                codec: str = "", flash_attn: str = "auto") -> Engine:
    """Load `model` under engine `kind`, for a pod of codec `codec` (a llama.cpp cache type follows it), with
    llama.cpp's flash attention `flash_attn` (auto, on or off; the hf engine takes auto only), decoding `parallel`
    sequences together (0: the engine package's PARALLEL)."""
    from cachestore.errors import ConfigError  # noqa: PLC0415

    if kind not in ENGINES:
        raise ConfigError(f"engine {kind!r} is not one of {', '.join(ENGINES)}")
    check_runtime(kind)
    package = importlib.import_module(ENGINES[kind])
    engine: Engine = package.load(kind, model, device=device, parallel=parallel or default_parallel(kind),
                                  threads=threads, codec=codec, flash_attn=flash_attn)
    return engine
