"""The kvgeom models: random-weight Llamas whose KV cache has the exact shape of a real model's, for measuring
kvstash at the sizes users run, with compute small enough for a CPU.

| name       | stands for         | layers | KV heads | head_dim | fp16 KV a token |
|------------|--------------------|--------|----------|----------|-----------------|
| kvgeom-8b  | Llama-3.1-8B class | 32     | 8        | 128      | 128 KiB         |
| kvgeom-32b | 32B class          | 64     | 8        | 128      | 256 KiB         |
| kvgeom-70b | Llama-3.1-70B class| 80     | 8        | 128      | 320 KiB         |

Everything else is narrow: hidden size 256, one query head a KV head (8 x 128 = 1024 wide attention, as the cache
needs), an MLP of 512, SmolLM2's tokenizer and chat template, 8,192 positions, RoPE theta 500,000. The weights are
random (a fixed seed): replies are fluent-looking nonsense, the same on every machine. Built on first use, nothing
downloaded, into the model cache dir (`service.engines.modelcache.default_cache_dir`): `kvgeom-hf/<name>-<key>/`
(config + float16 safetensors, for the hf engine) and `kvgeom-gguf/<name>-<key>/<name>.gguf` (converted by the pinned
llama.cpp's converter, for the llamacpp engine and llama-server), where <key> digests the recipe and versions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cachestore.errors import ConfigError
from service.engines import randommodels
from service.engines.ggufpath import smollm2_gguf
from service.engines.modelcache import default_cache_dir, ensure_built

PREFIX = "kvgeom-"
RECIPE = "kvgeom-v1"  # bump when a build below changes
SEED = 0
HIDDEN = 256
INTERMEDIATE = 512
CONTEXT = 8192


@dataclass(frozen=True)
class Geometry:
    """The shape of one model's KV cache."""

    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, element_bytes: int = 2) -> int:
        """KV bytes one token takes: K and V of every layer, at `element_bytes` a value (2: fp16/bf16)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * element_bytes


GEOMETRIES = {
    "kvgeom-8b": Geometry(32, 8, 128),
    "kvgeom-32b": Geometry(64, 8, 128),
    "kvgeom-70b": Geometry(80, 8, 128),
}


def is_kvgeom(name: str) -> bool:
    """Whether `name` asks for a kvgeom model (a known one or not: an unknown one is refused by `geometry`)."""
    return name.startswith(PREFIX)


def geometry(name: str) -> Geometry:
    """The geometry of kvgeom model `name`; a ConfigError naming the known ones for any other name."""
    if name not in GEOMETRIES:
        raise ConfigError(f"unknown model {name!r}: the kvgeom models are {', '.join(GEOMETRIES)}")
    return GEOMETRIES[name]


def spec(name: str) -> randommodels.RandomSpec:
    """The transformers recipe of kvgeom model `name`."""
    shape = geometry(name)
    return randommodels.RandomSpec(name, "LlamaConfig", "LlamaForCausalLM", {
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.kv_heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "max_position_embeddings": CONTEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "initializer_range": 0.2,  # wide logit gaps: greedy picks are far from ties, on every engine alike
        "tie_word_embeddings": True,
    })


def _save_hf(name: str, out: Path) -> None:
    from transformers import AutoTokenizer  # noqa: PLC0415

    gguf = smollm2_gguf()  # SmolLM2's tokenizer and chat template, read from the GGUF kvstash ships
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    randommodels.save_hf(spec(name), tokenizer, out, SEED, half=True)


def hf_dir(name: str, cache_dir: Path | None = None) -> Path:
    """The transformers directory of kvgeom model `name` (for the hf engine), built on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = randommodels.build_key(spec(name), RECIPE, SEED, gguf=False)
    return ensure_built(root / "kvgeom-hf" / f"{name}-{key}", lambda out: _save_hf(name, out), f"{RECIPE}/hf/{key}")


def gguf(name: str, cache_dir: Path | None = None) -> Path:
    """The GGUF of kvgeom model `name` (for llama.cpp), converted from `hf_dir` on first use."""
    source = hf_dir(name, cache_dir)  # refuses an unknown name before anything else
    missing = randommodels.converter_missing()
    if missing:
        raise ConfigError(f"cannot build {name}'s GGUF: {missing}")
    key = randommodels.build_key(spec(name), RECIPE, SEED)

    def build(out: Path) -> None:
        randommodels.convert_gguf(source, out / f"{name}.gguf", f"kvstash-{name}")

    target = ensure_built(source.parent.parent / "kvgeom-gguf" / f"{name}-{key}", build, f"{RECIPE}/gguf/{key}")
    return target / f"{name}.gguf"
