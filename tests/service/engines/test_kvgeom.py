"""The kvgeom models (service.engines.kvgeom): random weights whose KV cache has the exact shape of an 8B, 32B or 70B
model's. Every geometry's recipe makes that shape in transformers; kvgeom-8b's cache is that shape on the hf engine
and in llama.cpp's state; a chat through each engine (hf, llamacpp, a spawned llama-server) replies, and its next turn
on another pod is a hit; an unknown geometry is refused in one line."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from ops.llamaserver_build import binary_path
from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from ops.sidecarproc import SidecarProcess
from service.engines import GenParams, kvgeom
from service.engines.generation import GenRequest
from service.engines.randommodels import converter_missing
from tests.support import POD_ARGS, cached_tokens, running, settle

MODEL = "kvgeom-8b"
MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is a key-value cache?"}]
SHAPES = {"kvgeom-8b": (32, 8, 128, 128 << 10), "kvgeom-32b": (64, 8, 128, 256 << 10),
          "kvgeom-70b": (80, 8, 128, 320 << 10)}
needs_converter = pytest.mark.skipif(converter_missing() is not None, reason=converter_missing() or "")


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_recipe_has_its_models_kv_shape_in_transformers(name: str) -> None:
    """The config transformers builds from the recipe (weights on the meta device: nothing allocated) projects every
    layer's keys and values to kv_heads x head_dim, and fp16 KV a token is the real model's."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    layers, kv_heads, head_dim, token_bytes = SHAPES[name]
    config = LlamaConfig(vocab_size=64, **kvgeom.spec(name).fields)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    attention = [layer.self_attn for layer in model.model.layers]
    assert len(attention) == layers
    assert {(a.k_proj.out_features, a.v_proj.out_features) for a in attention} == {(kv_heads * head_dim,) * 2}
    assert {a.head_dim for a in attention} == {head_dim}
    assert kvgeom.geometry(name).bytes_per_token() == token_bytes


def test_kvgeom_8b_caches_its_shape_on_the_hf_engine() -> None:
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415

    engine = HfEngine.load(MODEL, parallel=1)
    g = engine.geometry
    assert (g.num_layers, g.kv_heads, g.head_dim, g.max_context) == (32, 8, 128, 8192)
    assert engine.loaded.name == MODEL
    ids = engine.chat_ids(MESSAGES)
    kv = engine.generate(GenRequest(ids, None, GenParams(max_tokens=2))).kv  # [layers, 2, kv_heads, tokens, head_dim]
    assert kv.shape[:3] == (32, 2, 8) and kv.shape[4] == 128 and kv.shape[3] >= len(ids)
    assert kv[:, :, :, :1].to(torch.float16).numel() * 2 == 128 << 10  # one token's fp16 KV


@needs_converter
def test_kvgeom_8b_caches_its_shape_in_llama_cpp() -> None:
    from service.engines.llama.gguf import gguf_geometry  # noqa: PLC0415
    from service.engines.llama.llamacpp import LlamaCppEngine  # noqa: PLC0415

    path = kvgeom.gguf(MODEL)
    assert path.name == "kvgeom-8b.gguf" and path == kvgeom.gguf(MODEL)  # built once, then found
    g = gguf_geometry(path, 8192)
    assert (g.num_layers, g.kv_heads, g.head_dim) == (32, 8, 128)
    engine = LlamaCppEngine.load(MODEL, parallel=1, threads=1)
    try:
        assert engine.name == MODEL and engine.layout.full_attention_only
        # the rows of llama.cpp's own sequence state: f16 K and V of 8 x 128 a token in each of 32 layers
        assert engine.layout.kv_row_bytes == (8 * 128 * 2,) * 32
        assert 2 * sum(engine.layout.kv_row_bytes) == 128 << 10
        fingerprint = engine.fingerprint(16, "exact")  # in every key: another geometry is another fingerprint
        assert (fingerprint.num_layers, fingerprint.kv_heads, fingerprint.head_dim) == (32, 8, 128)
    finally:
        engine.close()


def test_an_unknown_geometry_is_refused_in_one_line_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main  # noqa: PLC0415

    for command in (["serve", "--engine", "hf"], ["sidecar", "--spawn"], ["bench", "resume"]):
        assert main([*command, "--model", "kvgeom-9b"]) == 2, command
        assert capsys.readouterr().err.strip().splitlines() == [
            "kvstash: error: unknown model 'kvgeom-9b': the kvgeom models are kvgeom-8b, kvgeom-32b, kvgeom-70b"]


# -- a chat, then its next turn on another pod ------------------------------------------------------------------------
def _two_turns_on_two_pods(pods: dict[str, Any]) -> None:
    def chat(url: str, messages: list[dict[str, str]]) -> httpx.Response:
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp

    first = chat(pods["a"].url, MESSAGES)
    reply = first.json()["choices"][0]["message"]["content"]
    assert reply and first.headers["x-kv-cache"] == "miss"
    settle(pods["a"].url, 60)
    turn = [*MESSAGES, {"role": "assistant", "content": reply}, {"role": "user", "content": "And why share it?"}]
    second = chat(pods["b"].url, turn)
    assert second.headers["x-kv-cache"] in ("hit", "partial")
    prompt = first.json()["usage"]["prompt_tokens"]
    assert cached_tokens(second) >= (prompt // 16) * 16 > 0


def _pods(kind: type[PodProcess], redis: RedisProcess, engine: str, *args: str, **fields: Any) -> dict[str, Any]:
    """Two pods `a` and `b` of kvgeom-8b in a namespace of their own on the session's Redis."""
    args = (*POD_ARGS, "--namespace", f"kvgeom-{engine}", *args)
    return {name: kind(f"geom-{engine}-{name}", redis.url, MODEL, args, **fields) for name in "ab"}


def test_a_chat_through_the_hf_engine_hits_on_another_pod(shared_redis_server: RedisProcess) -> None:
    with running(_pods(PodProcess, shared_redis_server, "hf")) as pods:
        _two_turns_on_two_pods(pods)


@needs_converter
def test_a_chat_through_the_llamacpp_engine_hits_on_another_pod(shared_redis_server: RedisProcess) -> None:
    engine = ("--engine", "llamacpp", "--parallel", "1", "--threads", "1")
    with running(_pods(PodProcess, shared_redis_server, "llamacpp", *engine)) as pods:
        _two_turns_on_two_pods(pods)


@needs_converter
@pytest.mark.skipif(binary_path() is None, reason="no llama-server built: run `make setup`")
def test_a_chat_through_the_sidecar_hits_on_another_pod(shared_redis_server: RedisProcess) -> None:
    with running(_pods(SidecarProcess, shared_redis_server, "sidecar", "--ctx-per-slot", "1024", parallel=1)) as pods:
        _two_turns_on_two_pods(pods)
