"""Decode speed of the codec before and after format 2, same machine, same minutes, one thread.

    git archive d9b6098 cachestore | tar -x -C /tmp/before     # the codec before this change
    for i in 1 2 3; do
      python docs/benchmarks/codec_before_after.py /tmp/before int8 int4 int2 int4+zstd int2+zstd
      python docs/benchmarks/codec_before_after.py . int8 int4/plain int4 int4+zstd int2/plain int2 int2+zstd
    done

KV: [30, 2, 3, 1024, 64] fp16 (SmolLM2's geometry), Gaussian with a few large channels as real keys
have. "blocks -> fp32" is the pod's path (64-token frames decoded into one fp32 context);
"frame -> fp16" is `kvstash bench codec`'s (one frame, decoded to its own dtype). Runs of the specs
are interleaved so that load drifts hit every spec alike; the median of 7 counts.
"""

import sys
import time

sys.path.insert(0, sys.argv.pop(1))

import torch  # noqa: E402

from cachestore.codec import Codec  # noqa: E402

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
channels = torch.rand(30, 2, 3, 1, 64, generator=gen) ** 4 * 8 + 0.5
kv = (torch.randn(30, 2, 3, 1024, 64, generator=gen) * channels).half()  # [L, 2, H, T, D]
mb = kv.numel() * 2 / 1e6
out = torch.empty(30, 2, 3, 1024, 64)
specs = sys.argv[1:]
codecs = {s: Codec(s) for s in specs}
blocks = {s: [codecs[s].encode(kv[:, :, :, i:i + 64]) for i in range(0, 1024, 64)] for s in specs}
frames = {s: codecs[s].encode(kv) for s in specs}
times: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in specs}
for _ in range(7):
    for s in specs:
        codec = codecs[s]
        t0 = time.perf_counter()
        for j, block in enumerate(blocks[s]):
            codec.decode_into(block, out[:, :, :, j * 64:(j + 1) * 64])
        t1 = time.perf_counter()
        codec.decode(frames[s])
        times[s][0].append(t1 - t0)
        times[s][1].append(time.perf_counter() - t1)
for s in specs:
    pod, whole = sorted(times[s][0])[3], sorted(times[s][1])[3]
    print(f"{sys.path[0]:<14} {codecs[s].spec.name():<26} blocks->fp32 {mb / pod:6.0f} MB/s   "
          f"frame->fp16 {mb / whole:6.0f} MB/s   ratio {kv.numel() * 2 / len(frames[s]):.2f}", flush=True)
