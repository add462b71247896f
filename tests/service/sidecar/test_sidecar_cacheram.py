"""llama-server's own host-memory prompt cache (`--cache-ram`) beside the sidecar: off unless the arguments after
-- turn it on, and then both caches serve: a slot restored from Redis is used as restored, and what Redis lost
llama-server's cache still has (the sidecar fleets of `kvstash bench fleet`)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import redis

from ops.bench.common import SAMPLE_TEXT
from ops.chatclient import stream_chat
from ops.llamaserver_build import binary_path
from ops.redisproc import RedisProcess
from ops.sidecarproc import SidecarProcess
from service.engines.llama.llamaserverproc import LlamaServerProcess
from service.engines.llama.models import resolve_gguf
from tests.support import settle

pytestmark = pytest.mark.skipif(binary_path() is None, reason="no llama-server built: run `make setup`")


def _cache_ram(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a in ("--cache-ram", "-cram")]


def test_llama_servers_own_cache_stays_off_unless_the_arguments_turn_it_on(tmp_path: Path) -> None:
    model = resolve_gguf("smollm2")
    assert _cache_ram(LlamaServerProcess(model, tmp_path, parallel=1, ctx_per_slot=512).args) == ["0"]
    on = LlamaServerProcess(model, tmp_path, parallel=1, ctx_per_slot=512, extra_args=("--cache-ram", "8192"))
    assert _cache_ram(on.args) == ["8192"]


def _turn(url: str, messages: list[dict[str, str]]) -> int:
    with httpx.Client(timeout=300) as client:
        res = stream_chat(client, url, {"model": "smollm2", "messages": messages, "max_tokens": 8, "temperature": 0})
    assert res.status == 200, res.text
    messages.append({"role": "assistant", "content": res.text})
    settle(url)  # its blocks are in Redis before the next turn
    return res.cached_tokens


def _events(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r'kvstash_sidecar_events_total\{event="(\w+)"\} ([0-9.]+)', text)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restored_slots_and_llama_servers_own_cache_both_serve(redis_server: RedisProcess) -> None:
    """Three conversations through two slots: each second turn finds its slot taken by another conversation and is
    restored from Redis; with Redis emptied, each third turn still finds its history in llama-server's own cache
    (a sidecar with no pod-local tier, so Redis is the only other place)."""
    pod = SidecarProcess("ram", redis_server.url, "smollm2", ("--codec", "int8", "--ctx-per-slot", "2048", "--",
                                                              "--cache-ram", "1024"),
                         parallel=2, threads=1, env={"KVSTASH_LOCAL_TIER_BYTES": "0"})
    try:
        pod.start().wait_ready()
        words = SAMPLE_TEXT.read_text(encoding="utf-8").split()
        chats = [[{"role": "system", "content": f"Conversation {i}. " + " ".join(words[i * 500:i * 500 + 240])},
                  {"role": "user", "content": "Summarise it."}] for i in range(3)]
        for chat in chats:
            _turn(pod.url, chat)
        second = []
        for chat in chats:
            chat.append({"role": "user", "content": "And then?"})
            second.append(_turn(pod.url, chat))
        restored = _events(pod.url)
        redis.Redis.from_url(redis_server.url).flushall()
        third = []
        for chat in chats:
            chat.append({"role": "user", "content": "One more word."})
            third.append(_turn(pod.url, chat))
        after = _events(pod.url)
    finally:
        pod.cleanup()
    assert restored["restores"] >= 1 and min(second) > 200, (restored, second)  # each second turn resumed
    assert after["restores"] == restored["restores"]  # nothing in Redis to restore from
    assert min(third) > 200, third  # llama-server's own cache had every history
    assert after["reuse_misses"] == after["restore_failures"] == 0, after
