"""A whole reply after a hit, not only its first token: TTFT and total time of an N-token reply on the pod's hit path
(SmolLM2; hf or llamacpp), p50 of `--repeat` runs. hf: the first step after a hit reads the landed frames in place
and the context is written at the second step, so a reply longer than one token pays for it there; llama.cpp: the
finished sequence's state is read back for the write-back (BENCHMARKS.md, sections 15, 16).

Run: PYTHONPATH=. .venv/bin/python docs/benchmarks/resume_reply.py --contexts 2048,8128 --mode int8 --tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from ops.bench.resume import SALT, ResumeBench, _prompt_ids


async def measure(args: argparse.Namespace, url: str) -> None:
    from service import threads  # noqa: PLC0415
    from service.engines import load_engine  # noqa: PLC0415
    from service.runner import GenParams  # noqa: PLC0415

    threads.one_core()
    engine = threads.compute_executor().submit(load_engine, args.engine, "smollm2", parallel=1).result()
    bench = ResumeBench(engine, url, argparse.Namespace(block_tokens=64, recompute_repeat=1))
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = _prompt_ids(engine, max(contexts) + 1)
    for context in contexts:
        prompt = ids[:context + 1]
        _, kv = bench.recompute(prompt)
        async with bench._pod("bench-reply", args.mode) as (pipeline, store):  # noqa: SLF001 - the bench's own pod
            await bench._store_history(pipeline, store, prompt, kv)  # noqa: SLF001
            ttft: list[float] = []
            total: list[float] = []
            tokens: Any = None
            for rep in range(args.repeat + 1):  # the first round warms up
                t0 = time.perf_counter()
                view, _ = await pipeline.lookup(SALT, prompt)
                gen = await pipeline.generate(prompt, view, GenParams(max_tokens=args.tokens))
                done = time.perf_counter() - t0
                if rep:
                    ttft.append(done - (gen.total_s - gen.ttft_s))
                    total.append(done)
                tokens = len(gen.token_ids)
        print(f"{args.engine} ctx {context} {args.mode} {args.tokens}-token reply ({tokens} tokens): ttft p50 "
              f"{statistics.median(ttft) * 1e3:.1f} total p50 {statistics.median(total) * 1e3:.1f} ms", flush=True)
    engine.close()


def main() -> None:
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--engine", default="hf", choices=["hf", "llamacpp"])
    p.add_argument("--contexts", default="2048,8128")
    p.add_argument("--mode", default="int8")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    server = RedisProcess().start()
    try:
        asyncio.run(measure(args, server.url))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
