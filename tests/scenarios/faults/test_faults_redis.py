"""Redis faults under live pods: killed and restarted empty, paused past the read budget, evicting under memory
pressure, a cluster primary killed. Every reply is compared with a no-cache pod (exact codec, greedy)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from cachestore.store import BlockStore
from ops.redisproc import RedisCluster, RedisProcess
from service.app import store_settings
from tests.faultkit import (
    QUESTIONS,
    SYSTEM,
    chat,
    pod_client,
    reference_reply,
    reply_of,
    state_of,
    wait_written,
)
from tests.timing import wait_for


class Oracle:
    """Memoised no-cache replies, so comparing costs one generation per distinct prompt."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.memo: dict[str, str] = {}

    def __call__(self, resp: Any, max_tokens: int = 8) -> str:
        """The no-cache reply to exactly the tokens `resp`'s pod used."""
        key = repr((resp.json()["prompt_token_ids"], max_tokens))
        if key not in self.memo:
            self.memo[key] = reference_reply(self.client, resp, max_tokens)
        return self.memo[key]


@pytest.fixture(scope="module")
def oracle(plain_pod: TestClient) -> Oracle:
    return Oracle(plain_pod)


RECOVERY_LIMIT_S = 30.0  # the pod's breaker reset (5 s), a miss that writes and the hit after it, with room


def test_redis_killed_mid_conversation_and_restarted_empty(kv_server: RedisProcess, tiny_model: Any,
                                                           oracle: Oracle, figures: dict[str, object]) -> None:
    """Two pods alternate the turns of a conversation; Redis dies at turn 3 and comes back empty at turn 5."""
    sent = correct = 0
    statuses: list[str] = []
    with pod_client(kv_server.url, tiny_model, pod_name="a") as a, \
            pod_client(kv_server.url, tiny_model, pod_name="b") as b:
        messages = [SYSTEM]
        restarted_at = recovered_s = None
        # turns go on until a hit after the restart: the breaker stays open for breaker_reset_s (5 s) of real time
        # whatever the turns cost, so a fast machine needs more of them than a slow one
        for turn in range(60):
            if restarted_at is not None and time.monotonic() - restarted_at > RECOVERY_LIMIT_S:
                break
            if turn == 3:
                kv_server.kill()
            if turn == 5:
                kv_server.start()  # same port, empty
                restarted_at = time.monotonic()
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            pod = a if turn % 2 == 0 else b
            resp = chat(pod, messages, session_id="conv-1")
            sent += 1
            text = reply_of(resp)
            correct += text == oracle(resp)
            assert text == oracle(resp), f"turn {turn} differs from the no-cache reply"
            statuses.append(resp.headers["x-kv-cache"])
            messages.append({"role": "assistant", "content": text})
            wait_written(pod)
            if restarted_at is not None and resp.headers["x-kv-cache"] == "hit":
                recovered_s = time.monotonic() - restarted_at
                if turn >= 8:
                    break
            if restarted_at is not None and recovered_s is None:
                time.sleep(0.5)  # the wait is the test: the breaker's reset passes in real time, between turns
        assert statuses[1] == "hit"  # before the outage, the other pod's blocks were used
        assert set(statuses[3:5]) == {"bypass"}  # during it, recompute
        assert recovered_s is not None and statuses[-1] == "hit", statuses  # after it, hits without a restart
    figures.update(requests=sent, correct=correct, errors=0, recover_s=round(recovered_s, 2), statuses=statuses)


def test_redis_flushed_under_a_conversation_the_pod_that_holds_it_writes_it_again(
        kv_server: RedisProcess, tiny_model: Any, oracle: Oracle) -> None:
    """Redis loses every key (FLUSHALL: a restart without persistence) between two turns. The pod that goes on from
    blocks its local tier still holds writes the chain again from block 0 with its new blocks, so a third pod that
    never saw the conversation hits all of it on the next turn."""
    from tests.support import make_client  # noqa: PLC0415 - faultkit's pods have no local tier

    with make_client(kv_server, tiny_model, pod_name="a") as a, pod_client(kv_server.url, tiny_model,
                                                                            pod_name="c") as c:
        messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        first = chat(a, messages)
        wait_written(a)
        messages.append({"role": "assistant", "content": reply_of(first)})
        kv_server.client().flushall()
        messages.append({"role": "user", "content": QUESTIONS[1]})
        second = chat(a, messages)  # its full blocks from a's own memory (the tail entry is gone): written on a
        assert second.headers["x-kv-cache"] == "partial" and reply_of(second) == oracle(second)  # lost parent
        wait_written(a)
        assert state_of(a).store.stats().blocks_restored > 0
        messages += [{"role": "assistant", "content": reply_of(second)}, {"role": "user", "content": QUESTIONS[2]}]
        third = chat(c, messages)
        written = second.json()["usage"]["prompt_tokens"] + second.json()["usage"]["completion_tokens"]
        # c reads every full block of a's turn 2 from Redis (block 0 on: without the restore, none is there)
        assert int(third.headers["x-kv-cached-tokens"]) >= written // 16 * 16, (third.headers, written)
        assert reply_of(third) == oracle(third)


