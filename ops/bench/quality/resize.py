"""`kvstash bench quality --resize`: a published JSON's sizes measured again, its scores kept.

A change to how frames are stored (not to what they decode to) changes every codec's size and no score: the size
columns of docs/results/quality.json are measured again with this build's codecs (a prefill of each text and its
frames, no scoring), and the size side of each target with them. Rows of a retired codec (a spec this build no longer
parses) keep their published sizes, and the JSON lists them under "resized".
"""

from __future__ import annotations

import argparse
import json

from ops.bench.common import machine, write_json
from ops.bench.quality import texts
from ops.bench.quality.merge import row_name, withheld
from ops.bench.quality.scoring import SCORERS, Scorer, measure_sizes, set_sizes, target_met


def _retired(spec: str) -> bool:
    """Whether a row's spec names a retired codec: this build refuses to parse it."""
    from cachestore.codec import CodecSpec  # noqa: PLC0415
    from cachestore.errors import ConfigError  # noqa: PLC0415

    try:
        CodecSpec.parse(spec)
    except ConfigError:
        return True
    return False


def resize(args: argparse.Namespace) -> int:
    """--resize: the --json file's size figures (and the size side of its targets) measured again, its scores
    kept; the machine and date of the new sizes recorded under "resized"."""
    if args.json is None or not args.json.is_file():
        raise SystemExit("--resize recomputes the sizes of an existing --json file; name one")
    try:
        d = json.loads(args.json.read_text())
        rows, size_tokens, block_tokens = d["rows"], d["size_tokens"], d["block_tokens"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--resize: {args.json} is not a bench quality JSON ({exc})") from None
    args.size_tokens, args.block_tokens = size_tokens, block_tokens
    before = machine()
    scorer: Scorer = SCORERS[d.get("engine", args.engine)](d.get("model", args.model))
    by_name = {t.name: t for t in texts.resolve(list(dict.fromkeys(r["text"] for r in rows)))}
    declared = scorer.rope
    kept = sorted({r["mode"] for r in rows if _retired(r["mode"])})
    for spec in kept:
        print(f"{spec}: a retired codec, its published sizes kept", flush=True)
    for name, text in by_name.items():
        ids = scorer.text_ids(texts.read(text))
        kv_shape = scorer.prefill(ids[:1]).shape  # [L, 2, H, 1, D]
        for without in (False, True):  # rows --no-rope measured are encoded as it did, without the RoPE
            mine = [r for r in rows if r["text"] == name and withheld(r) == without and r["mode"] not in kept]
            if not mine:
                continue
            scorer.rope = None if without else declared
            sizes = measure_sizes(scorer, ids, list(dict.fromkeys(r["mode"] for r in mine)), args)
            set_sizes(mine, sizes, kv_shape[0] * 2 * kv_shape[2] * kv_shape[4])
            print(f"{name}: " + ", ".join(f"{row_name(r)} {r['ratio_vs_fp16_ctx']:.2f} / "
                                         f"{r['ratio_vs_fp16_mid']:.2f}x" for r in mine if r["mode"] != "exact"),
                  flush=True)
    for key, t in d.get("targets", {}).items():
        row = next((r for r in rows if f"{r['text']}: {row_name(r)}" == key), None)
        if row is not None and "ratio_target" in t:
            t["ratio_vs_fp16"] = min(row["ratio_vs_fp16_ctx"], row["ratio_vs_fp16_mid"])
            t["met"] = target_met(t)
    d["resized"] = {"machine": before, **({"retired_sizes_kept": kept} if kept else {})}
    write_json(args.json, d)
    return 0
