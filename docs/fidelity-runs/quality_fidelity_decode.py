"""Decode time of one 64-token block of synthetic SmolLM2-shaped KV into an fp32 context, per codec (one thread).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/fidelity-runs/quality_fidelity_decode.py
"""

from __future__ import annotations

import time

import torch

from cachestore.codec import Codec

SPECS = ["int4+zstd/plain/k8=18.20", "int4+zstd/rot/clip/k8=10.19", "int4+zstd/rotv/clip/k8=10.19", "int2+zstd",
         "int2+zstd/rot/clip/k4=2"]


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(30, 2, 3, 64, 64, generator=g) * (torch.rand(30, 2, 3, 1, 64, generator=g) * 3 + 0.2)
    ctx = torch.empty(30, 2, 3, 2048, 64)
    frames = {s: Codec(s).encode(kv) for s in SPECS}
    codec = Codec()
    best = dict.fromkeys(SPECS, 1e9)
    for _ in range(6):  # rounds interleave the specs, so a burst of other load hits them all
        for s in SPECS:
            for i in range(10):
                t = time.perf_counter()
                codec.decode_into(frames[s], ctx[:, :, :, (i % 32) * 64:(i % 32 + 1) * 64])
                best[s] = min(best[s], time.perf_counter() - t)
    for s in SPECS:
        print(f"{s:40s} best {best[s] * 1e6:7.0f} us per 64-token block into fp32")


if __name__ == "__main__":
    main()
