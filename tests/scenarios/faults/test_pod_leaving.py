"""Pods that leave, as real `kvstash serve` processes of SmolLM2 beside a real redis-server: SIGTERM with requests in
flight drains the pod (not ready at once, new connections refused, every request finished and written back, exit 0);
a second SIGTERM or the grace period ends it at once; a pod SIGKILLed while half a block is on its way to Redis leaves
whole blocks or none, and the conversation's next turn on another pod is right."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import httpx
import pytest

from cachestore.codec import Codec
from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from service.runtime.drain import EXIT_CUT_SHORT
from tests.faultkit import QUESTIONS, SYSTEM
from tests.leaving import Stream, next_turn, readyz
from tests.support import POD_ARGS
from tests.timing import wait_for
from tests.tornlink import TornLink

BLOCK = 16  # POD_ARGS' block tokens
LOG_INFO = ("--log-level", "info")  # the drain's log lines are at info
# the drain's pods run llama.cpp (it decodes SmolLM2 several times faster than transformers on a CPU); the torn
# write's run transformers, whose replies with and without a hit are token-identical (llama.cpp's may differ on a
# near-tie, docs/engines-codecs.md), so the reader's reply can be compared with the killed writer's
LLAMACPP = ("--engine", "llamacpp")


@pytest.fixture(scope="module")
def reader(module_redis_server: RedisProcess) -> Iterator[Callable[..., PodProcess]]:
    """The pod of an engine that takes the next turns (started once): it reads every block Redis holds."""
    readers: dict[tuple[str, ...], PodProcess] = {}

    def get(*engine: str) -> PodProcess:
        if engine not in readers:
            readers[engine] = PodProcess(f"reader{len(readers)}", module_redis_server.url, "smollm2",
                                         (*POD_ARGS, *engine, "--fetch-policy", "always")).start().wait_ready(300)
        return readers[engine]

    try:
        yield get
    finally:
        for pod in readers.values():
            pod.cleanup()


@pytest.fixture
def start_pod() -> Iterator[Callable[..., PodProcess]]:
    """Start a SmolLM2 pod (name, Redis URL, its flags, KVSTASH_* variables), logging at info; gone after the test."""
    started: list[PodProcess] = []

    def start(name: str, redis_url: str, *args: str, **env: str) -> PodProcess:
        pod = PodProcess(name, redis_url, "smollm2", (*POD_ARGS, *LOG_INFO, *args), env=env)
        started.append(pod)
        return pod.start().wait_ready(300)

    try:
        yield start
    finally:
        for pod in started:
            pod.cleanup()


def test_sigterm_with_requests_in_flight_drains_and_exits_0(module_redis_server: RedisProcess,
                                                            reader: Callable[..., PodProcess],
                                                            start_pod: Callable[..., PodProcess]) -> None:
    # replies do not wait for their writes: what the requests computed is still queued when they end, and only the
    # drain writes it
    pod = start_pod("leaving", module_redis_server.url, *LLAMACPP, "--drain-grace-s", "240", KVSTASH_WRITE_WAIT_S="0")
    assert pod.proc is not None
    # 64 tokens each: the signal comes at their first, so both are still in flight
    streams = [Stream(pod.url, [SYSTEM, {"role": "user", "content": f"{q} At length, please. ({i})"}], 64).start()
               for i, q in enumerate(QUESTIONS[:2])]
    for s in streams:
        assert s.first.wait(240) and s.error is None, s.error
    unfinished = sum(not s.done for s in streams)
    pod.proc.send_signal(signal.SIGTERM)
    # not ready from the signal on (503 while the listener lasts), then new connections are refused
    seen = []
    wait_for(lambda: seen.append(readyz(pod.url)) or seen[-1] == "closed", "the listener to close",
             timeout_s=120)
    assert 200 not in seen, seen
    with pytest.raises(httpx.ConnectError):
        httpx.post(pod.url + "/v1/chat/completions", json={"model": "smollm2", "messages": []}, timeout=5)
    for s in streams:
        s.join(240)
        assert s.error is None and s.done and s.finish_reason in ("stop", "length"), (s.error, s.text)
    assert pod.proc.wait(timeout=240) == 0, pod.log_tail()
    log = pod.log_tail(200)
    assert "draining on SIGTERM: not ready" in log and "drained in" in log and "0 writes queued; exiting" in log
    assert unfinished, "every stream had ended before the signal: nothing was in flight"
    # written back: the next turn, on another pod, reads the prompt's blocks and the reply's
    for s in streams:
        assert s.usage is not None
        prompt = s.usage["prompt_tokens"]
        cached = int(next_turn(reader(*LLAMACPP), s).headers["x-kv-cached-tokens"])
        assert cached > prompt // BLOCK * BLOCK, (cached, prompt, s.usage)


@pytest.mark.parametrize("how", ["second-sigterm", "grace"])
def test_second_sigterm_or_grace_ends_the_drain_at_once(module_redis_server: RedisProcess, how: str,
                                                        start_pod: Callable[..., PodProcess]) -> None:
    # a text completion that goes on counting: long whatever the engine (a chat may end early)
    count = ", ".join(str(i) for i in range(1, 21)) + ","
    # a lame-duck minute for the second signal's pod (the listener stays, not ready); a short grace for the other
    drain = ("--drain-delay-s", "60", "--drain-grace-s", "240") if how == "second-sigterm" else ("--drain-grace-s", "2")
    args = (*LLAMACPP, *drain)
    pod = start_pod(f"cut-{how}", module_redis_server.url, *args)
    assert pod.proc is not None
    stream = Stream(pod.url, [], 1800, prompt=count).start()
    assert stream.first.wait(240) and stream.error is None, stream.error
    pod.proc.send_signal(signal.SIGTERM)
    if how == "second-sigterm":
        ready = wait_for(lambda: (r := httpx.get(pod.url + "/readyz", timeout=10)).status_code == 503 and r,
                         "readiness to turn 503", timeout_s=120)
        assert ready.json()["status"] == "draining" and ready.headers["connection"] == "close"
        served = httpx.get(pod.url + "/metrics", timeout=10)  # still served while the listener lasts
        assert "kvstash_draining 1.0" in served.text and served.headers["connection"] == "close"
        pod.proc.send_signal(signal.SIGTERM)
    assert pod.proc.wait(timeout=120) == EXIT_CUT_SHORT, pod.log_tail()
    stream.join(60)
    assert not stream.done, "the drain was not cut short: the request finished"
    log = pod.log_tail(50)
    assert "exiting now" in log and ("SIGTERM while draining" if how == "second-sigterm" else "grace") in log


def test_sigkill_mid_write_leaves_whole_blocks_and_a_right_next_turn(module_redis_server: RedisProcess,
                                                                     reader: Callable[..., PodProcess],
                                                                     start_pod: Callable[..., PodProcess]) -> None:
    """The writer's pipeline of block SETs is torn in its third value; the writer is SIGKILLed with it half sent.
    Redis holds the two whole blocks before it and nothing else of that write; another pod takes exactly those two
    as its hit and replies as the killed pod did (exact codec, greedy)."""
    r = module_redis_server.client()
    before = set(r.scan_iter(match="kvstash:blk:*", count=1000))
    # a system prompt of its own: no block of this conversation is in Redis before the writer's
    messages = [{"role": "system", "content": "You write about the sea, at length and in order. " * 8},
                {"role": "user", "content": "Tell me about the sea, in one long paragraph."}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": 16, "temperature": 0}
    # the writer waits on the frozen write as long as the test runs (the store's write timeout), never gives up first
    with TornLink(module_redis_server.port, big=65536, whole=2) as link:
        writer = start_pod("torn", link.url + "?write_timeout_s=600")
        resp = httpx.post(writer.url + "/v1/chat/completions", json=body, timeout=240)
        assert resp.status_code == 200, resp.text
        assert link.cut.wait(120), "no block write went through the link"
        writer.kill()
    new = wait_for(lambda: set(r.scan_iter(match="kvstash:blk:*", count=1000)) - before, "the whole blocks",
                   timeout_s=120)
    assert len(new) == 2, new  # the two before the torn one; none of the rest of that write
    for key in new:
        assert Codec().decode(r.get(key)).shape[3] == BLOCK  # whole: a torn value would not decode
    got = httpx.post(reader().url + "/v1/chat/completions", json=body, timeout=240)
    assert got.status_code == 200 and got.headers["x-kv-cache"] == "partial", got.headers
    assert int(got.headers["x-kv-cached-tokens"]) == 2 * BLOCK
    assert got.json()["choices"][0]["message"]["content"] == resp.json()["choices"][0]["message"]["content"]
    r.close()
