"""The `hf` engine: a transformers causal LM (models), run one generation at a time (runner, hfcache)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.settings import hub_offline

if TYPE_CHECKING:
    from service.engines.base import Engine

hub_offline()  # before any module of this package imports transformers (huggingface_hub reads it at import)


def load(kind: str, model: str, *, device: str = "cpu", parallel: int = 1, threads: int = 0, codec: str = "",
         flash_attn: str = "auto") -> Engine:
    """The hf engine of `model` on `device`; `parallel`, `threads` and `codec` change nothing here."""
    from cachestore.errors import ConfigError  # noqa: PLC0415

    if flash_attn != "auto":
        raise ConfigError("flash attention is a setting of the llama.cpp engines (llamacpp, llama-server)")
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415

    return HfEngine.load(model, device=device)
