"""Fetch or recompute: the plan's arithmetic, and pods behind a throttled link that prefill instead of waiting."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from cachestore.errors import ConfigError
from ops.redisproc import RedisProcess
from service.cache.fetchplan import MIN_LINK_SAMPLES, RECOMPUTE_MARGIN, REPROBE_S, FetchPlanner
from service.settings import PodSettings, settings_from_env
from tests.faultkit import (
    QUESTIONS,
    SYSTEM,
    chat,
    metric,
    pod_client,
    reference_reply,
    reply_of,
    uncached_pod,
    wait_written,
)
from tests.linkproxy import ThrottledLink
from tests.timing import ManualClock

BLOCK = 16  # the test pods' block_tokens
SLOW_LINK_BYTES_S = 64_000  # a tiny-random block is 8 KB: ~125 ms to read, against about a millisecond to prefill


def test_the_plan_reads_all_a_prefix_or_nothing_as_the_estimates_say() -> None:
    clock = ManualClock(1000.0)
    planner = FetchPlanner("auto", BLOCK, budget_s=1.0, clock=clock)
    assert planner.plan(10, 8000).decision == "probe" and planner.plan(10, 8000).blocks == 10  # nothing measured
    planner.observe_prefill(BLOCK - 1, 0.001)  # under a block: tells too little
    assert planner.prefill_tokens_s is None
    planner.observe_prefill(1600, 1.0)  # 1,600 tokens/s: a block in 10 ms
    for _ in range(MIN_LINK_SAMPLES - 1):  # reads at 400 KB/s (a block in 20 ms): too few to stop reading yet
        planner.observe_fetch(40_000, 10, 0.1)
        assert planner.plan(10, 8000).decision == "probe"
    planner.observe_fetch(40_000, 10, 0.2)  # and a slower one: the estimate is the best recent read
    assert planner.link_bytes_s == 400_000
    plan = planner.plan(10, 8000)
    assert (plan.blocks, plan.decision) == (0, "recompute") and plan.fetch_s == pytest.approx(2 * plan.recompute_s)
    tie = FetchPlanner("auto", BLOCK, budget_s=1.0, link_bytes_s=800_000, prefill_tokens_s=1600)
    assert tie.plan(10, 8000).decision == "fetch"  # a block in 10 ms either way: a tie reads (it spares the cores)
    clock.now += REPROBE_S  # a measured link found too slow is read again once in a while
    assert planner.plan(10, 8000).decision == "probe"
    planner.observe_fetch(800_000, 10, 0.1)  # it recovered: 8 MB/s, a block in 1 ms
    assert planner.link_bytes_s == 8_000_000
    assert (planner.plan(10, 8000).blocks, planner.plan(10, 8000).decision) == (10, "fetch")
    # a read that would overrun the budget is cut to the prefix that fits 80% of it (0.8 s / 1 ms a block), once
    # reads of its size were measured
    assert planner.plan(1000, 8000).decision == "probe"
    for _ in range(MIN_LINK_SAMPLES):
        planner.observe_fetch(4_000_000, 500, 0.5)
    fits = int(0.8 * 1.0 / (8000 / 8_000_000))
    assert 790 < fits < 810 and (planner.plan(1000, 8000).blocks, planner.plan(1000, 8000).decision) == (
        fits, "shortened")
    assert planner.plan(0, 8000).blocks == 0
    sized = FetchPlanner("auto", BLOCK, budget_s=1.0, link_bytes_s=1e6, prefill_tokens_s=1600, clock=clock)
    assert sized.plan(4).decision == "probe"  # a compressed codec: block size unknown until a read is measured
    sized.observe_fetch(80_000, 4, 1.0)  # 20 KB a block: 20 ms at the configured 1 MB/s, not the measured one
    assert sized.link_bytes_s == 1e6 and sized.plan(4).decision == "recompute"
    clock.now += 10 * REPROBE_S  # a configured link is never probed again
    assert sized.plan(4).decision == "recompute"


def test_a_fresh_pod_reads_a_long_hit_after_small_reads() -> None:
    """A fresh pod's first hits are often the shared system prompt's block or two: reads that measure round trips
    more than the link. Extrapolated to a long history they make its read look dearer than prefilling it; the pod
    reads it anyway (a probe, measured at that size) and recomputes only once reads of that size are slow too."""
    clock = ManualClock(1000.0)
    planner = FetchPlanner("auto", BLOCK, budget_s=2.0, clock=clock)
    planner.observe_prefill(1600, 1.0)  # its first prompt, a miss: 1,600 tokens/s, a block in 10 ms
    for _ in range(MIN_LINK_SAMPLES):  # one 8 KB block in 20 ms each: 400 KB/s, mostly the round trip
        planner.observe_fetch(8000, 1, 0.02)
    assert planner.plan(1, 8000).decision == "recompute"  # at its own size the estimate holds: 20 ms against 10
    long = planner.plan(100, 8000)  # the same rate says 2 s to read 100 blocks, 1 s to prefill them
    assert (long.blocks, long.decision) == (100, "probe") and long.fetch_s > RECOMPUTE_MARGIN * long.recompute_s
    for _ in range(MIN_LINK_SAMPLES - 1):  # the long reads measured: the link is fast (8 MB/s)
        planner.observe_fetch(800_000, 100, 0.1)
    assert (planner.plan(100, 8000).blocks, planner.plan(100, 8000).decision) == (100, "fetch")
    slow = FetchPlanner("auto", BLOCK, budget_s=2.0, clock=clock)  # where long reads really are slow
    slow.observe_prefill(1600, 1.0)
    for _ in range(MIN_LINK_SAMPLES):
        slow.observe_fetch(8000, 1, 0.02)
    for _ in range(MIN_LINK_SAMPLES):
        assert slow.plan(100, 8000).decision == "probe"
        slow.observe_fetch(800_000, 100, 2.0)  # 400 KB/s at that size too
    assert (slow.plan(100, 8000).blocks, slow.plan(100, 8000).decision) == (0, "recompute")


def test_always_reads_everything_and_settings_refuse_what_they_cannot_honour() -> None:
    planner = FetchPlanner("always", BLOCK, budget_s=0.5, link_bytes_s=1.0, prefill_tokens_s=1e9)
    assert (planner.plan(7, 8000).blocks, planner.plan(7, 8000).decision) == (7, "fetch")
    with pytest.raises(ConfigError, match="fetch_policy"):
        PodSettings(fetch_policy="sometimes")
    with pytest.raises(ConfigError, match="link_bytes_s"):
        PodSettings(link_bytes_s=-1)
    env = settings_from_env({"KVSTASH_FETCH_POLICY": "always", "KVSTASH_LINK_BYTES_S": "1e6",
                             "KVSTASH_PREFILL_TOKENS_S": "500"})
    assert (env.fetch_policy, env.link_bytes_s, env.prefill_tokens_s) == ("always", 1e6, 500.0)


def _turns(client: TestClient, conversation: list[dict[str, str]], turns: int) -> list[Any]:
    """`turns` more turns of `conversation` (sent whole, as a stateless client does) on `client`."""
    responses = []
    for turn in range(turns):
        conversation.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        resp = chat(client, conversation)
        conversation.append({"role": "assistant", "content": reply_of(resp)})
        wait_written(client)
        responses.append(resp)
    return responses


def test_a_slow_link_makes_the_pod_recompute_with_the_same_answer(redis_server: RedisProcess,
                                                                   tiny_model: Any) -> None:
    """Behind a link that reads 64 KB/s, a pod that has measured it (MIN_LINK_SAMPLES reads) and its own prefill
    stops reading the blocks, prefills them (X-KV-Cache: recompute) and answers exactly as a pod without the cache;
    one with fetch_policy=always still reads them."""
    with ThrottledLink(redis_server.port, SLOW_LINK_BYTES_S) as link, \
            pod_client(redis_server.url, tiny_model, pod_name="writer") as writer, \
            pod_client(link.url, tiny_model, pod_name="slow", redis_timeout_s=10.0) as slow, \
            pod_client(link.url, tiny_model, pod_name="always", redis_timeout_s=10.0,
                       fetch_policy="always") as always, \
            uncached_pod(tiny_model) as plain:
        conversation = [SYSTEM]
        _turns(writer, conversation, 2)  # the history's blocks are in Redis
        # the slow pod learns its prefill rate on a prompt of its own (a miss), then its link on its first hits
        other = [{"role": "system", "content": "Answer in one word, and only ever in one word. " * 8}]
        assert _turns(slow, other, 1)[0].headers["x-kv-cache"] == "miss"
        statuses = []
        for _ in range(MIN_LINK_SAMPLES + 2):
            replied = link.replied
            resp = _turns(slow, conversation, 1)[0]
            statuses.append(resp.headers["x-kv-cache"])
            assert reply_of(resp) == reference_reply(plain, resp)
            if statuses[-1] == "recompute":
                break
            assert int(resp.headers["x-kv-cached-tokens"]) > 0  # a read while the link is being measured
        assert statuses[-1] == "recompute" and resp.headers["x-kv-cached-tokens"] == "0", statuses
        # probes: its own prompt's miss (nothing measured then, nothing read either) and every read before this one
        assert metric(slow, "kvstash_fetch_plans_total", 'decision="probe"') == len(statuses) > MIN_LINK_SAMPLES
        assert metric(slow, "kvstash_fetch_plans_total", 'decision="recompute"') == 1
        assert 0 < metric(slow, "kvstash_link_bytes_per_second") < SLOW_LINK_BYTES_S * 2
        assert metric(slow, "kvstash_prefill_tokens_per_second") > 0
        skipped = metric(slow, "kvstash_fetch_skipped_blocks_total")
        assert skipped >= len(resp.json()["prompt_token_ids"]) // BLOCK - 2  # all but what its last turns added
        assert link.replied - replied < 8000 * skipped / 4  # the blocks' bytes never came over the link
        forced = chat(always, conversation[:-1])  # the same prompt: every block is read, however slowly
        assert forced.headers["x-kv-cache"] == "hit" and reply_of(forced) == reply_of(resp)
        assert metric(always, "kvstash_fetch_plans_total", 'decision="fetch"') == 1


def test_a_fast_link_makes_the_pod_fetch(redis_server: RedisProcess, tiny_model: Any) -> None:
    """On a direct link, a pod whose prefill is slow (here configured: 50 tokens/s, a block in 0.3 s) reads its
    hits once it has measured the link."""
    with pod_client(redis_server.url, tiny_model, pod_name="writer") as writer, \
            pod_client(redis_server.url, tiny_model, pod_name="reader", prefill_tokens_s=50.0) as reader:
        conversation = [SYSTEM]
        _turns(writer, conversation, 1)
        hits = _turns(reader, conversation, MIN_LINK_SAMPLES + 1)
        assert all(int(r.headers["x-kv-cached-tokens"]) > 0 for r in hits)
        assert metric(reader, "kvstash_fetch_plans_total", 'decision="probe"') == MIN_LINK_SAMPLES
        assert metric(reader, "kvstash_fetch_plans_total", 'decision="fetch"') == 1
        assert metric(reader, "kvstash_fetch_skipped_blocks_total") == 0
        assert metric(reader, "kvstash_prefill_tokens_per_second") == 50.0
