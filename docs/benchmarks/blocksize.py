"""Block size with tails cached: hit rate, Redis keys and bytes per session, lookup round trips per turn.

A 10-turn stateless conversation (whole history resent, no session id) through one in-process pod per
block size, tiny-random model, exact codec, against a private Redis. Run: .venv/bin/python docs/benchmarks/blocksize.py
(resume times per block size: kvstash bench resume --block-tokens N).
"""

from __future__ import annotations

import json
import sys

from starlette.testclient import TestClient

from ops.redisproc import RedisProcess
from service.app import create_app
from service.models import load_model
from service.settings import PodSettings

TURNS = ["Tell me a story about a lighthouse.", "What happened next?", "Who else was there?", "Describe the sea.",
         "Was there a storm?", "How did it end?", "Give it a title.", "Summarise it.", "Who would like it?",
         "Thank you."]


def run(block: int, tiny: object) -> dict[str, object]:
    redis = RedisProcess().start()
    try:
        settings = PodSettings(model="tiny-random", redis_url=redis.url, codec="exact", block_tokens=block,
                               local_tier_bytes=0, namespace=f"bs{block}")
        with TestClient(create_app(settings, engine=tiny)) as c:
            store = c.app.state.pod.store  # type: ignore[attr-defined]
            messages = [{"role": "system", "content": "You tell long stories. " * 20}]
            possible = cached = 0
            previous = None
            trips = []
            for q in TURNS:
                messages.append({"role": "user", "content": q})
                before = store.stats().round_trips
                r = c.post("/v1/chat/completions", json={"model": "tiny-random", "messages": messages,
                                                         "max_tokens": 64, "temperature": 0}).json()
                trips.append(store.stats().round_trips - before)
                u = r["usage"]
                if previous is not None:
                    possible += previous
                    cached += min(u["prompt_tokens_details"]["cached_tokens"], previous)
                previous = u["prompt_tokens"] + u["completion_tokens"] - 1
                messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
            raw = redis.client()
            kinds = {k: 0 for k in ("blk", "tail", "ids")}
            nbytes = {k: 0 for k in kinds}
            for kind in kinds:
                for key in raw.scan_iter(match=f"bs{block}:{kind}:*"):
                    kinds[kind] += 1
                    nbytes[kind] += raw.strlen(key)
            return {"block_tokens": block, "hit_rate": cached / possible, "tokens": previous,
                    "keys": kinds, "bytes": nbytes, "round_trips_per_turn": trips}
    finally:
        redis.cleanup()


if __name__ == "__main__":
    tiny = load_model("tiny-random")
    rows = [run(b, tiny) for b in (16, 32, 64)]
    for row in rows:
        print(json.dumps(row))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(rows, out, indent=1)
