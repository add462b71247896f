"""One codec plan per model in Redis, so every pod of a fleet means the same codec by `int4` and `int2`.

The first pod to start on a model with no stored plan makes one (`cachestore.codec.names.make_plan`) and stores it
with SET NX; a pod that starts meanwhile makes its own, loses the SET NX and takes the stored one, so both serve
the winner's. A pod that cannot read Redis, or reads a plan it cannot use, serves its own plan without storing it:
the codec spec is part of every key's model fingerprint, so a different plan writes and reads other keys and the
two never mix.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from cachestore.codec.names import CodecPlan
from cachestore.errors import ConfigError
from cachestore.keys import KeySpace

log = logging.getLogger(__name__)
PLAN_TTL_S = 30 * 86400  # slid by every pod that starts on the model


@dataclass(frozen=True)
class Agreed:
    """The plan a pod serves and how it came by it: "stored" (read back), "written" (made here and stored) or
    "local: <why>" (made here, not shared)."""

    plan: CodecPlan
    how: str


async def agree(client: Any, keys: KeySpace, model: str, make: Callable[[], Awaitable[CodecPlan]],
                fits: Callable[[CodecPlan], None], ttl_s: int = PLAN_TTL_S) -> Agreed:
    """The plan of `model` (a 16-hex model id) every pod of the namespace serves: the stored one if `fits` accepts
    it (it raises ConfigError otherwise), else the one `make` makes, stored with SET NX unless another pod's came
    first."""
    key = keys.codec_plan(model)
    try:
        stored = await client.getex(key, ex=ttl_s)
    except (RedisError, OSError) as exc:
        return Agreed(await make(), f"local: Redis unavailable ({type(exc).__name__})")
    if stored is not None:
        return await _take(stored, make, fits)
    mine = await make()
    try:
        if await client.set(key, mine.to_json(), nx=True, ex=ttl_s):
            return Agreed(mine, "written")
        stored = await client.get(key)
    except (RedisError, OSError) as exc:
        return Agreed(mine, f"local: Redis unavailable ({type(exc).__name__})")
    if stored is None:  # evicted or flushed between the two calls: this pod's is as good as any
        return Agreed(mine, "local: the stored plan vanished")
    return await _take(stored, lambda: _ready(mine), fits)


async def stored_plan(client: Any, keys: KeySpace, model: str) -> CodecPlan | None:
    """The plan stored for `model`, or None (none, or one unreadable)."""
    raw = await client.get(keys.codec_plan(model))
    try:
        return None if raw is None else CodecPlan.from_json(raw)
    except ConfigError:
        return None


async def stored_plans(client: Any, keys: KeySpace) -> dict[str, dict[str, Any]]:
    """Every model's stored plan in the namespace, by model id: its fields, or {"error": why} for one unreadable."""
    out: dict[str, dict[str, Any]] = {}
    async for raw_key in client.scan_iter(match=keys.codec_plan("*"), count=1000):
        key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
        raw = await client.get(key)
        if raw is None:
            continue
        model = key.rpartition(":")[2]
        try:
            plan = CodecPlan.from_json(raw)
        except ConfigError as exc:
            out[model] = {"error": str(exc)}
            continue
        out[model] = {"layers": plan.layers, "rope": plan.rope, "specs": dict(plan.specs), "source": plan.source,
                      "made_by": plan.made_by}
    return dict(sorted(out.items()))


async def _take(raw: bytes, make: Callable[[], Awaitable[CodecPlan]],
                fits: Callable[[CodecPlan], None]) -> Agreed:
    try:
        plan = CodecPlan.from_json(raw)
        fits(plan)
    except ConfigError as exc:
        log.warning("the stored codec plan is not this model's (%s): serving this pod's own", exc)
        return Agreed(await make(), f"local: stored plan unusable ({exc})")
    return Agreed(plan, "stored")


async def _ready(plan: CodecPlan) -> CodecPlan:
    return plan