def test_client_pause_past_the_budget_opens_then_closes_the_breaker(
        redis_server: RedisProcess, tiny_model: Any, oracle: Oracle, figures: dict[str, object]) -> None:
    budget_s = 0.25
    with pod_client(redis_server.url, tiny_model, redis_timeout_s=budget_s) as pod:
        messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        first = chat(pod, messages)
        assert reply_of(first) == oracle(first)
        wait_written(pod)
        assert chat(pod, messages).headers["x-kv-cache"] == "hit"
        t0 = time.perf_counter()
        chat(pod, [SYSTEM, {"role": "user", "content": "fresh prompt, never cached"}])
        recompute_s = time.perf_counter() - t0  # a full recompute, Redis healthy
        admin = redis_server.client()
        admin.execute_command("CLIENT", "PAUSE", "4000", "ALL")
        admin.close()
        paused_at = time.monotonic()
        latencies, sent, correct = [], 0, 0
        store = state_of(pod).store
        while store.breaker_state != "open" and time.monotonic() - paused_at < 3.5:
            t = time.perf_counter()
            resp = chat(pod, messages)
            latencies.append(time.perf_counter() - t)
            sent += 1
            correct += reply_of(resp) == oracle(resp)
            assert resp.headers["x-kv-cache"] == "bypass"
        assert store.breaker_state == "open", "the breaker never opened while Redis was paused"
        assert correct == sent
        # each reply waited on Redis at most the budget (plus recompute and scheduling slack)
        assert max(latencies) < budget_s + 3 * recompute_s + 0.5, (latencies, recompute_s)
        t = time.perf_counter()
        first = chat(pod, messages)
        assert reply_of(first) == oracle(first)  # breaker open: no wait on Redis at all
        open_latency = time.perf_counter() - t
        deadline = time.monotonic() + 20
        status = ""
        while time.monotonic() < deadline:
            resp = chat(pod, messages)
            sent += 1
            correct += reply_of(resp) == oracle(resp)
            status = resp.headers["x-kv-cache"]
            if status == "hit" and store.breaker_state == "closed":
                break
            time.sleep(0.25)
        recovered_s = time.monotonic() - paused_at
        assert status == "hit" and store.breaker_state == "closed"
        assert correct == sent
    figures.update(requests=sent, correct=correct, errors=0, budget_s=budget_s,
                   max_latency_paused_s=round(max(latencies), 3), recompute_s=round(recompute_s, 3),
                   open_breaker_latency_s=round(open_latency, 3), recover_s=round(recovered_s, 2))


@pytest.fixture
def tiny_redis() -> Iterator[RedisProcess]:
    server = RedisProcess(extra_args=("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")).start()
    try:
        yield server
    finally:
        server.cleanup()


