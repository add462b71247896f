"""`make gpu-check`: one short check of the hf engine on CUDA in bf16: a resumed 2048- and 8128-token history against
its prefill, and what the fetch plan decides from those two timings. Without a CUDA device it says so and exits 0.

Each context: one full prefill (the recompute, after a warm-up), then the pod's hit path three times over a private
redis-server (lookup of the int8 blocks, rehydration, one forward step: ops/bench/resume/command.py's), then the
fetch plan fed with that prefill rate and that read rate (service.cache.fetchplan) for the whole history: it should
fetch where the hit was the faster and recompute where it was not.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from typing import Any

CONTEXTS = (2048, 8128)
MODE = "int8"


def _cuda() -> str | None:
    """The CUDA device's name, or None (and why, on stderr) when there is none."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        build = torch.version.cuda or "no CUDA (a CPU build)"
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, built with {build}): nothing to check",
              flush=True)
        return None
    return str(torch.cuda.get_device_name(0))


def decide(context: int, block_tokens: int, prefill_s: float, hit_s: float, nbytes: int) -> dict[str, Any]:
    """The fetch plan for a `context`-token history of `nbytes` in blocks of `block_tokens`, fed with one prefill of
    it (`prefill_s`) and one read of it (its hit, `hit_s`, an upper bound on the read), and whether it chose the
    faster of the two."""
    from service.cache.fetchplan import MIN_LINK_SAMPLES, RECOMPUTE_MARGIN, FetchPlanner  # noqa: PLC0415

    blocks = context // block_tokens
    planner = FetchPlanner("auto", block_tokens, budget_s=60.0)
    planner.observe_prefill(context, prefill_s)
    for _ in range(MIN_LINK_SAMPLES):
        planner.observe_fetch(nbytes, blocks, hit_s)
    plan = planner.plan(blocks, nbytes / blocks)
    fetches = plan.blocks > 0
    # near a tie the plan reads (RECOMPUTE_MARGIN: a hit leaves the cores to others): right unless clearly dearer
    right = hit_s <= RECOMPUTE_MARGIN * prefill_s if fetches else hit_s > prefill_s
    return {"context": context, "decision": plan.decision, "blocks": plan.blocks, "fetch_s": plan.fetch_s,
            "recompute_s": plan.recompute_s, "fetch_won": hit_s < prefill_s, "right": right}


async def _check(device: str) -> list[dict[str, Any]]:
    from ops.bench.resume.command import prompt_ids  # noqa: PLC0415
    from ops.bench.resume.methods import ResumeBench  # noqa: PLC0415
    from ops.redisproc import RedisProcess  # noqa: PLC0415
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415
    from service.runtime import threads  # noqa: PLC0415

    engine = threads.compute_executor().submit(HfEngine.load, "smollm2", device="cuda").result()
    print(f"gpu-check: {device}, smollm2 in {engine.loaded.dtype}", flush=True)
    args = argparse.Namespace(block_tokens=64, repeat=3, recompute_repeat=1, frame_key="")
    server = RedisProcess().start()
    rows = []
    try:
        bench = ResumeBench(engine, server.url, args)
        ids = prompt_ids(engine, max(CONTEXTS) + 1)
        for context in CONTEXTS:
            prompt = ids[:context + 1]
            times, kv = bench.recompute(prompt)
            hit, floor = await bench.kvstash(MODE, prompt, kv)
            prefill_s, hit_s = statistics.median(times), hit["ttft_ms_p50"] / 1000
            row = {"context": context, "prefill_ms": prefill_s * 1000, "hit_ms": hit["ttft_ms_p50"],
                   "floor_ms": floor["ttft_ms_p50"], "speedup": prefill_s / hit_s, "bytes": hit["bytes"],
                   **decide(context, args.block_tokens, prefill_s, hit_s, hit["bytes"])}
            print(f"gpu-check: {context} tokens: prefill {row['prefill_ms']:.1f} ms, {MODE} hit {row['hit_ms']:.1f} ms "
                  f"(floor {row['floor_ms']:.1f}), {row['speedup']:.2f}x; the plan says {row['decision']} "
                  f"({'right' if row['right'] else 'WRONG'})", flush=True)
            rows.append(row)
    finally:
        server.cleanup()
        engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m ops.gpucheck", description=__doc__.split("\n")[0]).parse_args(argv)
    device = _cuda()
    if device is None:
        return 0
    rows = asyncio.run(_check(device))
    return 0 if all(r["right"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
