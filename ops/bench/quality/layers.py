"""`kvstash bench layers`: which layers of your model are worth more bits, measured on calibration text only.

The calibration procedure behind a per-layer bit allocation (`/k5=`, `/v5=` of int4 and `/k3=`, `/v3=` of int2, on a
base with `/s8`). For several windows of the calibration texts (never the ones claims are made on: `texts.py`), the
prefix's KV is round-tripped block by block as a pod stores it, through the base codec and through the upgrade
(every layer one bit more; same group and options), and then, for every layer and for its keys and its values apart,
that one half is put back from the upgrade into the all-base KV and the next tokens scored: the mean KL(exact ||
codec) of their next-token distributions, and how much the upgrade of that half alone lowers it. Halves are ranked by
that gain; the suggestion takes them in rank order while the encoded size of a `--size-tokens` context stays at least
`--min-ratio` times smaller than fp16 (the mode's size target by default), and is then scored itself.

    kvstash bench layers --base int4+zstd/kbits/s8/unrope --min-ratio 3.5    # value layers of int4 at 5 bits
    kvstash bench layers --base int2+zstd:16/rotv/clip/outk/symv/s8 --text my_calibration.txt --json layers.json

Confirm the suggested spec with `kvstash bench quality` on held-out text (docs/fidelity.md).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from ops.bench.common import machine, print_table, write_json
from ops.bench.quality import stats, texts
from ops.bench.quality.scoring import FP16_BYTES, SCORERS, SIZE_TARGETS, round_trip, window_starts

UPGRADES = ("bit",)  # --upgrade: one bit more (int8 layers and the other grouped precision are retired codecs)
RANK_FIELD = {"relative": "window_share_pct", "mean": "kl_gain"}  # --rank: the field halves are ranked by


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("layers", help="per-layer sensitivity on calibration text; suggests /k5= "
                                                   "/v5= (int4) or /k3= /v3= (int2) layers")
    p.add_argument("--text", action="append", default=None,
                   help="a text set (calibration, the default), a shipped text's name or a plain-text file of "
                        "your own; repeatable. Never the texts you will report on")
    p.add_argument("--engine", default="hf", choices=sorted(SCORERS), help="engine that runs the model (default hf)")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-random or a local HF directory")
    p.add_argument("--base", default="int4+zstd/kbits/s8", help="the int4 or int2 codec to calibrate, with /s8 "
                                                                "(default %(default)s); its own /k5= etc. are ignored")
    p.add_argument("--upgrade", choices=UPGRADES, default=None,
                   help="what a raised half takes: bit (one bit more: /k5= /v5= in int4, /k3= /v3= in int2; the "
                        "default, and the only one: it needs a base with /s8)")
    p.add_argument("--windows", type=int, default=3, help="windows spread over each text (default 3)")
    p.add_argument("--halves", choices=("both", "keys", "values"), default=None,
                   help="which halves to rank: both (default), or keys or values alone (values alone by default over a "
                        "base with /kbits, which sets every key channel's bits itself)")
    p.add_argument("--rank", choices=sorted(RANK_FIELD), default="relative",
                   help="relative (default): rank halves by their mean share of each window's base KL, so that "
                        "every window weighs the same; mean: by their mean KL gain, where the windows of "
                        "largest KL weigh most")
    p.add_argument("--prefix", type=int, default=512, help="tokens in the cache (default 512)")
    p.add_argument("--continuation", type=int, default=64, help="tokens scored after it (default 64)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per encoded block, as the pod (default 64)")
    p.add_argument("--size-tokens", type=int, default=2048,
                   help="context whose encoded size the budget is checked on (default 2048; the text repeats)")
    p.add_argument("--min-ratio", type=float, default=None,
                   help="smallest size ratio vs fp16 the suggestion may reach (default: 3.5 for int4, 6 for int2)")
    p.add_argument("--max-layers", type=int, default=None, help="at most this many raised halves (default: no cap)")
    p.add_argument("--json", type=Path, help="write the ranking and the suggestion as JSON here")
    p.set_defaults(func=run)


def _base_spec(text: str) -> Any:
    """The spec to calibrate, its layer table dropped; SystemExit for one bench layers cannot calibrate."""
    from cachestore.codec import CodecSpec  # noqa: PLC0415
    from cachestore.codec.layout import NO_HI  # noqa: PLC0415

    spec = CodecSpec.parse(text)
    if spec.mode not in ("int4", "int2"):
        raise SystemExit(f"bench layers calibrates int4 or int2 codecs, not {spec.mode}")
    if spec.recent:
        raise SystemExit(f"bench layers calibrates full blocks: give the base without /recent={spec.recent} "
                         f"and add it to the suggestion")
    return replace(spec, hi=NO_HI)


def _upgrade_of(base: Any, upgrade: str | None) -> str:
    """The --upgrade of a base spec: one bit more, which takes a base with /s8 (SystemExit with one line else)."""
    if base.variant is None or not base.variant.scale8:
        raise SystemExit(f"bench layers raises halves one bit more, which takes /s8 with /outk, /kbits or /symv; "
                         f"{base.name()} has none")
    return upgrade or "bit"


def _halves(which: str | None, base: Any) -> tuple[int, ...]:
    """The halves (0 keys, 1 values) `--halves` ranks; SystemExit with one line for keys over a base with /kbits."""
    classes = base.variant is not None and base.variant.key_classes
    which = which or ("values" if classes else "both")
    if classes and which != "values":
        raise SystemExit(f"--halves {which}: {base.name()} sets every key channel's bits itself (/kbits); rank values")
    return {"both": (0, 1), "keys": (0,), "values": (1,)}[which]


def _with_layers(base: Any, halves: list[tuple[int, int]], upgrade: str) -> Any:
    """`base` with these (layer, half) raised to the `upgrade` precision, as a spec."""
    from cachestore.codec.layout import HiLayers  # noqa: PLC0415

    keys = tuple(sorted(layer for layer, half in halves if half == 0))
    values = tuple(sorted(layer for layer, half in halves if half == 1))
    return replace(base, hi=HiLayers(up_keys=keys, up_values=values))


def _size(kv: Any, spec: Any, block_tokens: int, rope: Any = None) -> float:
    """Bytes per token of `kv` encoded as a pod stores it (sink block, headers); `rope` the model's."""
    from cachestore.codec.blockcodec import BlockCodecs  # noqa: PLC0415

    return sum(map(len, round_trip(BlockCodecs.for_spec(spec, rope=rope), kv, block_tokens))) / kv.shape[3]


