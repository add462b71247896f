"""A pod with a frame key through the request path: a signed hit replies as a no-cache pod; a value moved onto the
key the next turn looks up is a counted miss that still replies as a no-cache pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachestore.errors import ConfigError
from ops.redisproc import RedisProcess
from service.app import shared_redis
from service.settings import settings_from_env
from tests.faultkit import (
    QUESTIONS,
    SYSTEM,
    chat,
    metric,
    pod_client,
    reference_reply,
    reply_of,
    uncached_pod,
    wait_written,
)


def test_signed_hit_and_moved_value(redis_server: RedisProcess, tiny_model: Any, figures: dict[str, object]) -> None:
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    with pod_client(redis_server.url, tiny_model, frame_key="fk-1") as pod, \
            uncached_pod(tiny_model) as plain:
        first = chat(pod, messages)
        wait_written(pod)
        hit = chat(pod, messages)
        assert hit.headers["x-kv-cache"] == "hit"
        assert reply_of(hit) == reply_of(first) == reference_reply(plain, hit)
        r = redis_server.client()
        keys = sorted(r.scan_iter(match="kvstash:blk:*"))
        assert len(keys) >= 2
        r.set(keys[0], r.get(keys[1]))  # a well-formed, signed value moved to another block's key
        r.close()
        again = chat(pod, messages)
        assert again.headers["x-kv-cache"] != "hit"
        assert reply_of(again) == reference_reply(plain, again)
        assert metric(pod, "kvstash_cache_rejected_total", 'reason="mac"') == 1
        figures.update(requests=3, correct=3, signed_hit=True, moved_value=again.headers["x-kv-cache"],
                       rejected_mac=1)


def test_frame_keys_come_from_files_as_container_secrets_do(tmp_path: Path) -> None:
    key = tmp_path / "frame_key"
    key.write_text("f" * 64 + "\n")
    assert settings_from_env({"KVSTASH_FRAME_KEY_FILE": str(key)}).frame_key == "f" * 64
    with pytest.raises(ConfigError, match="KVSTASH_FRAME_KEY_FILE: cannot read"):
        settings_from_env({"KVSTASH_FRAME_KEY_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="not both"):
        settings_from_env({"KVSTASH_FRAME_KEY_FILE": str(key), "KVSTASH_FRAME_KEY": "e" * 64})


def test_an_unsigned_pod_says_so_in_metrics(redis_server: RedisProcess, tiny_model: Any) -> None:
    with pod_client(redis_server.url, tiny_model) as unsigned:
        assert metric(unsigned, "kvstash_frames_signed") == 0
    with pod_client(redis_server.url, tiny_model, frame_key="k" * 32) as signed:
        assert metric(signed, "kvstash_frames_signed") == 1


def test_only_a_redis_beyond_this_machine_is_shared() -> None:
    """Where an unsigned pod warns at start-up: a Redis other machines' clients can write to."""
    mine = ["redis://127.0.0.1:6379/0", "redis://localhost", "unix:///run/redis.sock", "rediss://[::1]:6380",
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"]
    shared = ["redis://redis:6379/0", "redis://:pw@10.0.0.5:6379", "redis+cluster://127.0.0.1:7000,redis-2:7001",
              "redis://[fd00::1]:6379"]
    assert [shared_redis(u) for u in mine] == [False] * len(mine)
    assert [shared_redis(u) for u in shared] == [True] * len(shared)
