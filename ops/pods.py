"""Start and stop pod and nginx processes on free ports (the demo, load benchmark and end-to-end tests)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ops.redisproc import free_port

NGINX_TEMPLATE = Path(__file__).parent / "nginx" / "demo.conf.template"


class ProcessError(RuntimeError):
    """A pod or balancer could not be started."""


@dataclass
class PodProcess:
    """One `kvstash serve` subprocess."""

    name: str
    redis_url: str
    model: str = "smollm2"
    extra_args: Sequence[str] = ()
    no_cache: bool = False
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    log_path: Path | None = field(default=None, init=False)
    ready_path = "/readyz"  # answers 200 once the pod takes requests

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PodProcess:
        """Spawn the pod; call `wait_ready()` (several pods can load their models at once)."""
        self.port = self.port or free_port()
        args = [sys.executable, "-m", "ops.cli", "serve", "--port", str(self.port), "--model", self.model,
                "--redis-url", self.redis_url, "--pod-name", self.name, "--log-level", "warning",
                *self.extra_args]
        if self.no_cache:
            args.append("--no-cache")
        fd, log = tempfile.mkstemp(prefix=f"kvstash-{self.name}-", suffix=".log")
        self.log_path = Path(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(args, stdout=fd, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        os.close(fd)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> PodProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ProcessError(f"pod {self.name} exited:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ProcessError(f"pod {self.name} not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.log_path or Path("/nonexistent")).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def terminate(self, grace_s: float) -> dict[str, float | int | bool | None]:
        """SIGTERM, then at most `grace_s` for the process to exit before SIGKILL, as a kubelet ends a container at
        the end of its terminationGracePeriodSeconds: {"exit_code", "killed" (the grace ran out), "exit_s"}."""
        proc, started = self.proc, time.monotonic()
        if proc is None or proc.poll() is not None:
            self.proc = None
            return {"exit_code": proc.returncode if proc else None, "killed": False, "exit_s": 0.0}
        proc.send_signal(signal.SIGTERM)
        killed = False
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            killed = True
            proc.kill()
            proc.wait(timeout=10)
        self.proc = None
        return {"exit_code": proc.returncode, "killed": killed, "exit_s": time.monotonic() - started}

    def cleanup(self) -> None:
        self.stop()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


def nginx_binary() -> str | None:
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def sticky_directive(header: str) -> str:
    """nginx's consistent hash on a request header: every request carrying the same value goes to the same pod
    (the sticky-sessions alternative to kvstash; see ops/nginx/sticky-sessions.conf.example)."""
    if not re.fullmatch(r"[A-Za-z0-9-]+", header):
        raise ValueError(f"not an HTTP header name: {header!r}")
    return f"hash $http_{header.lower().replace('-', '_')} consistent;"


def render_nginx_conf(upstreams: Sequence[str], port: int, workdir: Path, hash_header: str | None = None,
                      max_fails: int = 1) -> str:
    """The demo balancer: ops/nginx/demo.conf.template with its upstream servers and paths filled in; round robin,
    or sticky on `hash_header` (a consistent hash of that header's value). `max_fails` 0: nginx never passes over a
    pod that failed; a refused connection is still tried again on the next pod (kvstash-proxy.conf)."""
    servers = "\n".join(f"        server {u} max_fails={max_fails} fail_timeout=5s;" for u in upstreams)
    if hash_header is not None:
        servers = f"        {sticky_directive(hash_header)}\n{servers}"
    text = NGINX_TEMPLATE.read_text()
    return text.replace("@UPSTREAM_SERVERS@", servers).replace("@PORT@", str(port)).replace(
        "@WORKDIR@", str(workdir)).replace("@NGINX_DIR@", str(NGINX_TEMPLATE.parent.resolve()))


@dataclass
class NginxProcess:
    """nginx in front of `upstreams` (host:port strings): round robin, or sticky on the `hash_header` header."""

    upstreams: Sequence[str]
    port: int = 0
    hash_header: str | None = None
    workdir: Path | None = None
    # 1: a pod that failed a request is passed over for 5 s, and after that until a request to it succeeds (nginx
    # probes it with one request at a time): a pod restarted and slow to answer its first request counts as down
    max_fails: int = 1
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> NginxProcess:
        binary = nginx_binary()
        if binary is None:
            raise ProcessError("nginx is not installed")
        self.port = self.port or free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="kvstash-nginx-"))
        # a master started as root runs its worker as nobody: it must reach the temp dirs the master makes here
        self.workdir.chmod(0o755)
        conf = self.workdir / "nginx.conf"
        conf.write_text(render_nginx_conf(self.upstreams, self.port, self.workdir, self.hash_header, self.max_fails))
        check = subprocess.run([binary, "-t", "-c", str(conf), "-p", str(self.workdir)], capture_output=True,
                               text=True, check=False)
        if check.returncode != 0:
            raise ProcessError(f"nginx rejected its config: {check.stderr.strip()}")
        self.proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(self.workdir), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/healthz", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise ProcessError("nginx did not start listening")

    def set_upstreams(self, upstreams: Sequence[str], timeout_s: float = 10.0) -> None:
        """Serve `upstreams` from now on (a pod added to the balancer): the config rewritten and checked, then nginx
        reloaded (SIGHUP: new workers take the new list, old ones finish their requests); returns once a request has
        reached the last of them (the demo template names the pod that answered in X-Kv-Upstream)."""
        binary, workdir = nginx_binary(), self.workdir
        if binary is None or workdir is None or self.proc is None:
            raise ProcessError("nginx is not running")
        conf = workdir / "nginx.conf"
        conf.write_text(render_nginx_conf(upstreams, self.port, workdir, self.hash_header, self.max_fails))
        check = subprocess.run([binary, "-t", "-c", str(conf), "-p", str(workdir)], capture_output=True, text=True,
                               check=False)
        if check.returncode != 0:
            raise ProcessError(f"nginx rejected its config: {check.stderr.strip()}")
        self.upstreams = list(upstreams)
        self.proc.send_signal(signal.SIGHUP)
        deadline, newest = time.monotonic() + timeout_s, upstreams[-1]
        while time.monotonic() < deadline:  # no session header: round robin, even on a sticky balancer
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).headers.get("x-kv-upstream", "") == newest:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise ProcessError(f"nginx did not route to {newest} within {timeout_s:.0f} s of its reload")

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