def _rank(half_kl: dict[tuple[int, int], list[float]], base_kl: list[float], by: str) -> list[dict[str, Any]]:
    """Every (layer, half) with its KL per window once raised alone, its gain over the all-base KL `base_kl` (mean,
    t-interval, share of the mean base KL, mean share of each window's), best first by `by` (RANK_FIELD)."""
    base_mean = stats.mean(base_kl)
    ranked: list[dict[str, Any]] = []
    for (layer, half), kls in half_kl.items():
        gains = [b - k for b, k in zip(base_kl, kls, strict=True)]
        gain, lo_g, hi_g = stats.t_interval(gains)
        shares = [g / b if b > 0 else 0.0 for g, b in zip(gains, base_kl, strict=True)]
        ranked.append({"layer": layer, "half": half, "part": "KV"[half], "kl": stats.mean(kls), "kl_gain": gain,
                       "kl_gain_lo": lo_g, "kl_gain_hi": hi_g, "kl_windows": kls,
                       "share_pct": 100 * gain / base_mean if base_mean > 0 else 0.0,
                       "window_share_pct": 100 * stats.mean(shares)})
    ranked.sort(key=lambda r: r[RANK_FIELD[by]], reverse=True)
    for rank, r in enumerate(ranked, 1):
        r["rank"] = rank
    return ranked