def test_small_maxmemory_evicts_without_wrong_output(tiny_redis: RedisProcess, tiny_model: Any, oracle: Oracle,
                                                     figures: dict[str, object]) -> None:
    # distinct from the first token on: ~200 tokens = 12 blocks of 8 kB each, ~2.4 MB for all of them
    prompts = [[{"role": "user", "content": f"Conversation {i}. " + f"item {i} says more " * 40}]
               for i in range(24)]
    sent = correct = hits = 0
    with pod_client(tiny_redis.url, tiny_model, budget_bytes=1 << 30) as pod:
        for _ in range(3):
            for messages in prompts:
                resp = chat(pod, messages, max_tokens=4)
                sent += 1
                hits += resp.headers["x-kv-cache"] in ("hit", "partial")
                correct += reply_of(resp) == oracle(resp, 4)
                wait_written(pod)
        assert correct == sent
        info = tiny_redis.client().info("stats")
        evicted = int(info["evicted_keys"])
        assert evicted > 0, "the scenario must really make Redis evict"
        client = tiny_redis.client()
        client.config_set("maxmemory", "0")  # the pressure is over: the books must now balance again

        async def reconcile() -> tuple[int, int]:
            fresh = BlockStore(store_settings(state_of(pod).settings))
            try:
                await fresh.reconcile()
                return (await fresh.usage()).bytes_held, 0
            finally:
                await fresh.close()

        held, _ = asyncio.run(reconcile())
        actual = sum(client.strlen(k) for kind in ("blk", "tail", "ids")  # everything the budget accounts for
                     for k in client.scan_iter(match=f"kvstash:{kind}:*", count=1000))
        client.close()
        assert held == actual, (held, actual)
    figures.update(requests=sent, correct=correct, errors=0, redis_evicted_keys=evicted, cache_hits=hits,
                   bytes_after_reconcile=held, bytes_in_redis=actual)


@pytest.mark.cluster
def test_cluster_primary_killed_replica_promoted(redis_cluster_with_replicas: RedisCluster, tiny_model: Any,
                                                 oracle: Oracle, figures: dict[str, object]) -> None:
    cluster = redis_cluster_with_replicas
    url = f"redis+cluster://127.0.0.1:{cluster.nodes[0].port}/0"
    sent = correct = 0
    _wait_replicas_in_sync(cluster)  # a replica that never synced refuses to fail over (validity factor)
    with pod_client(url, tiny_model, redis_timeout_s=1.0) as pod:
        messages = [SYSTEM, {"role": "user", "content": QUESTIONS[1]}]
        first = chat(pod, messages)
        assert reply_of(first) == oracle(first)
        wait_written(pod)
        assert chat(pod, messages).headers["x-kv-cache"] == "hit"
        primary = next(n for n in cluster.nodes if n.client().info("replication")["role"] == "master")
        primary.kill()
        killed_at = time.monotonic()
        status, statuses = "", []
        while time.monotonic() - killed_at < 40:
            other = [SYSTEM, {"role": "user", "content": f"{QUESTIONS[2]} ({sent})"}]
            for m in (messages, other):
                resp = chat(pod, m)
                sent += 1
                correct += reply_of(resp) == oracle(resp)
            resp = chat(pod, messages)
            sent += 1
            correct += reply_of(resp) == oracle(resp)
            status = resp.headers["x-kv-cache"]
            statuses.append(status)
            wait_written(pod)
            if status == "hit" and len(statuses) > 1 and _promoted(cluster, primary):
                break
            time.sleep(0.5)
        recovered_s = time.monotonic() - killed_at
        assert status == "hit", statuses
        assert correct == sent
    figures.update(requests=sent, correct=correct, errors=0, recover_s=round(recovered_s, 2),
                   statuses=statuses[:20])


def _wait_replicas_in_sync(cluster: RedisCluster, timeout_s: float = 30.0) -> None:
    def in_sync() -> bool:
        infos = [n.client(socket_timeout=1).info("replication") for n in cluster.nodes]
        replicas = [i for i in infos if i["role"] == "slave"]
        return bool(replicas) and all(i.get("master_link_status") == "up"
                                      and int(i.get("master_last_io_seconds_ago", 99)) < 5 for i in replicas)

    wait_for(in_sync, "replicas in sync with their primaries", timeout_s, poll_s=0.2)


def _promoted(cluster: RedisCluster, dead: RedisProcess) -> bool:
    masters = 0
    for node in cluster.nodes:
        if node is dead:
            continue
        try:
            masters += node.client(socket_timeout=1).info("replication")["role"] == "master"
        except Exception:  # noqa: BLE001
            pass
    return masters == 3


def test_session_write_failure_is_503_not_409(redis_server: RedisProcess, tiny_model: Any) -> None:
    """write_session says CONFLICT for a lost CAS and UNAVAILABLE for a Redis failure; the client must see which."""
    with pod_client(redis_server.url, tiny_model, redis_timeout_s=0.3) as pod:
        assert pod.post("/v1/sessions", json={"session_id": "w", "messages": [SYSTEM]}).status_code == 201
        admin = redis_server.client()
        admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # the session read (it slides the TTL) times out
        for resp in (pod.post("/v1/sessions/w/messages", json={"content": QUESTIONS[0], "max_tokens": 4}),
                     pod.get("/v1/sessions/w")):
            assert resp.status_code == 503, resp.text  # not 404 (the session exists) and not 409
            assert resp.json()["error"]["code"] == "redis_unavailable" and resp.headers["retry-after"]
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        ok = pod.post("/v1/sessions/w/messages", json={"content": QUESTIONS[0], "max_tokens": 4})
        assert ok.status_code == 200, ok.text


