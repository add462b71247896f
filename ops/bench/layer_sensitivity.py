"""Per-layer sensitivity of SmolLM2 to int4 KV, on the quality bench's windows of ONE text (calibration).

For each window (512-token prefix, next 256 scored, as `kvstash bench quality`): round-trip the prefix KV
through int4+zstd:3/g64/plain and through int8, block by block with the sink codec, as a pod stores it.
Then, for every layer and for its keys, its values, or both, put that layer's int8 round trip back into
the all-int4 KV and measure the mean KL(exact || mode) and the perplexity change of the scored tokens.
The layers whose upgrade lowers the KL most are the ones worth keeping at int8.

    .venv/bin/python -m ops.bench.layer_sensitivity ops/data/sample.txt > quality_layers.txt
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from cachestore.codec.blockcodec import BlockCodecs
from ops.bench.quality import HfScorer, _round_trip, _windows

PARTS = {"K": (0,), "V": (1,), "KV": (0, 1)}


def _trip(spec: str, kv: torch.Tensor, block_tokens: int) -> torch.Tensor:
    codecs = BlockCodecs.for_spec(spec)
    return torch.cat([codecs.main.decode(f, device="cpu") for f in _round_trip(codecs, kv, block_tokens)], dim=3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("text", type=Path)
    p.add_argument("--base", default="int4+zstd:3/g64/plain")
    p.add_argument("--hi", default="int8+zstd:3")
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--windows", type=int, default=3)
    args = p.parse_args()
    scorer = HfScorer("smollm2")
    ids = scorer.text_ids(args.text.read_text(encoding="utf-8"))
    n, m = args.prefix, args.continuation
    kl: dict[tuple[str, int, str], list[float]] = {}
    nll: dict[tuple[str, int, str], list[float]] = {}

    def score(key: tuple[str, int, str], kv: torch.Tensor, window: list[int], ref: torch.Tensor,
              target: torch.Tensor) -> None:
        logp = torch.log_softmax(scorer.logits(kv, window[n - 1:-1]), dim=-1)
        kl.setdefault(key, []).append(float((ref.exp() * (ref - logp)).sum(-1).mean()))
        nll.setdefault(key, []).append(float(-logp.gather(1, target.unsqueeze(1)).mean()))

    for start in _windows(len(ids), n + m, args.windows):
        window = ids[start:start + n + m]
        kv = scorer.prefill(window[:n - 1])  # [L, 2, H, n - 1, D]
        target = torch.tensor(window[n:])
        ref = torch.log_softmax(scorer.logits(kv, window[n - 1:-1]), dim=-1)
        score(("exact", -1, ""), kv, window, ref, target)
        lo, hi = _trip(args.base, kv, 64), _trip(args.hi, kv, 64)
        score(("base", -1, ""), lo, window, ref, target)
        score(("hi", -1, ""), hi, window, ref, target)
        for layer in range(kv.shape[0]):
            for part, idx in PARTS.items():
                mixed = lo.clone()
                for i in idx:
                    mixed[layer, i] = hi[layer, i]
                score(("up", layer, part), mixed, window, ref, target)
        print(f"# window at {start} done", flush=True)

    exact_ppl = math.exp(sum(nll[("exact", -1, "")]) / args.windows)

    def row(key: tuple[str, int, str]) -> str:
        ppl = math.exp(sum(nll[key]) / args.windows)
        return f"KL {sum(kl[key]) / args.windows:.3e}  dppl {(ppl / exact_ppl - 1) * 100:+.3f}%"

    print(f"# {args.text.name}, base {args.base}, upgrade {args.hi}; {args.windows} windows, prefix {n}, scored {m}")
    print(f"all {args.base:<28} {row(('base', -1, ''))}")
    print(f"all {args.hi:<28} {row(('hi', -1, ''))}")
    base_kl = sum(kl[("base", -1, "")]) / args.windows
    ranked = []
    for (kind, layer, part) in kl:
        if kind == "up":
            gain = base_kl - sum(kl[(kind, layer, part)]) / args.windows
            ranked.append((gain, layer, part))
    for gain, layer, part in sorted(ranked, reverse=True):
        print(f"layer {layer:2d} {part:<2} at int8: KL gain {gain:+.3e}  {row(('up', layer, part))}")


if __name__ == "__main__":
    main()
