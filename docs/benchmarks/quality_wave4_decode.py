"""Decode speed of codec specs on SmolLM2-shaped synthetic KV [30, 2, 3, 2048, 64], one thread, median of 9:
one 2048-token frame decoded to fp16 (as `kvstash bench codec` times it) and 32 blocks of 64 tokens decoded
into a slice of an fp32 context (as the hf pod rehydrates). PYTHONPATH picks the code under test, e.g. an
older tree from `git archive`:

    PYTHONPATH=. .venv/bin/python docs/benchmarks/quality_wave4_decode.py int4+zstd/plain int4+zstd/k8=18.20
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

import cachestore
from cachestore.codec import Codec


def _median_s(fn: Callable[[], object], repeat: int = 9) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(30, 2, 3, 2048, 64, generator=gen)  # [L, 2, H, T, D]
    kv[:, :1] *= torch.rand(30, 1, 3, 1, 64, generator=gen) ** 4 * 8 + 0.5  # a few large key channels
    context = torch.empty_like(kv)
    fp16_mb = kv.numel() * 2 / 1e6
    tree = cachestore.__file__.rsplit("/cachestore", 1)[0]
    for spec in sys.argv[1:]:
        codec = Codec(spec)
        frame = codec.encode(kv.half())
        whole = fp16_mb / _median_s(lambda c=codec, f=frame: c.decode(f))
        blocks = [codec.encode(kv[:, :, :, i:i + 64]) for i in range(0, 2048, 64)]

        def rehydrate(c: Codec = codec, bs: list[bytes] = blocks) -> None:
            for j, f in enumerate(bs):
                c.decode_into(f, context[:, :, :, j * 64:(j + 1) * 64])

        per_block_us = _median_s(rehydrate) / len(blocks) * 1e6
        print(f"{tree:<14} {spec:<26} one 2048-token frame to fp16 {whole:6.0f} MB/s; "
              f"64-token blocks into fp32 {per_block_us:5.0f} us/block", flush=True)


if __name__ == "__main__":
    main()
