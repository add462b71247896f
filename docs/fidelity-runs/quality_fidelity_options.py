"""Compare codec specs on windows of texts by KL and perplexity change (issue 37's option sweep, calibration texts).

Each window's prefix KV is round-tripped block by block through the real codec with the int8 sink block, as
`kvstash bench quality` does, and the next tokens scored; no greedy run, so it is quick. A spec may end in
`+tail8` (the partial last block at int8), or be `SPEC@OTHER:K3,V5` (those layer halves of SPEC's round trip
replaced by OTHER's; its size interpolated).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python docs/fidelity-runs/quality_fidelity_options.py --windows 3 \\
        int4+zstd int4+zstd/rot/clip int2+zstd int2+zstd/rot/clip
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from cachestore.blockcodec import BlockCodecs
from ops.bench import qstats, texts
from ops.bench.quality import HfScorer, _round_trip, _windows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--text", action="append")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--cont", type=int, default=128)
    p.add_argument("--size-tokens", type=int, default=2048)
    p.add_argument("--json")
    p.add_argument("specs", nargs="+")
    a = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    sc = HfScorer("smollm2")
    n, m = a.prefix, a.cont

    def trip(spec: str, kv: torch.Tensor) -> torch.Tensor:
        c = BlockCodecs.for_spec(spec.removesuffix("+tail8"))
        frames = _round_trip(c, kv, 64)
        if spec.endswith("+tail8") and kv.shape[3] % 64:
            frames[-1] = c.sink.encode(kv[:, :, :, (kv.shape[3] // 64) * 64:])
        return torch.cat([c.main.decode(f) for f in frames], dim=3)

    def mixed(spec: str, kv: torch.Tensor) -> torch.Tensor:
        if "@" not in spec:
            return trip(spec, kv)
        base, rest = spec.split("@")
        other, halves = rest.split(":")
        x, y = trip(base, kv), trip(other, kv)
        for h in halves.split(","):
            x[int(h[1:]), 0 if h[0] == "K" else 1] = y[int(h[1:]), 0 if h[0] == "K" else 1]
        return x

    sizes: dict[str, float] = {}
    size_kv: torch.Tensor | None = None

    def size(spec: str) -> float:
        assert size_kv is not None
        if spec not in sizes:
            if "@" in spec:
                base, rest = spec.split("@")
                other, halves = rest.split(":")
                share = len(halves.split(",")) / (2 * size_kv.shape[0])
                sizes[spec] = size(base) + (size(other) - size(base)) * share
            else:
                c = BlockCodecs.for_spec(spec.removesuffix("+tail8"))
                sizes[spec] = sum(map(len, _round_trip(c, size_kv, 64))) / size_kv.shape[3]
        return sizes[spec]

    res: dict[str, dict[str, list[float]]] = {s: {"kl": [], "d": []} for s in a.specs}
    for t in texts.resolve(a.text or ["calibration"]):
        ids = sc.text_ids(texts.read(t))
        if size_kv is None:
            size_kv = sc.prefill((ids * -(-a.size_tokens // len(ids)))[:a.size_tokens])
        for start in _windows(len(ids), n + m, a.windows):
            w = ids[start:start + n + m]
            kv = sc.prefill(w[:n - 1])
            target = torch.tensor(w[n:]).unsqueeze(1)
            ref = torch.log_softmax(sc.logits(kv, w[n - 1:-1]), -1)
            ref_nll = float(-ref.gather(1, target).mean())
            for s in a.specs:
                lp = torch.log_softmax(sc.logits(mixed(s, kv), w[n - 1:-1]), -1)
                res[s]["kl"].append(float((ref.exp() * (ref - lp)).sum(-1).mean()))
                res[s]["d"].append(float(-lp.gather(1, target).mean()) - ref_nll)
            print(f"# {t.name} @{start} {time.time() - t0:.0f}s", flush=True)
    assert size_kv is not None
    fp16 = size_kv.shape[0] * 2 * size_kv.shape[2] * size_kv.shape[4] * 2
    print(f"{'spec':60s} {'KL':>9s} {'dppl%':>8s} {'lo':>7s} {'hi':>7s} {'x fp16':>7s}")
    for s in a.specs:
        mean, lo, hi = (math.exp(v) * 100 - 100 for v in qstats.t_interval(res[s]["d"]))
        print(f"{s:60s} {qstats.mean(res[s]['kl']):9.3e} {mean:+8.3f} {lo:+7.3f} {hi:+7.3f} {fp16 / size(s):7.2f}",
              flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"res": res, "sizes": sizes}, f)


if __name__ == "__main__":
    main()
