"""`kvstash sidecar` in front of real llama-servers serving sliding-window (Gemma 3, gpt-oss) and hybrid (LFM2) models:
turns alternating two sidecars restore the other's blocks and boundary record into a slot that llama-server
reuses (its own `timings` say so) and reply as one llama-server that kept the conversation; a llama-server that
would prefill a restored sliding-window slot again is refused at start-up in one line."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from cachestore.errors import ConfigError
from ops.llamaserver_build import binary_path
from ops.redisproc import RedisProcess
from ops.sidecar_cmd import sidecar_app
from service.engines.llama.llamaserver import LlamaServerEngine
from service.engines.llama.llamaserverproc import LlamaServerProcess
from service.settings import PodSettings
from tests.faultkit import wait_written
from tests.support import server_completion, sidecar_servers
from tests.tinymodels import converter_missing, tiny_gguf

pytestmark = [pytest.mark.skipif(binary_path() is None, reason="no llama-server built: run `make llama-server`"),
              pytest.mark.skipif(converter_missing() is not None, reason=converter_missing() or "")]

N_SWA = 32
CTX = 1024
TEXT = " ".join(f"Note {i}: the tide rises twice a day and the harbour keeper writes it down." for i in range(12))
ASKS = [" What rises?", " Who writes it down?", " How often?", " Where is it written?", " Why?", " Since when?"]


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss", "lfm2"])
def servers(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaServerEngine, LlamaServerEngine, str]]:
    """Two sidecars' llama-servers (spawned as `kvstash sidecar --spawn` spawns them), and a reference llama-server
    with the same settings (`--swa-full` for a sliding-window model) that keeps the conversation in its own slot."""
    with sidecar_servers(tiny_gguf(request.param), tmp_path_factory.mktemp("ref-slots"), 1, CTX) as servers:
        yield servers


def test_turns_alternating_two_sidecars_are_reused_by_llama_server_and_exact(
        servers: tuple[LlamaServerEngine, LlamaServerEngine, str], redis_server: RedisProcess) -> None:
    a, b, reference = servers
    assert a.boundary_records and a.geometry.num_layers == a.layout.full
    settings = PodSettings(engine="llama-server", redis_url=redis_server.url, codec="exact", block_tokens=16,
                           parallel=1, local_tier_bytes=0, fetch_policy="always")
    ref = httpx.Client(base_url=reference, timeout=120)
    try:
        with TestClient(sidecar_app(settings, a)) as side_a, TestClient(sidecar_app(settings, b)) as side_b:
            prompt = a.text_ids(TEXT)
            assert len(prompt) > 4 * N_SWA
            previous = 0
            for turn, ask in enumerate(ASKS):
                side = (side_a, side_b)[turn % 2]
                got, expected = (server_completion(x.post, prompt, return_tokens=True) for x in (side, ref))
                assert got["content"] == expected["content"], f"turn {turn}: the cache changed the reply"
                timings = got["timings"]
                if turn:  # the other sidecar's turn, restored into this llama-server's slot and reused by it
                    assert timings["cache_n"] >= previous, (turn, timings, previous)
                    assert timings["prompt_n"] <= len(prompt) - previous, (turn, timings)
                wait_written(side)
                previous = len(prompt)
                prompt = prompt + [int(t) for t in got["tokens"]] + a.text_ids(ask)
    finally:
        ref.close()


def test_a_llama_server_without_swa_full_is_refused_in_one_line() -> None:
    path = tiny_gguf("gemma3")
    slot_dir = Path(tempfile.mkdtemp(prefix="kvstash-noswa-slots-"))
    proc = LlamaServerProcess(path, slot_dir, parallel=1, ctx_per_slot=CTX, threads=1)
    proc.start()
    try:
        with pytest.raises(ConfigError) as refused:
            LlamaServerEngine(proc.url, slot_dir, str(path))
        message = str(refused.value)
        assert "\n" not in message and "prefills a restored slot of tiny-gemma3.gguf again" in message
        assert message.endswith("start it with --swa-full (`kvstash sidecar --spawn` does)")
    finally:
        proc.stop()
