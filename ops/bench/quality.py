"""`kvstash bench quality`: what each codec mode's round trip does to the model's predictions.

For several windows of a text: prefill a prefix of N tokens, round-trip its KV (all but the last
prefix token, which the pod always re-feeds) through Codec.encode/decode of each mode block by
block as a pod stores it (--block-tokens, the tail as a session's partial block), then score
the next M tokens with teacher forcing: perplexity and its change vs the exact cache, top-1
agreement with the exact cache's predictions, mean KL(exact || mode) of the next-token
distributions, and how many tokens of a greedy continuation (ModelRunner.generate, the pod's own
path) match the exact cache's.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ops.bench.common import machine, plot_bars, print_table, write_json

MODES = "exact,fp16,int8,int4,int2,fp8"
TARGETS = {"int8": 0.2, "int4": 1.0, "int2": 5.0}  # max perplexity change, percent


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("quality", help="perplexity, top-1, KL and greedy match of each codec mode")
    p.add_argument("--text", type=Path, required=True, help="a plain-text file (e.g. ops/data/sample.txt)")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-random or a local HF directory")
    p.add_argument("--modes", default=MODES, help="codec specs to compare (default %(default)s)")
    p.add_argument("--prefix", type=int, default=512, help="tokens in the cache (default 512)")
    p.add_argument("--continuation", type=int, default=256, help="tokens scored after it (default 256)")
    p.add_argument("--windows", type=int, default=3, help="windows spread over the text (default 3)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per encoded block, as the pod (default 64)")
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens compared per window (default 32)")
    p.add_argument("--json", type=Path, help="write rows and targets as JSON here")
    p.add_argument("--plot", type=Path, help="bar chart of the perplexity change per mode (PNG)")
    p.set_defaults(func=run)


def _windows(n_ids: int, span: int, count: int) -> list[int]:
    if n_ids < span:
        raise SystemExit(f"the text has {n_ids} tokens; a window needs {span} (lower --prefix/--continuation)")
    last = n_ids - span
    if count <= 1:
        return [0]
    return sorted({round(i * last / (count - 1)) for i in range(count)})


def _score(loaded: Any, kv: Any, window: list[int], prefix: int) -> Any:
    """Logits [M, vocab] for the continuation given the cached prefix[:-1] and the re-fed last token."""
    import torch  # noqa: PLC0415

    from service import hfcache  # noqa: PLC0415

    with torch.inference_mode():
        cache = hfcache.cache_from_tensor(kv, loaded.model)
        logits, _ = hfcache.forward(loaded.model, window[prefix - 1:-1], cache, all_logits=True)
    return logits  # row j predicts window[prefix + j]


def _greedy(runner: Any, kv: Any, window: list[int], prefix: int, tokens: int) -> list[int]:
    from service.runner import GenParams  # noqa: PLC0415

    gen = runner.generate(window[:prefix], kv, GenParams(max_tokens=tokens))
    return list(gen.token_ids)


def _round_trip(codecs: Any, kv: Any, block_tokens: int) -> list[bytes]:
    """Frames as a pod writes them: one per full block of `block_tokens` (block 0 with the sink codec
    of `cachestore.blockcodec`), the rest as the session's tail."""
    return [codecs.at(i // block_tokens).encode(kv[:, :, :, i:i + block_tokens])
            for i in range(0, kv.shape[3], block_tokens)]


def _measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import torch  # noqa: PLC0415

    from cachestore.blockcodec import BlockCodecs  # noqa: PLC0415
    from service import hfcache  # noqa: PLC0415
    from service.models import load_model  # noqa: PLC0415
    from service.pipeline import common_prefix  # noqa: PLC0415
    from service.runner import ModelRunner  # noqa: PLC0415

    loaded = load_model(args.model)
    runner = ModelRunner(loaded)
    ids = [int(i) for i in loaded.tokenizer.encode(args.text.read_text(encoding="utf-8"), add_special_tokens=False)]
    n, m = args.prefix, args.continuation
    modes = [s.strip() for s in args.modes.split(",") if s.strip()]
    if "exact" not in modes:
        modes.insert(0, "exact")
    per_window: list[dict[str, Any]] = []
    for start in _windows(len(ids), n + m, args.windows):
        window = ids[start:start + n + m]
        with torch.inference_mode():
            _, cache = hfcache.forward(loaded.model, window[:n - 1], None)
        with torch.no_grad():
            kv = hfcache.tensor_from_cache(cache)  # [L, 2, H, n - 1, D]
        target = torch.tensor(window[n:])
        ref_logp = ref_greedy = None
        for mode in modes:
            codecs = BlockCodecs.for_spec(mode)
            codec = codecs.main
            frames = _round_trip(codecs, kv, args.block_tokens)
            kv_mode = torch.cat([codec.decode(f) for f in frames], dim=3)  # [L, 2, H, n - 1, D]
            logp = torch.log_softmax(_score(loaded, kv_mode, window, n), dim=-1)  # [M, vocab]
            nll = float(-logp.gather(1, target.unsqueeze(1)).mean())
            greedy = _greedy(runner, kv_mode, window, n, args.greedy)
            if mode == "exact":
                ref_logp, ref_greedy = logp, greedy
            assert ref_logp is not None and ref_greedy is not None
            kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
            per_window.append({
                "window_start": start, "mode": mode, "spec": codecs.name(), "nll": nll,
                "top1_agree": float((logp.argmax(-1) == ref_logp.argmax(-1)).float().mean()),
                "kl": max(kl, 0.0), "greedy_match": common_prefix(greedy, ref_greedy), "greedy_len": len(ref_greedy),
                "bytes": sum(map(len, frames)), "bytes_per_token": sum(map(len, frames)) / kv.shape[3],
            })
        print(f"window at token {start}: " + ", ".join(
            f"{r['mode']} ppl {math.exp(r['nll']):.3f}" for r in per_window if r["window_start"] == start), flush=True)
    return _aggregate(per_window, modes), per_window


def _aggregate(per_window: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    """Per mode: perplexity over all scored tokens (windows weigh equally), means of the rest."""
    rows = []
    for mode in modes:
        ws = [r for r in per_window if r["mode"] == mode]
        rows.append({
            "mode": mode, "spec": ws[0]["spec"], "windows": len(ws),
            "ppl": math.exp(sum(r["nll"] for r in ws) / len(ws)),
            "top1_agree": sum(r["top1_agree"] for r in ws) / len(ws),
            "kl_mean": sum(r["kl"] for r in ws) / len(ws),
            "greedy_match_mean": sum(r["greedy_match"] for r in ws) / len(ws),
            "greedy_match_min": min(r["greedy_match"] for r in ws),
            "bytes_per_token": sum(r["bytes_per_token"] for r in ws) / len(ws),
        })
    exact = next(r for r in rows if r["mode"] == "exact")
    for r in rows:
        r["ppl_delta_pct"] = (r["ppl"] / exact["ppl"] - 1) * 100
    return rows


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for r in rows:
        limit = TARGETS.get(r["mode"])
        if limit is not None:
            out[f"{r['mode']}_ppl_delta_pct"] = {"value": r["ppl_delta_pct"], "target": limit,
                                                 "met": abs(r["ppl_delta_pct"]) <= limit}
    return out


def run(args: argparse.Namespace) -> int:
    before = machine()
    rows, per_window = _measure(args)
    print(f"{args.model}: {args.prefix}-token prefix in the cache, next {args.continuation} tokens scored, "
          f"{rows[0]['windows']} windows of {args.text.name}; greedy match over {args.greedy} tokens")
    print_table(rows, [("spec", "codec", ""), ("ppl", "ppl", ".4f"), ("ppl_delta_pct", "ppl Δ %", "+.3f"),
                       ("top1_agree", "top-1 agree", ".4f"), ("kl_mean", "KL mean", ".2e"),
                       ("greedy_match_mean", "greedy match", ".1f"), ("greedy_match_min", "min", "d"),
                       ("bytes_per_token", "B/token", ",.0f")])
    targets = _targets(rows)
    for name, t in targets.items():
        print(f"target {name}: {t['value']:+.3f}% (|Δ| <= {t['target']}%) {'met' if t['met'] else 'MISSED'}")
    if args.json:
        write_json(args.json, {"rows": rows, "windows": per_window, "targets": targets, "model": args.model,
                               "text": args.text.name, "prefix": args.prefix, "continuation": args.continuation,
                               "greedy": args.greedy, "machine": before})
    if args.plot:
        plot_bars(args.plot, [r["mode"] for r in rows], {"perplexity change %": [r["ppl_delta_pct"] for r in rows]},
                  title=f"Perplexity change vs the exact cache ({args.model})", ylabel="% vs exact")
    return 0
