"""Tiny random-weight models of the architectures kvstash must serve, built from transformers' own configs and
converted to GGUF by the pinned llama.cpp's converter; nothing is downloaded.

Each model is a few layers of hidden size 64 with SmolLM2's tokenizer (the one the `tiny-random` model saves) and a
fixed seed, built and converted by service.engines.randommodels (as the kvgeom models are). A build is cached under the
kvstash model cache dir (`service.engines.modelcache.default_cache_dir`) in a folder named by a digest of its config,
the recipe, and the transformers and llama-cpp-python versions, so a changed recipe builds anew and concurrent test
processes build once (`service.engines.modelcache.ensure_built`).

| name        | architecture              | what it stands for                                             |
|-------------|---------------------------|----------------------------------------------------------------|
| gemma3      | Gemma3ForCausalLM         | sliding-window layers interleaved with global ones (iSWA)      |
| gpt-oss     | GptOssForCausalLM         | alternating sliding / full layers, mixture of experts (iSWA)   |
| lfm2        | Lfm2ForCausalLM           | hybrid: short-conv recurrent layers beside attention layers    |
| qwen3-next  | Qwen3NextForCausalLM      | hybrid: gated delta-net layers (conv + recurrent state); HF only|
| llama3-hd128| LlamaForCausalLM          | full attention (Llama 3), head_dim 128, 4 query heads a KV head|
| gemma3-8k   | Gemma3ForCausalLM         | gemma3 with a window of 512 and 8192 positions (benchmarks)    |
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from service.engines.modelcache import default_cache_dir, ensure_built
from service.engines.randommodels import RandomSpec as TinySpec
from service.engines.randommodels import build_key as _build_key
from service.engines.randommodels import convert_gguf, save_hf
from service.engines.randommodels import converter_missing as converter_missing  # the tests' skip reason

RECIPE = "tinymodels-v3"  # bump when a build below changes
SEED = 0


_COMMON = {"hidden_size": 64, "max_position_embeddings": 2048, "initializer_range": 0.2, "tie_word_embeddings": True}

SPECS = {
    spec.name: spec
    for spec in (
        TinySpec("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {
            # every 6th layer global: llama.cpp assumes Gemma 3's pattern (the converter writes no pattern)
            **_COMMON, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 32,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        }),
        TinySpec("gemma3-8k", "Gemma3TextConfig", "Gemma3ForCausalLM", {
            **_COMMON, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 512, "max_position_embeddings": 8192,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        }),
        TinySpec("gpt-oss", "GptOssConfig", "GptOssForCausalLM", {
            **_COMMON, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 32, "num_local_experts": 4,
            "max_position_embeddings": 131072,  # its own: YaRN scales 4096 by 32
            "tie_word_embeddings": False,  # llama.cpp's gpt-oss wants an output.weight
            "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"],
        }),
        TinySpec("lfm2", "Lfm2Config", "Lfm2ForCausalLM", {
            **_COMMON, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "conv_L_cache": 3,
        }),
        TinySpec("qwen3-next", "Qwen3NextConfig", "Qwen3NextForCausalLM", {  # its HF directory only (tiny_hf_dir)
            **_COMMON, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 2, "linear_num_key_heads": 2,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        }),
        TinySpec("llama3-hd128", "LlamaConfig", "LlamaForCausalLM", {
            **_COMMON, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 128, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        }),
    )
}


def gguf_name(name: str) -> str:
    """The file name of tiny model `name`'s GGUF (the llamacpp engine serves it by its stem)."""
    return f"tiny-{name}.gguf"


def build_key(spec: TinySpec) -> str:
    """A digest of what the build depends on: the spec, the recipe, the versions of transformers and llama.cpp."""
    return _build_key(spec, RECIPE, SEED)


def _save_hf(spec: TinySpec, tokenizer_dir: Path, out: Path) -> None:
    save_hf(spec, tokenizer_dir, out, SEED)


def _build(spec: TinySpec, tokenizer_dir: Path, out: Path) -> None:
    _save_hf(spec, tokenizer_dir, out)
    convert_gguf(out, out / gguf_name(spec.name), f"kvstash-tiny-{spec.name}")


def tiny_model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The transformers directory (config, safetensors, tokenizer) tiny model `name`'s GGUF was converted from."""
    return tiny_gguf(name, cache_dir).parent


def tiny_hf_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The transformers directory of tiny model `name` alone (no GGUF, no converter needed): the same weights as
    `tiny_model_dir`'s, for the hf engine."""
    from service.engines.hf.models import TINY_RANDOM, resolve_model_dir  # noqa: PLC0415

    spec = SPECS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer_dir = resolve_model_dir(TINY_RANDOM, root)
    key = build_key(spec)
    build: Callable[[Path], None] = lambda out: _save_hf(spec, tokenizer_dir, out)  # noqa: E731
    return ensure_built(root / "tiny-hf" / f"{name}-{key}", build, f"{RECIPE}/hf/{key}")


def tiny_gguf(name: str, cache_dir: Path | None = None) -> Path:
    """The GGUF of the tiny model `name` (a key of SPECS), built on first use and cached."""
    from service.engines.hf.models import TINY_RANDOM, resolve_model_dir  # noqa: PLC0415

    spec = SPECS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokenizer_dir = resolve_model_dir(TINY_RANDOM, root)
    key = build_key(spec)
    build: Callable[[Path], None] = lambda out: _build(spec, tokenizer_dir, out)  # noqa: E731
    target = ensure_built(root / "tiny-gguf" / f"{name}-{key}", build, f"{RECIPE}/{key}")
    return target / gguf_name(name)
