"""A pod with a frame key through the request path: a signed hit replies as a no-cache pod; a value moved onto the
key the next turn looks up is a counted miss that still replies as a no-cache pod."""

from __future__ import annotations

from typing import Any

from ops.redisproc import RedisProcess
from tests.faultkit import QUESTIONS, SYSTEM, chat, metric, pod_client, reference_reply, reply_of, wait_written


def test_signed_hit_and_moved_value(redis_server: RedisProcess, tiny_model: Any, figures: dict[str, object]) -> None:
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    with pod_client(redis_server.url, tiny_model, frame_key="fk-1") as pod, \
            pod_client(redis_server.url, tiny_model, cache_enabled=False) as plain:
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
