"""Bytes per token of a 2048-token context of each text, stored as a pod stores it (64-token blocks, the int8
sink block, every header), for the codec specs given: what `kvstash bench quality` reports as B/token and
x fp16, without scoring. Used to size the int8 layers of wave 4 (quality_wave4_sizes.txt).

    .venv/bin/python docs/benchmarks/quality_wave4_sizes.py int4+zstd/plain int4+zstd/k8=18.20 ...
"""
import sys
from pathlib import Path

from cachestore.blockcodec import BlockCodecs
from ops.bench.quality import HfScorer, _round_trip

scorer = HfScorer("smollm2")
for text in ("ops/data/sample.txt", "ops/data/alice.txt"):
    ids = scorer.text_ids(Path(text).read_text())
    ids = (ids * -(-2048 // len(ids)))[:2048]
    kv = scorer.prefill(ids)
    for spec in sys.argv[1:]:
        n = sum(map(len, _round_trip(BlockCodecs.for_spec(spec), kv, 64))) / 2048
        print(f"{text:<20} {spec:<44} {n:8.0f} B/token  {23040 / n:.3f}x fp16", flush=True)
