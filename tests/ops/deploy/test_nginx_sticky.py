"""The balancer of `kvstash bench fleet`: the nginx config ops/pods.py renders (sticky with `hash_header`), and
(where nginx is installed) that it really keeps a session on one pod, names the pod that answered, and takes a pod
added while it runs (a scale-out)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest

from ops.pods import NginxProcess, nginx_binary, render_nginx_conf, sticky_directive
from ops.redisproc import free_port
from tests.balancers import upstream_block
from tests.paths import ROOT

NGINX_DIR = ROOT / "ops" / "nginx"


def test_rendered_config_hashes_the_header_consistently(tmp_path: Path) -> None:
    upstreams = ["127.0.0.1:9001", "127.0.0.1:9002"]
    sticky = upstream_block(render_nginx_conf(upstreams, 9000, tmp_path, hash_header="X-Session-Id"))
    assert re.search(r"^\s*hash \$http_x_session_id consistent;$", sticky, re.M), sticky
    assert sticky.count("server 127.0.0.1:900") == 2
    plain = upstream_block(render_nginx_conf(upstreams, 9000, tmp_path))
    assert "hash" not in plain  # round robin unless asked
    with pytest.raises(ValueError):
        sticky_directive("X-Session-Id; include /etc/passwd")  # a header name, nothing else, reaches the config


def test_operator_example_is_the_same_directive() -> None:
    example = upstream_block((NGINX_DIR / "sticky-sessions.conf.example").read_text())
    assert sticky_directive("X-Session-Id") in example


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (CI installs nginx-light in .ci/run)")
def test_nginx_keeps_each_session_on_one_pod(fake_pods: list[int], tmp_path: Path) -> None:
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_conf([f"127.0.0.1:{p}" for p in fake_pods], free_port(), tmp_path, "X-Session-Id"))
    binary = nginx_binary()
    assert binary is not None
    check = subprocess.run([binary, "-t", "-c", str(conf), "-p", str(tmp_path)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stderr
    proc = NginxProcess([f"127.0.0.1:{p}" for p in fake_pods], hash_header="X-Session-Id").start()
    try:
        with httpx.Client() as client:
            served = {s: {client.get(proc.url + "/v1/models", headers={"X-Session-Id": f"s-{s}"}).headers["x-kv-pod"]
                          for _ in range(4)} for s in range(12)}
            # no header: nginx falls back to round robin (ops/nginx/sticky-sessions.conf.example says so)
            anonymous = {client.get(proc.url + "/v1/models").headers["x-kv-pod"] for _ in range(6)}
    finally:
        proc.cleanup()
    assert all(len(pods) == 1 for pods in served.values()), served  # every request of a session: one pod
    assert len({next(iter(p)) for p in served.values()}) >= 2  # and the sessions spread over the pods
    assert anonymous == {"pod1", "pod2", "pod3"}


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (CI installs nginx-light in .ci/run)")
def test_nginx_names_the_pod_and_takes_one_added_on_a_reload(fake_pods: list[int]) -> None:
    first, *others = [f"127.0.0.1:{p}" for p in fake_pods]
    proc = NginxProcess([first]).start()
    try:
        with httpx.Client() as client:
            assert {client.get(proc.url + "/v1/models").headers["x-kv-upstream"] for _ in range(3)} == {first}
            proc.set_upstreams([first, *others])  # returns once the last one has answered through it
            seen = {client.get(proc.url + "/v1/models").headers["x-kv-upstream"] for _ in range(9)}
    finally:
        proc.cleanup()
    assert seen == {first, *others}  # round robin over all three from now on
