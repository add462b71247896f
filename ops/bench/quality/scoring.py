"""`kvstash bench quality`: what each codec's round trip does to the model's predictions, and its size.

For several windows of a text: prefill a prefix of N tokens, round-trip its KV (all but the last
prefix token, which the pod always re-feeds) through Codec.encode/decode of each mode block by
block as a pod stores it (--block-tokens, block 0 with the sink codec, the tail as a session's
partial block, with the spec's /recent= mode if it names one), then score the next M tokens with
teacher forcing: perplexity and its change vs the exact cache, top-1 agreement with the exact
cache's predictions, mean KL(exact || mode) of the next-token distributions, and how many tokens
of a greedy continuation (the engine's own generate, as the pod runs it) match the exact cache's.
With --ends spread (the default) each window's cache ends at another point within a block, evenly
from 0 to block_tokens - 1 tokens past a block boundary, as real prompts do (the tokens between
the cache's end and the prefix's end are fed, as a pod feeds what it did not find). Size is
measured on a --size-tokens context (2048 by default) of the same text, encoded exactly as the pod
stores it (bytes per token, every frame header and the sink block included), and on one that ends
half-way through the block after it (its partial block as the pod stores it).

The model is driven through a small `Scorer` (prefill, score, greedy); `hf` is transformers. Another
engine plugs in by adding its Scorer to SCORERS: it must hand over KV in the codec's layout
[layers, 2, kv_heads, tokens, head_dim] and return the logits of every fed position.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from typing import Any, Protocol

from ops import svgchart
from ops.bench.common import machine, pareto_frontier, print_table, write_chart, write_json
from ops.bench.quality import merge, stats, texts
from service.engines.generation import GenRequest

# /plain rows are the codecs as they were before format 2 (same bits), for the before/after table
MODES = "exact,fp16,int8,int4,int4+zstd,int4/rotv,int2/plain,int2/g16/plain,int2,int2+zstd"
PPL_TARGETS = {"int8": 0.2, "int4": 0.25, "int2": 3.0}  # max perplexity change, percent
SIZE_TARGETS = {"int4": 3.5, "int2": 6.0}  # min ratio vs fp16 at --size-tokens, everything included
GREEDY_TARGET = (31.0, 3.0)  # greedy match of 32 tokens (mean) at >= this ratio vs fp16
FP16_BYTES = 2  # per KV value


class Scorer(Protocol):
    """What the bench needs from an engine, and its `rope` (`KvLayout.rope`: what /unrope codecs encode with)."""

    rope: Any
    engine: Any  # the engine it scores through (service.engines.Engine)

    def text_ids(self, text: str) -> list[int]: ...

    def prefill(self, ids: list[int]) -> Any:
        """KV [layers, 2, kv_heads, len(ids), head_dim] of `ids` from an empty cache."""

    def logits(self, kv: Any, ids: list[int]) -> Any:
        """Logits [len(ids), vocab] of `ids` fed after the cached `kv`: row j predicts ids[j + 1]."""

    def greedy(self, prompt: list[int], kv: Any, tokens: int) -> list[int]:
        """Greedy continuation of `prompt` whose first kv.shape[3] tokens come from `kv`."""


class HfScorer:
    """transformers (the `hf` engine): prefill and scoring through hfcache, greedy through the engine."""

    def __init__(self, model: str) -> None:
        from service.engines.hf.engine import HfEngine  # noqa: PLC0415

        self.engine = HfEngine.load(model)
        self.model = self.engine.loaded.model
        self.rope = self.engine.kv_layout.rope

    def text_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.engine.text_ids(text)]

    def prefill(self, ids: list[int]) -> Any:
        import torch  # noqa: PLC0415

        from service.engines.hf import hfcache  # noqa: PLC0415

        with torch.inference_mode():
            _, cache = hfcache.forward(self.model, ids, None)
        return hfcache.tensor_from_cache(cache).clone()

    def logits(self, kv: Any, ids: list[int]) -> Any:
        import torch  # noqa: PLC0415

        from service.engines.hf import hfcache  # noqa: PLC0415

        with torch.inference_mode():
            cache = hfcache.cache_from_tensor(kv, self.model)
            logits, _ = hfcache.forward(self.model, ids, cache, all_logits=True)
        return logits

    def greedy(self, prompt: list[int], kv: Any, tokens: int) -> list[int]:
        from service.engines.generation import GenParams  # noqa: PLC0415

        return list(self.engine.generate(GenRequest(prompt, kv, GenParams(max_tokens=tokens))).token_ids)


class LlamaCppScorer:
    """llama.cpp (the `llamacpp` engine): the GGUF's own weights and F16 KV, scored through the engine."""

    def __init__(self, model: str) -> None:
        from service.engines.llama.llamacpp import LlamaCppEngine  # noqa: PLC0415

        self.engine = LlamaCppEngine.load(model, parallel=1)
        self.rope = self.engine.kv_layout.rope

    def text_ids(self, text: str) -> list[int]:
        return self.engine.text_ids(text)

    def prefill(self, ids: list[int]) -> Any:
        from service.engines.generation import GenParams  # noqa: PLC0415

        return self.engine.generate(GenRequest(ids, None, GenParams(max_tokens=1))).kv  # [L, 2, H, len(ids), D]

    def logits(self, kv: Any, ids: list[int]) -> Any:
        return self.engine.score(kv, ids)

    def greedy(self, prompt: list[int], kv: Any, tokens: int) -> list[int]:
        from service.engines.generation import GenParams  # noqa: PLC0415

        return list(self.engine.generate(GenRequest(prompt, kv, GenParams(max_tokens=tokens))).token_ids)


