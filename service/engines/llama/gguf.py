"""GGUF models in llama.cpp: a GGUF's digest, what its header says of its layers, the fingerprint
both llama.cpp engines name their blocks by, and llama.cpp's flash attention setting."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from cachestore.codec.rope import ADJACENT, HALVES, Rope
from cachestore.errors import CodecError, ConfigError
from cachestore.hashing import ModelFingerprint
from service.engines.base import KvGeometry
from service.engines.llama import ggufmeta

# llama.cpp's flash attention, by the setting's name (KVSTASH_FLASH_ATTN): llama_context_params.flash_attn_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def check_flash_attn(flash_attn: str, kv_type: str = "f16") -> None:
    """A ConfigError unless `flash_attn` is one of FLASH_ATTN's names, and "off" is asked of an F16 cache only."""
    if flash_attn not in FLASH_ATTN:
        raise ConfigError(f"flash attention must be one of {', '.join(FLASH_ATTN)}, got {flash_attn!r}")
    if flash_attn == "off" and kv_type != "f16":
        raise ConfigError(f"a {kv_type} KV cache (codec q8) needs llama.cpp's flash attention: "
                          "run it with flash attention auto or on")


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


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvstash-gguf")
    with path.open("rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return "b2:" + h.hexdigest()


_LAYER_KEYS = ("block_count", "attention.head_count", "attention.head_count_kv", "attention.key_length",
               "embedding_length", "attention.sliding_window", "attention.sliding_window_pattern")


def gguf_facts(path: Path) -> dict[str, Any]:
    """What the GGUF's header says of its layers (what llama-server loaded), by key without the architecture."""
    arch = str(ggufmeta.read_meta(path, ["general.architecture"]).get("general.architecture", ""))
    found = ggufmeta.read_meta(path, [f"{arch}.{key}" for key in _LAYER_KEYS])
    return {"arch": arch, **{key: found.get(f"{arch}.{key}") for key in _LAYER_KEYS}}


def _most(value: Any) -> int:
    """A per-layer list's largest entry (a hybrid's KV heads: 0 in its recurrent layers), or the value itself."""
    return int(max(value) if isinstance(value, list) else value or 0)


def gguf_geometry(path: Path, max_context: int) -> KvGeometry:
    """Layers, KV heads and head size from the GGUF's metadata (what llama-server loaded)."""
    facts = gguf_facts(path)
    heads = _most(facts["attention.head_count"])
    kv_heads = _most(facts["attention.head_count_kv"]) or heads
    head_dim = int(facts["attention.key_length"] or _most(facts["embedding_length"]) // heads)
    return KvGeometry(int(facts["block_count"]), kv_heads, head_dim, np.dtype(np.float16), max_context)


# How llama.cpp pairs the channels its RoPE turns, by architecture (llama.cpp's llama_model_rope_type): LLAMA_ROPE_TYPE
# NORM turns channels 2i and 2i + 1 (the converter permuted Q and K to match), NEOX turns i with i + head_dim / 2.
# Architectures not listed declare no RoPE: a codec with /unrope is refused for them.
ROPE_PAIRING = {"llama": ADJACENT, "qwen2": HALVES, "qwen3": HALVES}


def gguf_rope(path: Path, head_dim: int) -> Rope | None:
    """The RoPE llama.cpp gives this model's cached keys, from its GGUF: a listed architecture, the whole head turned
    (`rope.dimension_count`), no frequency scaling; else None."""
    arch = str(ggufmeta.read_meta(path, ["general.architecture"]).get("general.architecture", ""))
    keys = [f"{arch}.rope.{key}" for key in ("freq_base", "dimension_count", "scaling.type", "scaling.factor")]
    base, dims, scaling, factor = (ggufmeta.read_meta(path, keys).get(key) for key in keys)
    if arch not in ROPE_PAIRING or (dims is not None and int(dims) != head_dim) or head_dim % 2:  # type: ignore[arg-type]
        return None
    if scaling not in (None, "none") or factor not in (None, 0, 0.0, 1, 1.0):
        return None
    theta = float(base) if base is not None else 10000.0  # type: ignore[arg-type]
    try:
        return Rope(ROPE_PAIRING[arch], tuple(theta ** (-2 * i / head_dim) for i in range(head_dim // 2)))
    except CodecError:
        return None

