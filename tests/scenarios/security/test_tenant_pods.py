"""Per-tenant quotas through pods: a noisy tenant flooding the cache with long contexts cannot evict a quiet
tenant's conversation; it evicts its own oldest entries, and the namespace stays under its budget."""

from __future__ import annotations

import asyncio
from typing import Any

from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisProcess
from tests.faultkit import QUESTIONS, SYSTEM, chat, metric, pod_client, reply_of, wait_written
from tests.timing import wait_for

KEYS = {"key-quiet": "quiet", "key-noisy": "noisy"}
QUIET = {"authorization": "Bearer key-quiet"}
NOISY = {"authorization": "Bearer key-noisy"}
WORDS = "harbour lantern keeper storm gull rope tide reef signal beacon night fog cliff wave".split()


def long_context(i: int) -> list[dict[str, str]]:
    """A long prompt of its own (no block in common with another's)."""
    text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] + str(i) for j in range(160))
    return [{"role": "system", "content": f"Document {i}: {text}"}, {"role": "user", "content": "Summarise it."}]


async def _usage(url: str) -> Any:
    store = BlockStore(StoreSettings.from_url(url))
    try:
        return await store.usage()
    finally:
        await store.close()


def test_a_noisy_tenant_cannot_evict_a_quiet_tenants_conversation(redis_server: RedisProcess, tiny_model: Any,
                                                                   figures: dict[str, object]) -> None:
    # the tiny model's long context is ~160 KB: the budget holds fewer than three, the quiet tenant talks every third,
    # so the namespace's LRU alone would have evicted its conversation between two of its turns
    budget, quota = 450_000, 200_000
    with pod_client(redis_server.url, tiny_model, api_keys=KEYS, budget_bytes=budget, tenant_quota_bytes=quota,
                    max_value_bytes=100_000, usage_sample_s=0.05,
                    fetch_policy="always") as pod:  # a held context is read, however fast its prefill on a busy machine
        messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        first = chat(pod, messages, headers=QUIET)
        wait_written(pod)
        quiet_held = asyncio.run(_usage(redis_server.url)).by_tenant["quiet"]
        assert 0 < quiet_held < quota  # the quiet tenant's working set fits its quota

        flood = chat(pod, long_context(0), headers=NOISY)
        wait_written(pod)
        per_context = asyncio.run(_usage(redis_server.url)).by_tenant["noisy"]
        assert budget / 3 < per_context < quota
        n = int(3 * budget / per_context) + 2  # three times the namespace budget, far beyond its own quota
        turns = [first]
        most_held = 0
        for i in range(1, n):
            flood = chat(pod, long_context(i), headers=NOISY)
            assert flood.status_code == 200, flood.text
            wait_written(pod)
            if i % 3 == 0:  # the quiet tenant goes on with its conversation meanwhile: every turn hits
                turn = chat(pod, messages, headers=QUIET)
                assert turn.headers["x-kv-cache"] == "hit", i
                assert turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert reply_of(turn) == reply_of(first)
                turns.append(turn)
                wait_written(pod)
            usage = asyncio.run(_usage(redis_server.url))
            assert usage.bytes_held <= budget
            most_held = max(most_held, usage.bytes_held)
            assert usage.by_tenant["noisy"] <= quota + per_context  # its quota, give or take its last write
        assert len(turns) > 3
        usage = asyncio.run(_usage(redis_server.url))
        assert usage.by_tenant["quiet"] >= quiet_held  # nothing of the quiet tenant's was evicted
        assert usage.by_tenant["noisy"] <= quota
        newest = chat(pod, long_context(n - 1), headers=NOISY)  # its newest context is held
        assert newest.headers["x-kv-cache"] == "hit"
        oldest = chat(pod, long_context(0), headers=NOISY)  # its oldest is not: evicted by its own writes
        assert oldest.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert state_evictions(pod) > 0
        wait_written(pod)
        wait_for(lambda: metric(pod, "kvstash_tenant_bytes_held", 'tenant="quiet"') >= quiet_held,
                 "a usage sample showing the quiet tenant's bytes", 10)
        assert metric(pod, "kvstash_tenant_quota_bytes", 'tenant="noisy"') == quota
        assert flood.status_code == 200
        figures.update(budget_bytes=budget, quota_bytes=quota, quiet_held=quiet_held, noisy_contexts=n,
                       noisy_context_bytes=per_context, noisy_written=n * per_context, quiet_turns=len(turns) - 1,
                       quiet_hits=len(turns) - 1, most_bytes_held=most_held, noisy_held_after=usage.by_tenant["noisy"],
                       tenant_evictions=state_evictions(pod))


def state_evictions(pod: Any) -> int:
    return int(pod.app.state.pod.store.stats().tenant_evictions)
