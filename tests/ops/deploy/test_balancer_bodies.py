"""The demo balancer (ops/pods.py's nginx) passes every body the pods accept: a long chat history reaches a real
pod and is answered, not refused by nginx with a 500 (bodies over its 16 KB in-memory default used to go to a
temp dir its worker could not write)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from ops.bench.common import SAMPLE_TEXT
from ops.pods import NginxProcess, PodProcess, nginx_binary
from ops.redisproc import RedisProcess

pytestmark = pytest.mark.skipif(nginx_binary() is None,
                                reason="nginx is not installed (CI installs nginx-light in .ci/run)")
POD_MAX_BODY = 1 << 20  # service/settings.py max_body_bytes, the default the balancer matches


def test_bodies_up_to_the_pods_limit_pass(fake_pods: list[int]) -> None:
    proc = NginxProcess([f"127.0.0.1:{p}" for p in fake_pods]).start()
    try:
        with httpx.Client(timeout=30) as client:
            for size in (8 << 10, 100 << 10, POD_MAX_BODY - 4096):
                resp = client.post(proc.url + "/v1/chat/completions", content=b"x" * size)
                assert (resp.status_code, resp.text) == (200, str(size)), size  # the pod read every byte
            assert client.post(proc.url + "/v1/chat/completions", content=b"x" * (POD_MAX_BODY + 1)).status_code == 413
    finally:
        proc.cleanup()


def _long_history(turns: int) -> list[dict[str, str]]:
    """A system prompt and `turns` user/assistant exchanges of prose from ops/data/sample.txt."""
    words = SAMPLE_TEXT.read_text(encoding="utf-8").split() * 3  # 1,626 words, cycled
    messages = [{"role": "system", "content": "You answer briefly."}]
    for i in range(turns):
        chunk = " ".join(words[i * 160:(i + 1) * 160])
        messages += [{"role": "user", "content": f"Notes {i}: {chunk}"},
                     {"role": "assistant", "content": f"Noted part {i}."}]
    messages.append({"role": "user", "content": "Which part came first?"})
    return messages


@pytest.mark.slow
def test_long_history_through_the_balancer(redis_server: RedisProcess, tmp_path: Path) -> None:
    """A stateless client resending a 4,000+ token conversation (about 19 KB of JSON) through nginx to a llamacpp
    pod serving SmolLM2 (its context is 8192): answered with 200, every prompt token counted."""
    pod = PodProcess("pod-long", redis_server.url, "smollm2",
                     ("--engine", "llamacpp", "--threads", "1", "--parallel", "1", "--codec", "int8")).start()
    balancer = None
    try:
        pod.wait_ready()
        balancer = NginxProcess([f"127.0.0.1:{pod.port}"]).start()
        messages = _long_history(24)
        body = {"model": "smollm2", "messages": messages, "max_tokens": 2, "temperature": 0}
        assert len(json.dumps(body)) > 16 << 10  # past nginx's in-memory default (16 KB here)
        resp = httpx.post(balancer.url + "/v1/chat/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["usage"]["prompt_tokens"] >= 2600
        assert resp.headers["x-kv-pod"] == "pod-long"
    finally:
        if balancer is not None:
            balancer.cleanup()
        pod.cleanup()
