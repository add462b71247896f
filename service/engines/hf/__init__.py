"""The `hf` engine: a transformers causal LM (models), its generations decoded together (runner, batch, hfcache)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.settings import hub_offline

if TYPE_CHECKING:
    from service.engines.base import Engine

hub_offline()  # before any module of this package imports transformers (huggingface_hub reads it at import)

# sequences a pod decodes together unless told: one costs its cache only once it exists, and a request beyond these
# waits for a whole reply to end (docs/engines-codecs.md)
PARALLEL = 8


def load(kind: str, model: str, *, device: str = "cpu", parallel: int = PARALLEL, threads: int = 0, codec: str = "",
         flash_attn: str = "auto") -> Engine:
    """The hf engine of `model` on `device`, decoding up to `parallel` generations together; `threads` and `codec`
    change nothing here."""
    from cachestore.errors import ConfigError  # noqa: PLC0415

    if flash_attn != "auto":
        raise ConfigError("flash attention is a setting of the llama.cpp engines (llamacpp, llama-server)")
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415

    return HfEngine.load(model, device=device, parallel=parallel)
