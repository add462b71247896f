"""`int4` and `int2` by name: the recommended codec for the served model, one plan per model shared through Redis."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from cachestore.codec import CodecSpec
from cachestore.codec.names import KNOWN, CodecPlan, make_plan
from cachestore.codec.rope import HALVES, Rope
from cachestore.codecplans import Agreed, agree
from cachestore.errors import ConfigError
from cachestore.keys import KeySpace
from cachestore.redisclient import make_client
from cachestore.settings import StoreSettings
from ops.redisproc import RedisProcess
from tests.support import HISTORY, kv_sample, wait_written
from tests.support import make_client as pod_client

ROPE = Rope(HALVES, tuple(10000.0 ** (-2 * i / 64) for i in range(32)))
SMOLLM2_GGUF = next(iter(KNOWN))


def test_names_follow_the_rope_declaration_and_the_models_layers() -> None:
    """Where the engine declares RoPE, int4 and int2 store keys without it (/unrope, /kbits); where it declares none,
    the codecs that need none. A model of 20 layers gets 4 of its own raised, SmolLM2 its published tables."""
    kv = kv_sample((20, 2, 1, 96, 64), torch.float32)
    with_rope, without = make_plan(kv, ROPE, "b2:other"), make_plan(kv, None, "b2:other")
    assert "/kbits/s8/unrope/" in with_rope.spec("int4") and "/kbits/symv/s8/unrope/" in with_rope.spec("int2")
    assert "unrope" not in without.spec("int4") + without.spec("int2")
    assert "/outk/symv/s8/k3=" in without.spec("int2")
    for plan in (with_rope, without):
        for name in ("int4", "int2"):
            spec = CodecSpec.parse(plan.spec(name))
            spec.check_model(20, 64)
            assert spec.mode == name and len(spec.hi.up_values) == (4 if plan.rope or name == "int4" else 2)
    smol = make_plan(kv_sample((30, 2, 1, 64, 64), torch.float32), ROPE, f"llamacpp-x/{SMOLLM2_GGUF}")
    assert smol.specs == {"int4": "int4+zstd:3/g64/kbits/s8/unrope/v5=11.15.17.18.23.25/recent=int8",
                          "int2": "int2+zstd:16/g64/rotv/clip/kbits/symv/s8/unrope/v3=0.1.18.20.23.24/recent=int4"}
    assert smol.source == "published: SmolLM2-135M-Instruct"
    assert make_plan(kv_sample((30, 2, 1, 64, 64), torch.float32), None, SMOLLM2_GGUF).spec("int2") == (
        "int2+zstd:16/g64/rotv/clip/outk/symv/s8/k3=1.2.15.17.20.23/v3=0.1.20/recent=int4")


def _plan(values: int) -> CodecPlan:
    return CodecPlan(4, True, {"int4": f"int4+zstd/outk/symv/s8/v5={values}/recent=int8",
                               "int2": f"int2+zstd:16/rotv/clip/outk/symv/s8/v3={values}/recent=int4"},
                      "test", f"pod{values}")


def _fits(plan: CodecPlan) -> None:
    plan.check(4, 16, ROPE)


def test_two_pods_starting_together_agree_on_one_plan(redis_server: RedisProcess) -> None:
    """Two pods (threads, each its own event loop and connection) find no plan, both make one (each a different one,
    both made before either is stored) and both serve the one stored first."""
    both_made = threading.Barrier(2, timeout=30)
    results: dict[int, Agreed] = {}
    keys = KeySpace("kvstash", 16)

    def pod(i: int) -> None:
        async def make() -> CodecPlan:
            await asyncio.to_thread(both_made.wait)  # both have looked and found none
            return _plan(i)

        async def run() -> Agreed:
            client = make_client(StoreSettings.from_url(redis_server.url))
            try:
                return await agree(client, keys, "00aa11bb22cc33dd", make, _fits)
            finally:
                await client.aclose()

        results[i] = asyncio.run(run())

    threads = [threading.Thread(target=pod, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.how for r in results.values()) == ["stored", "written"]
    assert results[1].plan == results[2].plan
    stored = redis_server.client().get(keys.codec_plan("00aa11bb22cc33dd"))
    assert CodecPlan.from_json(stored) == results[1].plan


def test_a_plan_for_another_model_is_not_taken_nor_replaced(redis_server: RedisProcess) -> None:
    keys = KeySpace("kvstash", 16)
    other = CodecPlan(30, True, _plan(3).specs, "test", "elsewhere")
    redis_server.client().set(keys.codec_plan("00aa11bb22cc33dd"), other.to_json())

    async def run() -> Agreed:
        client = make_client(StoreSettings.from_url(redis_server.url))
        try:
            async def make() -> CodecPlan:
                return _plan(2)
            return await agree(client, keys, "00aa11bb22cc33dd", make, _fits)
        finally:
            await client.aclose()

    agreed = asyncio.run(run())
    assert agreed.plan == _plan(2) and agreed.how.startswith("local: stored plan unusable")
    assert CodecPlan.from_json(redis_server.client().get(keys.codec_plan("00aa11bb22cc33dd"))) == other
    with pytest.raises(ConfigError):
        CodecPlan.from_json(b'{"version": 1, "layers": 4}')


def test_pods_serve_int4_as_the_stored_plan_and_admin_stats_shows_it(redis_server: RedisProcess, tiny_model: Any,
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The first pod on the model makes and stores the plan; the next reads it; both write under the same spec, and
    `kvstash admin stats` names it; `admin export --codec int4` finds the blocks the pods wrote under it."""
    from ops.cli import main  # noqa: PLC0415

    names, model_keys = [], []
    for _ in range(2):
        with pod_client(redis_server, tiny_model, codec="int4") as client:
            names.append(client.app.state.pod.pipeline.codecs.main.spec.name())  # type: ignore[attr-defined]
            model_keys.append(client.app.state.pod.pipeline.model_key)  # type: ignore[attr-defined]
            if len(names) == 1:
                assert client.post("/v1/sessions", json={"session_id": "s", "messages": HISTORY}).status_code == 201
                turn = client.post("/v1/sessions/s/messages", json={"content": "And then?", "max_tokens": 4})
                assert turn.status_code == 200, turn.text
                wait_written(client)
    assert names[0] == names[1] and names[0].startswith("int4+zstd:3/g64/outk/symv/s8/v5=")
    assert "/recent=int8" in names[0]
    out = tmp_path / "s.json"
    assert main(["admin", "--redis-url", redis_server.url, "export", "s", str(out), "--model", "tiny-random",
                 "--codec", "int4", "--block-tokens", "16"]) == 0
    printed = capsys.readouterr().out
    assert "no longer in Redis" not in printed and json.loads(out.read_bytes())["blocks"], printed
    assert main(["admin", "stats", "--redis-url", redis_server.url, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["codec_plans"]
    assert [plan["specs"]["int4"] for plan in plans.values()] == [names[0]]
    assert main(["admin", "stats", "--redis-url", redis_server.url]) == 0
    assert f"int4 = {names[0]}" in capsys.readouterr().out
    # another plan in the namespace (the layers of another calibration): its pods write under other keys
    (key,) = redis_server.client().keys("kvstash:plan:*")
    stored = CodecPlan.from_json(redis_server.client().get(key))
    other = CodecPlan(2, True, {**stored.specs, "int4": "int4+zstd/outk/symv/s8/v5=0/recent=int8"}, "test")
    assert other.spec("int4") != names[0]
    redis_server.client().set(key, other.to_json())
    with pod_client(redis_server, tiny_model, codec="int4") as client:
        pipeline = client.app.state.pod.pipeline  # type: ignore[attr-defined]
        assert pipeline.codecs.main.spec.name() == other.spec("int4") and pipeline.model_key != model_keys[0]
    assert model_keys[0] == model_keys[1]


def test_a_spec_naming_a_layer_the_model_lacks_is_refused_in_one_line() -> None:
    """`v5=40` on the 2-layer test model: `kvstash serve` exits at start with one line, before it serves."""
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "tiny-random", "--codec",
                           "int4+zstd/kbits/s8/v5=40", "--no-cache", "--port", "1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstash: error: codec int4+zstd:3/g64/kbits/s8/v5=40") and "layer 40" in last
    assert "layers 0-1" in last