def test_session_cas_write_failing_mid_generation_is_503(redis_server: RedisProcess, tiny_model: Any) -> None:
    """Reads succeed, then Redis dies while the reply is generated: the unrecorded turn is a 503, not a 409."""
    import threading  # noqa: PLC0415

    turn = {"content": "Count forever.", "max_tokens": 400}
    with pod_client(redis_server.url, tiny_model, redis_timeout_s=0.3) as pod:
        for sid in ("dry", "m"):
            assert pod.post("/v1/sessions", json={"session_id": sid, "messages": [SYSTEM]}).status_code == 201
        # the same turn with Redis healthy: greedy decoding gives the same reply, so the same generation time
        t0 = time.monotonic()
        assert pod.post("/v1/sessions/dry/messages", json=turn).status_code == 200
        took_s = time.monotonic() - t0
        assert took_s > 0.3, f"the reply took {took_s:.2f} s: too short to kill Redis in the middle of it"
        timer = threading.Timer(took_s / 2, redis_server.kill)  # reads are done in milliseconds, well before
        t0 = time.monotonic()
        timer.start()
        resp = pod.post("/v1/sessions/m/messages", json=turn)
        timer.join()
        assert time.monotonic() - t0 > took_s / 2, "the reply was recorded before Redis died"
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "redis_unavailable"
        redis_server.start()


@pytest.mark.cluster
def test_a_conversation_goes_on_while_its_slots_migrate(fresh_cluster: RedisCluster, tiny_model: Any,
                                                        oracle: Oracle, figures: dict[str, object]) -> None:
    """Every slot holding a conversation's blocks is moved to another primary, as `redis-cli --cluster reshard`
    does, while the conversation goes on: half of each slot's blocks moved (ASK), then all (MOVED). Every reply is
    the no-cache reply, none fails, and the turns after the move hit again."""
    cluster = fresh_cluster
    url = f"redis+cluster://127.0.0.1:{cluster.nodes[0].port}/0"
    sent = correct = 0
    cached: list[int] = []
    with pod_client(url, tiny_model, redis_timeout_s=2.0) as pod:
        messages = [SYSTEM]
        keys: list[bytes] = []
        moves: list[tuple[int, RedisProcess, RedisProcess]] = []
        for turn in range(6):
            if turn == 2:  # every slot of the blocks written so far starts moving; a third of each slot's blocks go
                admin = cluster.nodes[0].client()
                keys = [k for n in cluster.nodes for k in n.client().scan_iter(match="kvstash:blk:*")]
                slots = sorted({int(admin.execute_command("CLUSTER", "KEYSLOT", k)) for k in keys})
                for slot in slots:
                    owner = cluster.owner(slot)
                    dest = cluster.nodes[(cluster.nodes.index(owner) + 1) % len(cluster.nodes)]
                    moves.append((slot, cluster.start_moving(slot, dest), dest))
                for slot, source, dest in moves:
                    held = [k for k in keys if int(admin.execute_command("CLUSTER", "KEYSLOT", k)) == slot]
                    cluster.migrate(source, dest, held[: max(1, len(held) // 3)])
            if turn == 4:
                for slot, source, dest in moves:
                    cluster.finish_moving(slot, source, dest)
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            resp = chat(pod, messages)
            sent += 1
            text = reply_of(resp)
            correct += text == oracle(resp)
            assert text == oracle(resp), f"turn {turn} differs from the no-cache reply"
            cached.append(int(resp.headers["x-kv-cached-tokens"]))
            messages.append({"role": "assistant", "content": text})
            wait_written(pod)
        assert moves and all(cluster.owner(slot) is dest for slot, _, dest in moves)
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached  # hits during the move and after it
        redirects = state_of(pod).store.stats().redirects
    figures.update(requests=sent, correct=correct, errors=0, slots_moved=len(moves), cached_tokens=cached,
                   redirects=redirects)
