"""Shared fixtures: private redis-server processes on free ports, never 127.0.0.1:6379."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ops.redisproc import RedisCluster, RedisProcess


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    """A fresh, empty redis-server for one test."""
    server = RedisProcess().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def shared_redis_server() -> Iterator[RedisProcess]:
    """One redis-server for a whole run; tests using it must use their own namespace."""
    server = RedisProcess().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A real 3-primary Redis Cluster, shared by the run (tests use their own namespaces)."""
    cluster = RedisCluster(primaries=3).start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def redis_cluster_with_replicas() -> Iterator[RedisCluster]:
    """A 3-primary cluster with one replica per primary, for failover tests."""
    cluster = RedisCluster(primaries=3, replicas=1).start()
    try:
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture(scope="session")
def tiny_model():  # type: ignore[no-untyped-def]
    """The tiny random-weight Llama (with SmolLM2's tokenizer), loaded once per run."""
    from service.models import load_model  # noqa: PLC0415

    return load_model("tiny-random")


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
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": request.node.nodeid, **found}) + "\n")