def _suggest(ranked: list[dict[str, Any]], base: Any, size_kv: Any, args: argparse.Namespace,
             min_ratio: float, rope: Any = None) -> tuple[Any, float]:
    """The spec of the best-ranked halves (positive gain only) whose context stays >= min_ratio x fp16."""
    fp16 = size_kv.shape[0] * 2 * size_kv.shape[2] * size_kv.shape[4] * FP16_BYTES
    chosen: list[tuple[int, int]] = []
    spec, ratio = base, fp16 / _size(size_kv, base, args.block_tokens, rope)
    for r in ranked:
        if r[RANK_FIELD[args.rank]] <= 0 or (args.max_layers is not None and len(chosen) >= args.max_layers):
            break
        trial = _with_layers(base, [*chosen, (r["layer"], r["half"])], args.upgrade)
        trial_ratio = fp16 / _size(size_kv, trial, args.block_tokens, rope)
        if trial_ratio < min_ratio:
            continue  # a later half may still fit (every half of one kind costs the same, so rarely)
        chosen.append((r["layer"], r["half"]))
        spec, ratio = trial, trial_ratio
    return spec, ratio


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from cachestore.codec.blockcodec import BlockCodecs  # noqa: PLC0415
    from cachestore.codec.frame import UP_BITS  # noqa: PLC0415

    before = machine()
    base = _base_spec(args.base)
    args.upgrade = _upgrade_of(base, args.upgrade)
    up_name = f"{base.mode} + 1 bit"
    min_ratio = args.min_ratio if args.min_ratio is not None else SIZE_TARGETS[base.mode]
    chosen_texts = texts.resolve(args.text or ["calibration"])
    held_out = {t.name for t in texts.HELD_OUT} & {t.name for t in chosen_texts}
    if held_out:
        print(f"warning: calibrating on held-out text {', '.join(sorted(held_out))}: claims made on it afterwards "
              f"are not held-out claims")
    scorer = SCORERS[args.engine](args.model)
    n, m = args.prefix, args.continuation

    def trip(spec: Any, kv: Any) -> Any:
        codecs = BlockCodecs.for_spec(spec, rope=scorer.rope)
        frames = round_trip(codecs, kv, args.block_tokens)
        return torch.cat([codecs.main.decode(f, device="cpu") for f in frames], dim=3)

    windows: list[tuple[Any, list[int], Any]] = []  # (kv, window ids, exact log-probs)
    size_kv = None
    for text in chosen_texts:
        ids = scorer.text_ids(texts.read(text))
        if size_kv is None:
            size_kv = scorer.prefill((ids * -(-args.size_tokens // len(ids)))[:args.size_tokens])
        for start in window_starts(len(ids), n + m, args.windows):
            window = ids[start:start + n + m]
            kv = scorer.prefill(window[:n - 1])
            windows.append((kv, window, torch.log_softmax(scorer.logits(kv, window[n - 1:-1]), dim=-1)))
    assert size_kv is not None

    def kl_of(kv_mode: Any, window: list[int], ref: Any) -> float:
        logp = torch.log_softmax(scorer.logits(kv_mode, window[n - 1:-1]), dim=-1)
        return max(float((ref.exp() * (ref - logp)).sum(-1).mean()), 0.0)

    def nll_of(kv_mode: Any, window: list[int]) -> float:
        logp = torch.log_softmax(scorer.logits(kv_mode, window[n - 1:-1]), dim=-1)
        return float(-logp.gather(1, torch.tensor(window[n:]).unsqueeze(1)).mean())

    layers = windows[0][0].shape[0]
    kinds = _halves(args.halves, base)
    # every layer at the upgrade: same group, options and compressor
    up = _with_layers(base, [(layer, half) for layer in range(layers) for half in kinds], "bit")
    base_kl, up_kl = [], []
    half_kl: dict[tuple[int, int], list[float]] = {(layer, half): [] for layer in range(layers) for half in kinds}
    for i, (kv, window, ref) in enumerate(windows):
        lo, hi = trip(base, kv), trip(up, kv)
        base_kl.append(kl_of(lo, window, ref))
        up_kl.append(kl_of(hi, window, ref))
        for (layer, half), kls in half_kl.items():
            mixed = lo.clone()
            mixed[layer, half] = hi[layer, half]
            kls.append(kl_of(mixed, window, ref))
        print(f"window {i + 1}/{len(windows)}: base KL {base_kl[-1]:.3e}, all {up_name} {up_kl[-1]:.3e}", flush=True)
    base_mean = stats.mean(base_kl)
    ranked = _rank(half_kl, base_kl, args.rank)
    suggested, ratio = _suggest(ranked, base, size_kv, args, min_ratio, scorer.rope)
    fp16 = size_kv.shape[0] * 2 * size_kv.shape[2] * size_kv.shape[4] * FP16_BYTES
    base_ratio = fp16 / _size(size_kv, base, args.block_tokens, scorer.rope)
    sug_kl, sug_d, exact_nll = [], [], []
    for kv, window, ref in windows:
        mixed = trip(suggested, kv)
        sug_kl.append(kl_of(mixed, window, ref))
        sug_d.append(nll_of(mixed, window))
        exact_nll.append(nll_of(kv, window))
    base_d = [nll_of(trip(base, kv), window) for kv, window, _ in windows]
    b_pct, b_lo, b_hi = stats.ppl_delta_interval(base_d, exact_nll)
    s_pct, s_lo, s_hi = stats.ppl_delta_interval(sug_d, exact_nll)
    print(f"{args.engine} {args.model}, base {base.name()}, upgrade to {up_name}; {len(windows)} windows of "
          f"{', '.join(t.name for t in chosen_texts)}, {n}-token prefix, next {m} tokens; KL gain of raising one "
          f"half alone (95% t-interval over windows); ranked by {args.rank}")
    print_table(ranked, [("rank", "rank", "d"), ("layer", "layer", "d"), ("part", "half", ""),
                         ("kl_gain", "KL gain", ".3e"), ("kl_gain_lo", "lo", ".2e"), ("kl_gain_hi", "hi", ".2e"),
                         ("share_pct", "% of base KL", ".1f"), ("window_share_pct", "% per window", ".1f"),
                         ("kl", "KL then", ".3e")])
    flag = str(UP_BITS[base.mode])
    print(f"base       {base.name()}: KL {base_mean:.3e}, ppl {b_pct:+.3f}% [{b_lo:+.3f}, {b_hi:+.3f}], "
          f"{base_ratio:.2f}x fp16")
    print(f"suggested  {suggested.name()}: KL {stats.mean(sug_kl):.3e}, ppl {s_pct:+.3f}% [{s_lo:+.3f}, "
          f"{s_hi:+.3f}], {ratio:.2f}x fp16 (>= {min_ratio}x at {args.size_tokens} tokens; /k{flag}= /v{flag}= "
          f"layers from this ranking)")
    print("confirm it on held-out text: kvstash bench quality --modes exact," + suggested.name())
    if args.json:
        write_json(args.json, {
            "ranked": ranked, "rank": args.rank, "base": base.name(), "upgrade": up_name, "base_kl": base_mean,
            "base_kl_windows": base_kl, "suggested_kl_windows": sug_kl, "all_up_kl":
            stats.mean(up_kl), "suggested": suggested.name(), "suggested_kl": stats.mean(sug_kl),
            "suggested_ppl_delta_pct": s_pct, "suggested_ppl_delta_lo": s_lo, "suggested_ppl_delta_hi": s_hi,
            "base_ppl_delta_pct": b_pct, "base_ppl_delta_lo": b_lo, "base_ppl_delta_hi": b_hi,
            "suggested_ratio_vs_fp16": ratio, "base_ratio_vs_fp16": base_ratio, "min_ratio": min_ratio,
            "windows": len(windows), "texts": [vars(t) for t in chosen_texts], "python": texts.python_version(),
            "prefix": n, "continuation": m, "size_tokens": args.size_tokens, "engine": args.engine,
            "model": args.model, "machine": before, "ppl_note": "perplexity change of the calibration windows: "
            "not a held-out claim"})
    return 0
