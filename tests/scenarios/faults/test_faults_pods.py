"""Pod faults with real uvicorn processes: SIGKILL with writes queued, SIGTERM drains, two pods racing on one
session, a client hanging up mid-stream. Replies are compared with a no-cache pod (exact codec, greedy)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial

import httpx
import pytest
import redis

from cachestore.codec import Codec
from cachestore.sessions import from_fields
from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from tests.faultkit import QUESTIONS, SYSTEM, reference_reply, reply_of
from tests.support import post_chat, settle, tiny_pods, write_queue
from tests.timing import wait_for


@pytest.fixture(scope="module")
def pods(module_redis_server: RedisProcess) -> Iterator[dict[str, PodProcess]]:
    # the breaker stays closed here: under `CLIENT PAUSE WRITE` lookups that slide TTLs time out too, and an open
    # breaker would fail the queued writes at once instead of leaving them queued for the kill or the stop
    with tiny_pods(module_redis_server.url + "?breaker_failures=1000") as procs:
        yield procs


@pytest.fixture
def revive(pods: dict[str, PodProcess]) -> Iterator[None]:
    """Start pod A again after a test that killed or stopped it."""
    yield
    if pods["a"].proc is None:
        pods["a"].start().wait_ready(120)


_chat = partial(post_chat, max_tokens=8, return_token_ids=True)


def _audit(r: redis.Redis) -> tuple[int, int]:
    """Every block decodes whole and every session record parses: nothing torn is visible."""
    blocks = sessions = 0
    for key in r.scan_iter(match="kvstash:blk:*", count=1000):
        kv = Codec().decode(r.get(key), device="cpu")  # raises CodecError on a torn value
        assert kv.shape[3] == 16, key
        blocks += 1
    for key in r.scan_iter(match="kvstash:sess:*", count=1000):
        _, _, tenant, session_id = key.decode().split(":", 3)
        record = from_fields(r.hgetall(key), tenant, session_id)
        assert record is not None, f"torn or garbage session record {key!r}"
        if record.partial:
            Codec().decode(record.partial, device="cpu")
        sessions += 1
    return blocks, sessions


def _until_no_client_blocked(r: redis.Redis, timeout_s: float = 10.0) -> None:
    """Until no client is held by the pause: the killed pod's postponed writes ran, or went with its connection."""
    wait_for(lambda: not any("b" in c["flags"] for c in r.client_list()), "no client blocked after the unpause",
             timeout_s)


def test_sigkill_with_writes_queued_leaves_nothing_torn(pods: dict[str, PodProcess], module_redis_server: RedisProcess,
                                                        figures: dict[str, object], revive: None) -> None:
    a, b, plain = pods["a"], pods["b"], pods["plain"]
    conversations = {f"k{i}": [SYSTEM, {"role": "user", "content": f"{QUESTIONS[i % 8]} (conversation {i})"}]
                     for i in range(6)}
    r = module_redis_server.client()
    r.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # writes queue up on pod A, reads still answer
    try:
        for sid, messages in conversations.items():
            reply = reply_of(_chat(a.url, messages, session_id=sid))
            messages.append({"role": "assistant", "content": reply})
        queued = write_queue(a.url)
        assert queued > 0, "nothing was queued at the kill: the scenario did not happen"
        a.kill()  # SIGKILL: whatever is queued or in flight is lost, never half-written
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    _until_no_client_blocked(r)
    blocks, sessions = _audit(r)
    sent = correct = hits = 0
    for sid, messages in conversations.items():
        messages.append({"role": "user", "content": QUESTIONS[(int(sid[1:]) + 1) % 8]})
        resp = _chat(b.url, messages, session_id=sid)
        sent += 1
        correct += reply_of(resp) == reference_reply(plain.url, resp)
        hits += resp.headers["x-kv-cache"] in ("hit", "partial")
    settle(b.url)
    _audit(r)
    r.close()
    assert correct == sent
    figures.update(queued_at_kill=queued, blocks_after_kill=blocks, sessions_after_kill=sessions, requests=sent,
                   correct=correct, errors=0, torn=0, hits_on_other_pod=hits)


