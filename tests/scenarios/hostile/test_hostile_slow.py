"""Slowloris-style clients against a real uvicorn pod: slow bodies get 408, slow headers starve nobody."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import httpx
import pytest

from ops.pods import PodProcess
from ops.redisproc import RedisProcess
from tests.support import POD_ARGS, post_chat

BODY_TIMEOUT_S = 1.0


@pytest.fixture
def pod(redis_server: RedisProcess) -> Iterator[PodProcess]:
    proc = PodProcess("pod-slow", redis_server.url, "tiny-random", POD_ARGS,
                      env={"KVSTASH_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)})
    try:
        yield proc.start().wait_ready(120)
    finally:
        proc.cleanup()


def _open(pod: PodProcess, head: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", pod.port), timeout=10)
    sock.sendall(head)
    return sock


def _chat(pod: PodProcess) -> httpx.Response:
    """An honest client's short chat."""
    return post_chat(pod.url, [{"role": "user", "content": "hello"}], max_tokens=4, timeout_s=30)


def test_slow_body_gets_408_and_slow_headers_starve_nobody(pod: PodProcess, figures: dict[str, object]) -> None:
    # 40 connections that never finish their headers (classic slowloris)
    loris = [_open(pod, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(40)]
    # 4 connections that send headers, then drip a 4 kB body a byte at a time
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4096\r\n\r\n{")
    drips = [_open(pod, head) for _ in range(4)]
    t0 = time.monotonic()
    served = [_chat(pod) for _ in range(3)]  # meanwhile, honest clients are served
    assert all(r.status_code == 200 for r in served), [r.text for r in served]
    honest_s = time.monotonic() - t0
    replies: list[bytes] = []
    for sock in drips:
        sock.settimeout(0.05)
        data = b""
        while time.monotonic() - t0 < BODY_TIMEOUT_S + 5 and b"}}" not in data:
            try:
                sock.sendall(b" ")
            except OSError:
                pass
            try:
                data += sock.recv(4096)
            except TimeoutError:
                pass
            except OSError:
                break
            time.sleep(0.05)  # the wait is the test: a body dripped a byte at a time
        replies.append(data)
    elapsed = time.monotonic() - t0
    for data in replies:
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"application/json" in data and b'"code":"body_timeout"' in data  # a JSON error body
    assert elapsed < BODY_TIMEOUT_S + 5
    for sock in loris + drips:
        sock.close()
    assert httpx.get(pod.url + "/healthz", timeout=5).json() == {"status": "ok"}
    assert _chat(pod).status_code == 200
    figures.update(slow_header_connections=len(loris), slow_bodies=len(drips), slow_bodies_408=len(replies),
                   honest_requests=len(served) + 1, honest_ok=len(served) + 1, honest_seconds=round(honest_s, 2))


@pytest.mark.parametrize("megabytes", [5, 20])
def test_client_that_sends_all_first_reads_the_413(pod: PodProcess, megabytes: int) -> None:
    """urllib (like `requests`) sends the whole body before it reads: it must get the 413 JSON, not a reset."""
    body = b'{"model": "tiny-random", "pad": "' + b"x" * (megabytes << 20) + b'"}'
    sized = urllib.request.Request(pod.url + "/v1/chat/completions", data=body, method="POST",
                                   headers={"Content-Type": "application/json"})
    chunked = urllib.request.Request(pod.url + "/v1/chat/completions", data=iter([body[i:i + (1 << 20)]
                                     for i in range(0, len(body), 1 << 20)]), method="POST",
                                     headers={"Content-Type": "application/json"})  # no length: chunked
    for request in (sized, chunked):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 413
        assert json.loads(refused.value.read())["error"]["code"] == "body_too_large"
    assert _chat(pod).status_code == 200
