"""ops/nginx/nginx.conf really balances round robin and streams unbuffered (Debian's nginx, local upstreams).

The compose config names its upstreams pod1..pod3:8000, which resolve only on the compose network;
nginx resolves upstream names once at start, so `nginx -t` fails here on them. The tests use the
file itself with exactly three substitutions: the upstream server addresses (pod1:8000 -> a local
port), the listen port, and the include path of kvstash-proxy.conf (and the slow-header test a
shorter header timeout). Everything else is the real file.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.pods import NginxProcess, nginx_binary, render_nginx_conf
from ops.redisproc import free_port
from tests.balancers import upstream_block, wait_listening
from tests.paths import ROOT

NGINX_DIR = ROOT / "ops" / "nginx"
NGINX = nginx_binary()
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (CI installs nginx-light in .ci/run)")


def real_conf(ports: list[int], listen: int) -> str:
    text = (NGINX_DIR / "nginx.conf").read_text()
    for i, port in enumerate(ports, start=1):
        text = text.replace(f"server pod{i}:8000 ", f"server 127.0.0.1:{port} ")
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{listen};")
    return text.replace("include /etc/nginx/kvstash-proxy.conf;", f"include {NGINX_DIR / 'kvstash-proxy.conf'};")


HEADER_TIMEOUT_S = 1  # the slow-header test's, instead of the file's 10 s


@pytest.fixture
def balancer(fake_pods: list[int], tmp_path: Path) -> Iterator[str]:
    port = free_port()
    conf = tmp_path / "nginx.conf"
    text = real_conf(fake_pods, port).replace("worker_processes auto;", "worker_processes 1;")
    assert "client_header_timeout 10s;" in text
    conf.write_text(text.replace("client_header_timeout 10s;", f"client_header_timeout {HEADER_TIMEOUT_S}s;"))
    assert NGINX is not None
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp_path), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(proc, url + "/nginx-health")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_real_config_passes_nginx_t(fake_pods: list[int], tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"
    conf.write_text(real_conf(fake_pods, free_port()))
    assert NGINX is not None
    done = subprocess.run([NGINX, "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "syntax is ok" in done.stderr and "test is successful" in done.stderr


def test_upstream_is_plain_round_robin() -> None:
    block = upstream_block((NGINX_DIR / "nginx.conf").read_text())
    assert re.findall(r"server (pod\d):8000", block) == ["pod1", "pod2", "pod3"]
    for sticky in ("ip_hash", "hash ", "sticky", "least_conn", "random"):
        assert sticky not in block
    demo = upstream_block((NGINX_DIR / "demo.conf.template").read_text())
    same = re.sub(r"server pod\d:8000[^;]*;", "", block)
    assert demo.replace("@UPSTREAM_SERVERS@", "").split() == same.split()  # the demo differs only in servers


def test_nginx_balances_round_robin(balancer: str) -> None:
    with httpx.Client() as client:
        served = [client.get(balancer + "/v1/models").headers["x-kv-pod"] for _ in range(12)]
    assert sorted(set(served)) == ["pod1", "pod2", "pod3"]
    for i in range(0, 12, 3):
        assert sorted(served[i:i + 3]) == ["pod1", "pod2", "pod3"], served  # every window of 3 hits each pod
    assert served[:3] * 4 == served


def test_nginx_streams_without_buffering(balancer: str) -> None:
    with httpx.Client(timeout=10) as client, client.stream("GET", balancer + "/stream") as resp:
        t0 = time.monotonic()
        chunks = resp.iter_text()
        first = next(chunks)
        first_at = time.monotonic() - t0
        rest = "".join(chunks)
    assert first.startswith("data: pod") and first_at < 0.8  # the second chunk comes 1 s later
    assert rest.rstrip().endswith(" 1")


def test_both_configs_time_out_slow_headers() -> None:
    """uvicorn has no header timeout (`kvstash serve --help`): the shipped balancer configs must set one."""
    for name in ("nginx.conf", "demo.conf.template"):
        found = re.findall(r"^\s*client_header_timeout (\d+)s;", (NGINX_DIR / name).read_text(), re.M)
        assert found and 0 < int(found[0]) <= 30, (name, found)
    help_text = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--help"], capture_output=True, text=True,
                               check=True, cwd=NGINX_DIR.parents[1]).stdout
    assert "client_header_timeout" in " ".join(help_text.split())  # and `kvstash serve` says so


def test_slow_headers_are_dropped_and_starve_nobody(balancer: str) -> None:
    host, port = balancer.removeprefix("http://").split(":")
    loris = []
    for _ in range(20):  # connections that never finish their headers
        sock = socket.create_connection((host, int(port)), timeout=HEADER_TIMEOUT_S + 5)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        loris.append(sock)
    t0 = time.monotonic()
    assert httpx.get(balancer + "/v1/models", timeout=5).status_code == 200  # honest clients are served meanwhile
    for sock in loris:
        assert sock.recv(4096) == b"", "nginx answered a request whose headers never ended"  # closed by nginx
        sock.close()
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 4  # dropped after the header timeout, not held


def test_body_limit(balancer: str) -> None:
    resp = httpx.post(balancer + "/v1/chat/completions", content=b"x" * ((1 << 20) + 1))
    assert resp.status_code == 413


def test_demo_template_renders_and_serves(fake_pods: list[int], tmp_path: Path) -> None:
    text = render_nginx_conf([f"127.0.0.1:{p}" for p in fake_pods], free_port(), tmp_path)
    assert "@" not in text.replace("$proxy_add_x_forwarded_for", "")
    proc = NginxProcess([f"127.0.0.1:{p}" for p in fake_pods]).start()
    try:
        served = {httpx.get(proc.url + "/v1/models").headers["x-kv-pod"] for _ in range(3)}
        assert served == {"pod1", "pod2", "pod3"}
    finally:
        proc.cleanup()
