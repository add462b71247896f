"""The shipped balancer configs never send a completion twice: real nginx (ops/nginx/kvstash-proxy.conf, through the
demo config) and real HAProxy (ops/haproxy/haproxy.cfg) in front of stand-in pods. A refused connection (a pod that
left: its listener closed on SIGTERM) is retried on another pod; a POST that reached a pod which then died without
answering (SIGKILL mid-request) is not sent anywhere again: the client gets a 502, and each POST reached one pod."""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from ops.pods import NginxProcess, nginx_binary
from ops.redisproc import free_port
from tests.balancers import wait_listening
from tests.paths import ROOT

HAPROXY_CFG = ROOT / "ops" / "haproxy" / "haproxy.cfg"
POSTS = 4


class _Pod(BaseHTTPRequestHandler):
    """A stand-in pod: `good` answers every request; `dies` reads a POST whole, then closes without a word."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name; /readyz for HAProxy's check
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        server = self.server
        with server.lock:  # type: ignore[attr-defined]
            server.posts[server.role] += 1  # type: ignore[attr-defined]
        if server.role == "dies":  # type: ignore[attr-defined]
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self._answer()


@pytest.fixture
def pods() -> Iterator[tuple[dict[str, int], Counter[str]]]:
    """Ports of a `good` pod, a pod that `dies` after reading each POST, and a `gone` one (nothing listens), and the
    POSTs each of them received."""
    posts: Counter[str] = Counter()
    lock = threading.Lock()
    servers = []
    for role in ("good", "dies"):
        server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Pod)
        server.role, server.posts, server.lock = role, posts, lock  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield {"good": servers[0].server_address[1], "dies": servers[1].server_address[1], "gone": free_port()}, posts
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _haproxy(first: int, second: int, tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    port = free_port()
    text = HAPROXY_CFG.read_text().replace("bind :8080", f"bind 127.0.0.1:{port}")
    text = text.replace("pod1:8000", f"127.0.0.1:{first}").replace("pod2:8000", f"127.0.0.1:{second}")
    text = text.replace("    server pod3 pod3:8000 check\n", "")
    conf = tmp_path / "haproxy.cfg"
    conf.write_text(text)
    proc = subprocess.Popen([binary, "-db", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(proc, url + "/readyz")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _balancer(kind: str, first: int, second: int, tmp_path: Path) -> Iterator[str]:
    if kind == "haproxy":
        yield from _haproxy(first, second, tmp_path)
        return
    proc = NginxProcess([f"127.0.0.1:{first}", f"127.0.0.1:{second}"]).start()
    try:
        yield proc.url
    finally:
        proc.cleanup()


BALANCERS = [
    pytest.param("nginx", marks=pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (CI "
                                                   "installs nginx-light in .ci/run)")),
    pytest.param("haproxy", marks=pytest.mark.skipif(shutil.which("haproxy") is None and not Path(
        "/usr/sbin/haproxy").exists(), reason="haproxy is not installed (CI installs it in .ci/run)")),
]


def _post(url: str) -> int:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code


@pytest.mark.parametrize("kind", BALANCERS)
def test_a_refused_connection_is_retried_on_another_pod(kind: str, pods: tuple[dict[str, int], Counter[str]],
                                                        tmp_path: Path) -> None:
    ports, posts = pods
    for url in _balancer(kind, ports["gone"], ports["good"], tmp_path):
        assert [_post(url) for _ in range(POSTS)] == [200] * POSTS
    assert posts == {"good": POSTS}


@pytest.mark.parametrize("kind", BALANCERS)
def test_a_post_that_reached_a_pod_is_never_sent_again(kind: str, pods: tuple[dict[str, int], Counter[str]],
                                                       tmp_path: Path) -> None:
    ports, posts = pods
    for url in _balancer(kind, ports["dies"], ports["good"], tmp_path):
        codes = [_post(url) for _ in range(POSTS)]
    assert posts["dies"] >= 1, "no POST reached the pod that dies: the scenario did not happen"
    assert posts["dies"] + posts["good"] == POSTS  # each POST reached exactly one pod
    assert codes.count(502) == posts["dies"] and codes.count(200) == posts["good"], (codes, posts)


def test_the_configs_say_the_rule() -> None:
    """Spelled out, for balancers whose versions behave otherwise than those tested above: nginx without
    `non_idempotent`, HAProxy retrying connection failures only, each redispatching to another pod."""
    nginx = (ROOT / "ops" / "nginx" / "kvstash-proxy.conf").read_text()
    (rule,) = [line for line in nginx.splitlines() if line.startswith("proxy_next_upstream ")]
    assert "error" in rule.split() and "non_idempotent" not in rule
    haproxy = [line.split("#")[0].split() for line in HAPROXY_CFG.read_text().splitlines()]
    assert ["retry-on", "conn-failure"] in haproxy and ["option", "redispatch", "1"] in haproxy
    assert ["option", "httpchk", "GET", "/readyz"] in haproxy  # a draining pod (503) leaves the rotation