SCORERS: dict[str, type[HfScorer] | type[LlamaCppScorer]] = {"hf": HfScorer, "llamacpp": LlamaCppScorer}


def pareto_points(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """{codec: (bytes per token, perplexity change %)} for the Pareto chart; the sink codec is the same for every
    grouped mode, so its part of the name is left out."""
    return {f"{r['text']}: {r['spec'].split(',sink=')[0]}": (r["bytes_per_token_ctx"], r["ppl_delta_pct"])
            for r in rows}


def pareto_intervals(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """{codec: (low, high)} of the perplexity change's 95% interval, keyed as `pareto_points`."""
    return {f"{r['text']}: {r['spec'].split(',sink=')[0]}": (r["ppl_delta_lo"], r["ppl_delta_hi"]) for r in rows}


def window_starts(n_ids: int, span: int, count: int) -> list[int]:
    if n_ids < span:
        raise SystemExit(f"the text has {n_ids} tokens; a window needs {span} (lower --prefix/--continuation)")
    last = n_ids - span
    if count <= 1:
        return [0]
    return sorted({round(i * last / (count - 1)) for i in range(count)})


def round_trip(codecs: Any, kv: Any, block_tokens: int) -> list[bytes]:
    """Frames as a pod writes them: one per full block of `block_tokens` (block 0 with the sink codec
    of `cachestore.codec.blockcodec`), the rest as the session's partial block (its /recent= codec)."""
    tokens = kv.shape[3]
    return [(codecs.at if i + block_tokens <= tokens else codecs.partial_at)(i // block_tokens).encode(
            kv[:, :, :, i:i + block_tokens]) for i in range(0, tokens, block_tokens)]


def _cache_ends(prefix: int, block_tokens: int, count: int, ends: str) -> list[int]:
    """How many tokens of each of `count` windows come from the cache: `prefix - 1` (fixed), or (spread) the
    partial block after the last full one grows evenly from 0 to block_tokens - 1 tokens over the windows, the
    cache ending at most at `prefix - 1`."""
    if ends == "fixed" or prefix - 1 < block_tokens:
        return [prefix - 1] * count
    base = (prefix - 1) // block_tokens * block_tokens
    out = []
    for i in range(count):
        cut = base + i * block_tokens // count
        out.append(cut if cut <= prefix - 1 else cut - block_tokens)
    return out


def measure_sizes(scorer: Scorer, ids: list[int], modes: list[str],
           args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Bytes per token of a --size-tokens context per mode, and of one that ends half-way through the block after
    it (the partial block as the pod stores it), every frame (headers, sink block) included: {mode: (whole, mid)}."""
    from cachestore.codec.blockcodec import BlockCodecs  # noqa: PLC0415

    tokens, mid = args.size_tokens, args.size_tokens + args.block_tokens // 2
    kv = scorer.prefill((ids * -(-mid // len(ids)))[:mid])  # [L, 2, H, mid, D]

    def per_token(mode: str) -> tuple[float, float]:
        codecs = BlockCodecs.for_spec(mode, rope=scorer.rope)
        frames = [len(f) for f in round_trip(codecs, kv, args.block_tokens)]
        if tokens % args.block_tokens:  # else the context's frames are the first ones of the longer context's
            whole = sum(map(len, round_trip(codecs, kv[:, :, :, :tokens], args.block_tokens)))
        else:
            whole = sum(frames[:tokens // args.block_tokens])
        return whole / tokens, sum(frames) / mid

    return {mode: per_token(mode) for mode in modes}


def _measure(args: argparse.Namespace, scorer: Scorer, text: str) -> tuple[list[dict[str, Any]],
                                                                           list[dict[str, Any]]]:
    import torch  # noqa: PLC0415

    from cachestore.codec.blockcodec import BlockCodecs  # noqa: PLC0415
    from service.cache.partials import common_prefix  # noqa: PLC0415

    ids = scorer.text_ids(text)
    n, m = args.prefix, args.continuation
    modes = [s.strip() for s in args.modes.split(",") if s.strip()]
    if "exact" not in modes:
        modes.insert(0, "exact")
    per_window: list[dict[str, Any]] = []
    starts = window_starts(len(ids), n + m, args.windows)
    for start, cut in zip(starts, _cache_ends(n, args.block_tokens, len(starts), args.ends), strict=True):
        window = ids[start:start + n + m]
        kv = scorer.prefill(window[:cut])  # [L, 2, H, cut, D]
        target = torch.tensor(window[n:])
        ref_logp = ref_greedy = None
        seen: dict[bytes, tuple[Any, list[int]]] = {}  # decoded KV -> (logp, greedy)
        for mode in modes:
            codecs = BlockCodecs.for_spec(mode, rope=scorer.rope)
            frames = round_trip(codecs, kv, args.block_tokens)
            kv_mode = torch.cat([codecs.main.decode(f, device="cpu") for f in frames], dim=3)  # [L, 2, H, cut, D]
            # modes that differ only in the compressor decode to the same bits: score those once
            digest = hashlib.sha256(kv_mode.contiguous().view(torch.uint8).numpy().tobytes()).digest()
            if digest not in seen:
                # tokens cut..n-1 are fed as a pod feeds what the cache lacked; the last M rows predict window[n:]
                logp = torch.log_softmax(scorer.logits(kv_mode, window[cut:-1])[-m:], dim=-1)  # [M, vocab]
                seen[digest] = logp, scorer.greedy(window[:n], kv_mode, args.greedy)
            logp, greedy = seen[digest]
            nll = float(-logp.gather(1, target.unsqueeze(1)).mean())
            if mode == "exact":
                ref_logp, ref_greedy = logp, greedy
            assert ref_logp is not None and ref_greedy is not None
            kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
            per_window.append({
                "window_start": start, "cached_tokens": cut, "mode": mode, "spec": codecs.name(), "nll": nll,
                "top1_agree": float((logp.argmax(-1) == ref_logp.argmax(-1)).float().mean()),
                "kl": max(kl, 0.0), "greedy_match": common_prefix(greedy, ref_greedy), "greedy_len": len(ref_greedy),
                "bytes": sum(map(len, frames)), "bytes_per_token": sum(map(len, frames)) / kv.shape[3],
            })
        print(f"window at token {start}: " + ", ".join(
            f"{r['mode']} ppl {math.exp(r['nll']):.3f}" for r in per_window if r["window_start"] == start), flush=True)
    rows = _aggregate(per_window, modes)
    geometry = kv.shape[0] * 2 * kv.shape[2] * kv.shape[4]  # KV values a token
    set_sizes(rows, measure_sizes(scorer, ids, modes, args), geometry)
    return rows, per_window


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
            **{f"greedy_match_{k}": v for k, v in stats.distribution([r["greedy_match"] for r in ws]).items()
               if k in ("p10", "median")},
            "bytes_per_token": sum(r["bytes_per_token"] for r in ws) / len(ws),
        })
    exact = next(r for r in rows if r["mode"] == "exact")
    exact_nll = [r["nll"] for r in per_window if r["mode"] == "exact"]
    for r in rows:
        r["ppl_delta_pct"] = (r["ppl"] / exact["ppl"] - 1) * 100
        nll = [w["nll"] for w in per_window if w["mode"] == r["mode"]]
        _, r["ppl_delta_lo"], r["ppl_delta_hi"] = stats.ppl_delta_interval(nll, exact_nll)
        # neighbouring windows' differences alike (overlap on a short text) would make that interval too narrow
        r["nll_delta_autocorr"] = stats.autocorrelation(stats.paired_deltas(nll, exact_nll))
    return rows


def target_met(t: dict[str, Any]) -> bool:
    """A codec's target: its perplexity change's upper end and its smaller size ratio both within it."""
    return bool(t["ppl_delta_hi"] <= t["ppl_target"] and t["ratio_vs_fp16"] >= t["ratio_target"])


def _targets(rows: list[dict[str, Any]], greedy_tokens: int) -> dict[str, Any]:
    """Per int8/int4/int2 row: its perplexity (and size) target; the best greedy-keeping mode."""
    from cachestore.codec import CodecSpec  # noqa: PLC0415

    out: dict[str, Any] = {}
    for r in rows:
        mode = CodecSpec.parse(r["mode"]).mode
        if mode not in PPL_TARGETS:
            continue
        # the smaller of the two sizes' ratios: a context ending on a block boundary, or half-way through a block
        t = {"ppl_delta_pct": r["ppl_delta_pct"], "ppl_delta_hi": r["ppl_delta_hi"], "ppl_target": PPL_TARGETS[mode],
             "ratio_vs_fp16": min(r["ratio_vs_fp16_ctx"], r["ratio_vs_fp16_mid"]),
             "ratio_target": SIZE_TARGETS.get(mode, 0.0)}
        # the conservative end: the upper end of the 95% interval over windows (a codec that lowers perplexity
        # costs no fidelity by this measure; its KL, reported beside, still counts the change)
        t["met"] = target_met(t)
        out[f"{r['text']}: {merge.row_name(r)}"] = t
    need, ratio = GREEDY_TARGET[0] * greedy_tokens / 32, GREEDY_TARGET[1]
    keeping = [r for r in rows if r["text"] == rows[0]["text"]  # the first text's rows
               and r["greedy_match_mean"] >= need and r["ratio_vs_fp16_ctx"] >= ratio]
    best = max(keeping, key=lambda r: r["ratio_vs_fp16_ctx"], default=None)
    out["greedy"] = {"need_mean": need, "min_ratio": ratio, "met": best is not None,
                     "mode": best["mode"] if best else None}
    return out


def set_sizes(rows: list[dict[str, Any]], sizes: dict[str, tuple[float, float]], geometry: int) -> None:
    """Each row's bytes a token and ratios to fp16 of a --size-tokens context and of the mid-block one."""
    for r in rows:
        r["bytes_per_token_ctx"], r["bytes_per_token_mid"] = sizes[r["mode"]]
        r["ratio_vs_fp16_ctx"] = geometry * FP16_BYTES / r["bytes_per_token_ctx"]
        r["ratio_vs_fp16_mid"] = geometry * FP16_BYTES / r["bytes_per_token_mid"]


def run(args: argparse.Namespace) -> int:
    if args.merge and (args.json is None or not args.json.is_file()):
        raise SystemExit("--merge adds to an existing --json file; name one")
    from service.cache.codecnames import written_out  # noqa: PLC0415

    before = machine()
    chosen = texts.resolve(args.text or ["held-out"])
    scorer: Scorer = SCORERS[args.engine](args.model)
    if args.no_rope:
        scorer.rope = None
    args.modes, plan = written_out(args.modes, scorer.engine, scorer.rope)  # int4, int2: this model's plan
    if plan is not None:
        print("; ".join(f"{name} is {spec}" for name, spec in plan.specs.items()) + f" here ({plan.source})")
    rows, per_window = [], []
    for text in chosen:
        r, w = _measure(args, scorer, texts.read(text))
        for x in r + w:
            x["text"] = text.name
            if args.no_rope and x["mode"] != "exact":
                x["rope"] = "withheld"
        rows += r
        per_window += w
    print(f"{args.engine} {args.model}: {args.prefix}-token prefix in the cache, next {args.continuation} tokens "
          f"scored, {rows[0]['windows']} windows a text; ppl delta with its 95% t-interval over windows (paired "
          f"vs exact); greedy match over {args.greedy} tokens; cache ends {args.ends} within a block; size of a "
          f"{args.size_tokens}-token context and of {args.size_tokens + args.block_tokens // 2} (mid)")
    print_table(rows, [("text", "text", ""), ("spec", "codec", ""), ("windows", "n", "d"), ("ppl", "ppl", ".4f"),
                       ("ppl_delta_pct", "ppl Δ %", "+.3f"), ("ppl_delta_lo", "lo", "+.3f"),
                       ("ppl_delta_hi", "hi", "+.3f"), ("top1_agree", "top-1", ".4f"), ("kl_mean", "KL", ".2e"),
                       ("greedy_match_min", "g min", "d"), ("greedy_match_p10", "p10", ".1f"),
                       ("greedy_match_median", "med", ".1f"), ("greedy_match_mean", "mean", ".1f"),
                       ("bytes_per_token_ctx", "B/token", ",.0f"), ("ratio_vs_fp16_ctx", "x fp16", ".2f"),
                       ("ratio_vs_fp16_mid", "x mid", ".2f")])
    targets = _targets(rows, args.greedy)
    for name, t in targets.items():
        if name == "greedy":
            print(f"target greedy >= {t['need_mean']:.1f} of {args.greedy} at >= {t['min_ratio']}x: "
                  f"{'met by ' + t['mode'] if t['met'] else 'MISSED'}")
            continue
        print(f"target {name}: {t['ppl_delta_pct']:+.3f}% (hi {t['ppl_delta_hi']:+.3f}% <= +{t['ppl_target']}%), "
              f"{t['ratio_vs_fp16']:.2f}x fp16 (>= {t['ratio_target']}) {'met' if t['met'] else 'MISSED'}")
    if args.json:
        report = {"rows": rows, "windows": per_window, "targets": targets, "engine": args.engine,
                  "model": args.model, "texts": [vars(t) for t in chosen], "python": texts.python_version(),
                  "prefix": args.prefix, "continuation": args.continuation, "greedy": args.greedy, "ends": args.ends,
                  "block_tokens": args.block_tokens, "size_tokens": args.size_tokens, "machine": before}
        write_json(args.json, merge.merged(args.json, report) if args.merge else report)
    if args.plot:
        points = pareto_points(rows)
        write_chart(args.plot, svgchart.scatter(
            points, title=f"Perplexity change vs size ({args.engine} {args.model}; bars: 95% interval over "
                          f"{rows[0]['windows']} windows; joined: nothing smaller loses less)",
            xlabel=f"bytes per token of a {args.size_tokens}-token context (log2)",
            ylabel="perplexity change vs exact, % (symmetric log)", logx=True, symlog=0.1,
            joined=pareto_frontier(points), intervals=pareto_intervals(rows), fmt="+.2f"))
    return 0
