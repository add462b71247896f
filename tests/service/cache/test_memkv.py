"""The pod-local in-memory KV cache (the sticky-sessions baseline): the class alone, then real tiny-model pods
running `kvstash serve --no-cache --memory-kv-bytes N`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from cachestore.errors import ConfigError
from ops.chatclient import stream_chat
from ops.pods import PodProcess
from service.cache.memkv import MemoryKV
from service.engines.generation import GenRequest
from service.settings import PodSettings, settings_from_env
from tests.support import running

SALT = b"default"


def _kv(tokens: int, fill: float = 1.0) -> torch.Tensor:
    return torch.full((2, 2, 2, tokens, 4), fill)  # [layers, 2, kv_heads, tokens, head_dim]: 128 bytes a token


def test_longest_prefix_wins_and_says_hit_or_partial() -> None:
    mem = MemoryKV(1 << 20)
    assert mem.put(SALT, [1, 2, 3, 4], _kv(4, 1.0)) and mem.put(SALT, [1, 2, 7, 8, 9], _kv(5, 2.0))
    found = mem.find(SALT, [1, 2, 3, 4, 5, 6])  # continues the first sequence whole
    assert found is not None and (found.tokens, found.status) == (4, "hit") and float(found.kv[0, 0, 0, 0, 0]) == 1.0
    found = mem.find(SALT, [1, 2, 7, 5])  # shares 3 tokens with the second, 2 with the first
    assert found is not None and (found.tokens, found.status) == (3, "partial")
    assert float(found.kv[0, 0, 0, 0, 0]) == 2.0
    assert mem.find(SALT, [9, 1, 2]) is None  # nothing starts with 9
    assert mem.find(b"other-tenant", [1, 2, 3, 4, 5]) is None  # entries are scoped by the tenant's salt


def test_a_continuation_replaces_what_it_continues() -> None:
    mem = MemoryKV(1 << 20)
    mem.put(SALT, [1, 2, 3], _kv(3))
    assert mem.put(SALT, [1, 2, 3, 4, 5], _kv(5))  # the next turn of the same conversation
    assert len(mem) == 1 and mem.bytes_held == 5 * 128
    assert not mem.put(SALT, [1, 2, 3, 4], _kv(4))  # already held inside the longer one
    assert len(mem) == 1 and mem.bytes_held == 5 * 128
    with pytest.raises(ValueError):
        mem.put(SALT, [1, 2], _kv(3))  # kv that does not cover the ids


def test_byte_bound_evicts_least_recently_used() -> None:
    mem = MemoryKV(25 * 128)  # room for two 10-token sequences, not three
    mem.put(SALT, list(range(100, 110)), _kv(10))
    mem.put(SALT, list(range(200, 210)), _kv(10))
    assert mem.find(SALT, list(range(100, 111))) is not None  # touches the first: the second is now the oldest
    mem.put(SALT, list(range(300, 310)), _kv(10))
    assert mem.bytes_held == 20 * 128 <= mem.max_bytes and len(mem) == 2 and mem.evictions == 1
    assert mem.find(SALT, list(range(200, 211))) is None
    assert mem.find(SALT, list(range(100, 111))) is not None and mem.find(SALT, list(range(300, 311))) is not None
    assert not mem.put(SALT, list(range(400, 426)), _kv(26))  # larger than the whole budget: not kept
    assert len(mem) == 2


def test_reply_ids_are_remembered_only_when_they_decode_to_the_text() -> None:
    mem = MemoryKV(1 << 20)
    mem.remember_reply(SALT, "hi there", [5, 6], lambda ids: "hi there")
    mem.remember_reply(SALT, "edited", [7], lambda ids: "not the text")
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hi there"},
                {"role": "assistant", "content": "edited"}]
    assert mem.known_replies(SALT, messages) == {1: [5, 6]}
    assert mem.known_replies(b"other-tenant", messages) == {}


def test_settings_need_the_redis_cache_off() -> None:
    with pytest.raises(ConfigError):
        PodSettings(memory_kv_bytes=1 << 20)  # the Redis cache is on by default: one or the other
    assert PodSettings(memory_kv_bytes=1 << 20, cache_enabled=False).memory_kv_bytes == 1 << 20
    env = settings_from_env({"KVSTASH_MEMORY_KV_BYTES": "4096", "KVSTASH_NO_CACHE": "1"})
    assert env.memory_kv_bytes == 4096 and not env.cache_enabled


# -- real pods ---------------------------------------------------------------------------------------------
PROMPT_A = list(range(1000, 1100))  # 100 token ids: with max_tokens 1 the pod keeps exactly these
PROMPT_B = list(range(2000, 2100))


def _memory_pod(name: str, max_bytes: int) -> PodProcess:
    return PodProcess(name, "redis://127.0.0.1:1/0", "tiny-random", ("--memory-kv-bytes", str(max_bytes)),
                      no_cache=True)  # no Redis: the URL points nowhere and is never used


def _complete(url: str, ids: list[int]) -> httpx.Response:
    body = {"model": "tiny-random", "prompt": ids, "max_tokens": 1, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def per_token(tiny_model) -> int:  # type: ignore[no-untyped-def]
    """KV bytes of one token of the tiny model, as its pods keep them."""
    m = tiny_model
    return int(m.num_layers * 2 * m.kv_heads * m.head_dim * torch.finfo(m.dtype).bits // 8)


@pytest.fixture(scope="module")
def pods(per_token: int) -> Iterator[dict[str, PodProcess]]:
    with running({
        "mem": _memory_pod("pod-mem", 64 << 20),
        "other": _memory_pod("pod-other", 64 << 20),
        "small": _memory_pod("pod-small", 150 * per_token),  # one 100-token sequence fits, two do not
        "plain": PodProcess("pod-plain", "redis://127.0.0.1:1/0", "tiny-random", (), no_cache=True),
    }) as procs:
        yield procs


def test_second_turn_hits_on_the_same_pod_and_replies_as_no_cache(pods: dict[str, PodProcess]) -> None:
    mem, plain = pods["mem"].url, pods["plain"].url
    messages = [{"role": "system", "content": "Notes: the quick brown fox jumps over the lazy dog. " * 6},
                {"role": "user", "content": "What jumps?"}]
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}
    with httpx.Client(timeout=60) as client:
        first = stream_chat(client, mem, body)
        assert first.status == 200 and first.cache == "miss" and first.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
        second = stream_chat(client, mem, body)
        elsewhere = stream_chat(client, pods["other"].url, body)  # pod-local: another pod has none of it
    assert second.cache == "hit"
    assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1  # all the first turn fed
    assert second.prompt_token_ids is not None
    # the same ids through a pod with no cache at all: the same reply
    reference = httpx.post(plain + "/v1/completions", timeout=60, json={
        "model": "tiny-random", "prompt": second.prompt_token_ids, "max_tokens": 12, "temperature": 0})
    assert reference.headers["x-kv-cache"] == "bypass"
    assert second.text == reference.json()["choices"][0]["text"] and second.completion_tokens > 1
    assert elsewhere.status == 200 and elsewhere.cache == "miss" and elsewhere.cached_tokens == 0
    assert _metric(mem, 'kvstash_cache_lookups_total{result="hit"}') == 1
    assert _metric(mem, 'kvstash_prompt_tokens_total{source="cached"}') == second.cached_tokens
    assert _metric(mem, "kvstash_cache_bytes_held") > 0 and _metric(mem, "kvstash_cache_entries") == 1


def test_memory_pod_evicts_beyond_its_byte_bound(pods: dict[str, PodProcess], per_token: int) -> None:
    small = pods["small"].url
    assert _complete(small, PROMPT_A).headers["x-kv-cache"] == "miss"
    assert _metric(small, "kvstash_cache_bytes_held") == 100 * per_token
    hit = _complete(small, [*PROMPT_A, 5])
    assert (hit.headers["x-kv-cache"], hit.json()["usage"]["prompt_tokens_details"]["cached_tokens"]) == ("hit", 100)
    assert _complete(small, PROMPT_B).headers["x-kv-cache"] == "miss"  # B joins; A (least recent) must go
    assert _metric(small, "kvstash_cache_bytes_held") == 100 * per_token  # B alone
    assert _metric(small, "kvstash_cache_budget_bytes") == 150 * per_token
    assert _metric(small, "kvstash_cache_entries") == 1
    again = _complete(small, [*PROMPT_A, 6])
    assert again.headers["x-kv-cache"] == "miss", "A was kept beyond the byte bound"


def test_a_hit_never_changes_what_the_pod_keeps(pods: dict[str, PodProcess]) -> None:
    """A prompt that reuses only the first half of a kept sequence: the engine appends its new tokens right after
    that half. Were it handed the kept tensor itself, it would overwrite the second half in place."""
    mem, plain = pods["mem"].url, pods["plain"].url
    kept = list(range(3000, 3100))

    def text(url: str, ids: list[int]) -> tuple[str, str]:
        body = {"model": "tiny-random", "prompt": ids, "max_tokens": 8, "temperature": 0}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
        return resp.json()["choices"][0]["text"], resp.headers["x-kv-cache"]

    assert text(mem, kept)[1] == "miss"
    assert text(mem, [*kept[:50], 7, 8])[1] == "partial"  # 50 of the kept 100 reused, 9 tokens appended after them
    again, status = text(mem, [*kept, 9])
    assert status == "hit" and again == text(plain, [*kept, 9])[0]


def test_llamacpp_memory_pod_hits_and_replies_as_llamacpp_keeping_the_kv() -> None:
    """The same cache with the llama.cpp engine: the second turn reuses everything the first fed, and replies as
    one llama.cpp that kept the first turn's KV and reused the same tokens."""
    from service.engines import GenParams  # noqa: PLC0415 - llama.cpp loads only for this test
    from service.engines.llama.llamacpp import LlamaCppEngine  # noqa: PLC0415

    pod = PodProcess("llama-mem", "redis://127.0.0.1:1/0", "smollm2", (
        "--engine", "llamacpp", "--parallel", "2", "--threads", "1", "--memory-kv-bytes", str(256 << 20)),
        no_cache=True)
    messages = [{"role": "system", "content": "You are a concise science tutor."},
                {"role": "user", "content": "What is photosynthesis?"}]

    def chat() -> httpx.Response:
        body = {"model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0,
                "return_token_ids": True}
        resp = httpx.post(pod.url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp

    reference = LlamaCppEngine.load("smollm2", parallel=1, threads=1)
    try:
        with running({"mem": pod}):
            first = chat()
            messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Where in the cell does it happen?"}]
            second = chat()
        kept = reference.generate(GenRequest(first.json()["prompt_token_ids"], None, GenParams(max_tokens=24)))
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first.headers["x-kv-cache"] == "miss" and second.headers["x-kv-cache"] == "hit"
        assert cached == len(kept.seq_ids) > 0
        expected = reference.generate(GenRequest(second.json()["prompt_token_ids"], kept.kv[:, :, :, :cached],
                                      GenParams(max_tokens=24)))
        assert second.json()["choices"][0]["message"]["content"] == expected.text
    finally:
        reference.close()
