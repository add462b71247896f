"""A pod's codec by name: `int4` or `int2` becomes, at start, the spec of the fleet's codec plan for the served model.

The plan (cachestore.codec.names) is read from Redis, or made here from the KV of a built-in calibration text (the
source of Python's `textwrap`, a few hundred tokens: one prefill) and stored for every other pod
(cachestore.codecplans). Every other codec means itself.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import textwrap

import numpy as np

from cachestore.codec.arrays import Array
from cachestore.codec.names import SINK_TOKENS, CodecPlan, is_named, is_published, make_plan
from cachestore.codec.rope import Rope
from cachestore.codecplans import Agreed, agree
from cachestore.keys import KeySpace
from cachestore.redisclient import make_client
from cachestore.settings import StoreSettings
from service.engines import Engine
from service.engines.generation import GenParams, GenRequest
from service.runtime import threads
from service.settings import PodSettings

log = logging.getLogger(__name__)
CALIBRATION_TOKENS = SINK_TOKENS + 448  # what the plan is made on: the sink block (skipped) and 448 tokens more


def model_id(engine: Engine, block_tokens: int) -> str:
    """The 16-hex id of the served model without a codec: what its plan is stored under."""
    return engine.fingerprint(block_tokens, "").short()


def calibration_kv(engine: Engine) -> Array:
    """The KV [layers, 2, kv_heads, tokens, head_dim] of the calibration text, as the engine computes it."""
    ids = engine.text_ids(inspect.getsource(textwrap))[:min(CALIBRATION_TOKENS, engine.geometry.max_context - 1)]
    generation = engine.generate(GenRequest(ids, None, GenParams(max_tokens=1)))
    return generation.kv[:, :, :, :len(ids)]


def own_plan(engine: Engine, rope: Rope | None, made_by: str = "") -> CodecPlan:
    """The plan this engine's model gets when none is stored, for an engine that declares `rope` (or None)."""
    geo, weights = engine.geometry, engine.fingerprint(1, "").model_id
    shape = (geo.num_layers, 2, geo.kv_heads, SINK_TOKENS, geo.head_dim)
    kv = (np.random.default_rng(0).standard_normal(shape, dtype=np.float32) if is_published(weights)
          else calibration_kv(engine))  # a published model's tables need no calibration: a block to try them on
    return make_plan(kv, rope, weights, made_by)


def written_out(codecs: str, engine: Engine, rope: Rope | None) -> tuple[str, CodecPlan | None]:
    """Comma-separated `codecs` with each name (int4, int2) written out as this engine's own plan has it (what a pod
    serves where no other pod's plan is stored), and that plan (None: no name among them)."""
    listed = [c.strip() for c in codecs.split(",") if c.strip()]
    if not any(map(is_named, listed)):
        return codecs, None
    plan = own_plan(engine, rope)
    return ",".join(plan.spec(c.lower()) if is_named(c) else c for c in listed), plan


async def resolve(settings: PodSettings, engine: Engine, store: StoreSettings) -> tuple[PodSettings, Agreed | None]:
    """`settings` with a named codec replaced by the spec of the plan every pod of the namespace (`store`'s) serves
    for this model, and how the plan was agreed; unchanged (and None) for a spec, or a pod without the cache."""
    if not is_named(settings.codec) or not settings.cache_enabled:
        return settings, None
    geo, rope = engine.geometry, engine.kv_layout.rope

    async def make() -> CodecPlan:
        return await asyncio.wrap_future(threads.compute_executor().submit(own_plan, engine, rope, settings.pod_name))

    def fits(plan: CodecPlan) -> None:
        plan.check(geo.num_layers, geo.head_dim, rope)

    client = make_client(store)
    try:
        agreed = await agree(client, KeySpace(store.namespace, store.index_shards), model_id(engine,
                             settings.block_tokens), make, fits)
    finally:
        await client.aclose()
    spec = agreed.plan.spec(settings.codec.strip().lower())
    log.info("codec %s is %s for this model (plan %s; %s)", settings.codec, spec, agreed.how, agreed.plan.source)
    return settings.with_overrides(codec=spec), agreed