def test_sigterm_drains_queued_writes(pods: dict[str, PodProcess], module_redis_server: RedisProcess,
                                      revive: None) -> None:
    a, b = pods["a"], pods["b"]
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[3]}]
    r = module_redis_server.client()
    r.execute_command("CLIENT", "PAUSE", "60000", "WRITE")  # held until a second into the graceful stop
    unpause = threading.Timer(1.0, r.execute_command, ("CLIENT", "UNPAUSE"))
    try:
        expected = reply_of(_chat(a.url, messages))
        assert write_queue(a.url) > 0, "nothing was queued at the stop: the scenario did not happen"
        unpause.start()
        a.stop()  # SIGTERM: the lifespan drains the queue (waiting out the pause) before exiting
    finally:
        unpause.cancel()
        if unpause.ident is not None:
            unpause.join()
        r.execute_command("CLIENT", "UNPAUSE")
    resp = _chat(b.url, messages)
    assert reply_of(resp) == expected
    assert resp.headers["x-kv-cache"] == "hit", "pod A's queued blocks were lost on a graceful stop"
    r.close()


def test_two_pods_on_one_session_no_lost_update_no_mixed_history(pods: dict[str, PodProcess],
                                                                 figures: dict[str, object]) -> None:
    a, b, plain = pods["a"], pods["b"], pods["plain"]
    created = httpx.post(a.url + "/v1/sessions", json={"session_id": "race", "messages": [SYSTEM]}, timeout=10)
    assert created.status_code == 201
    outcomes: dict[str, int] = {"200": 0, "409": 0}
    rounds = 6
    for rnd in range(rounds):
        before = httpx.get(a.url + "/v1/sessions/race", timeout=10).json()["messages"]
        gate = threading.Barrier(2)
        results: dict[str, httpx.Response] = {}

        def turn(pod: PodProcess, content: str, gate: threading.Barrier = gate,
                 results: dict[str, httpx.Response] = results) -> None:
            gate.wait()
            results[content] = httpx.post(pod.url + "/v1/sessions/race/messages", timeout=60,
                                          json={"content": content, "max_tokens": 24, "return_token_ids": True})

        contents = [f"round {rnd} from A: {QUESTIONS[rnd % 8]}", f"round {rnd} from B: {QUESTIONS[(rnd + 3) % 8]}"]
        threads = [threading.Thread(target=turn, args=(p, c)) for p, c in zip((a, b), contents, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [c for c in contents if results[c].status_code == 200]
        for c in contents:
            code = results[c].status_code
            assert code in (200, 409), results[c].text
            outcomes[str(code)] += 1
            if code == 409:
                assert results[c].json()["error"]["code"] == "session_conflict"
        after = httpx.get(b.url + "/v1/sessions/race", timeout=10).json()["messages"]
        # no lost update: on top of what was there, each 200 added exactly its turn (its message, then the reply
        # it returned), once; no 409 added anything
        assert after[: len(before)] == before
        added = after[len(before):]
        assert [m["role"] for m in added] == ["user", "assistant"] * len(winners), added
        users = [m["content"] for m in added[0::2]]
        assert sorted(users) == sorted(winners), (users, winners)
        for c in winners:
            reply = results[c].json()["choices"][0]["message"]["content"]
            assert added[2 * users.index(c) + 1]["content"] == reply, "a reply recorded under another turn"
        # no mixed history: each recorded reply is exactly what a no-cache pod says to the very tokens its turn was
        # given (the session's history, its own replies as the ids it generated, then the new message)
        for i in range(0, len(added), 2):
            winner = results[added[i]["content"]]
            assert added[i + 1]["content"] == reference_reply(plain.url, winner, 24)
    assert outcomes["200"] >= rounds
    figures.update(requests=2 * rounds, ok=outcomes["200"], conflicts_409=outcomes["409"], lost_updates=0,
                   mixed_histories=0)


def test_client_hangs_up_mid_stream_and_generation_stops(pods: dict[str, PodProcess]) -> None:
    a = pods["a"]
    max_tokens = 1800
    stamps: list[float] = []
    for question in ["Count forever.", *QUESTIONS]:  # greedy is deterministic: the first prompt that runs long
        body = {"model": "tiny-random", "messages": [SYSTEM, {"role": "user", "content": question}],
                "max_tokens": max_tokens, "stream": True}
        stamps = []
        with httpx.stream("POST", a.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    stamps.append(time.monotonic())
                    if len(stamps) == 20:
                        break  # hang up after 20 tokens
        if len(stamps) == 20:
            break
    assert len(stamps) == 20, "every prompt ended its reply early: nothing long to abandon"
    per_token_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    t0 = time.monotonic()
    nxt = _chat(a.url, [{"role": "user", "content": "hello"}], max_tokens=2)
    waited = time.monotonic() - t0
    assert nxt.status_code == 200
    left_s = (max_tokens - 20) * per_token_s  # what finishing the abandoned reply would have cost
    assert waited < max(2.0, left_s / 4), (waited, left_s)  # the inference thread was free almost at once
