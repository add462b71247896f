"""`kvstash bench codec`: size, speed and error of every codec mode x compressor on real KV."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

from ops.bench.common import SAMPLE_TEXT
from ops.bench.common import median_s as _median_s

MODES = ["exact", "fp16", "int8", "int4", "int2"]
COMPRESSORS = ["none", "lz4", "zstd"]
TARGETS = {"int8": 1.9, "int4": 3.5, "int2": 6.0}  # minimum ratio vs fp16
DECODE_TARGET_MB_S = 1000.0  # int8+lz4
# Decode MB/s of int4/int2 (lz4, g64) before the rotated variants and the faster unpack landed:
# the run of 2026-11-29 on a quiet 2-core machine (in git history). Their defaults must be no slower.
BEFORE_DECODE_MB_S = {"int4": 552.0, "int2": 599.0}


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("codec", help="codec ratio, encode/decode MB/s and error")
    p.add_argument("--tokens", type=int, default=2048, help="KV tokens to encode (default 2048)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per row; the median counts")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32", "bfloat16"],
                   help="dtype of the KV handed to the codec (default float16)")
    p.add_argument("--groups", default="32,64", help="int4/int2 group sizes to compare")
    p.add_argument("--variants", default="plain,default,rotv",
                   help="int4/int2 options to compare: 'default' (what a bare int4/int2 means), "
                        "'plain' or option lists such as 'rotv/clip' or 'symv/s8/k5=0.1' (default %(default)s)")
    p.add_argument("--level", type=int, default=3, help="zstd level")
    p.add_argument("--synthetic", action="store_true", help="skip the model: synthetic KV")
    p.add_argument("--arrays", default="torch", choices=["torch", "numpy"],
                   help="hand the codec torch tensors (a pod's) or numpy arrays (the codec without torch)")
    p.add_argument("--json", type=Path, help="write the rows as JSON to this path")
    p.set_defaults(func=run)


def _model_kv(tokens: int) -> tuple[Any, str]:
    """KV of SmolLM2-135M prefilled with ops/data/sample.txt (repeated if too short)."""
    import torch  # noqa: PLC0415

    from service.engines.hf.hfcache import forward, tensor_from_cache  # noqa: PLC0415
    from service.engines.hf.models import load_model  # noqa: PLC0415

    loaded = load_model("smollm2")
    text = SAMPLE_TEXT.read_text(encoding="utf-8")
    ids = list(loaded.tokenizer(text)["input_ids"])
    copies = -(-tokens // len(ids))
    ids = (ids * copies)[:tokens]
    with torch.inference_mode():
        _, cache = forward(loaded.model, ids, None)
    note = f"{SAMPLE_TEXT.name}: {len(ids)} tokens" + (f" (text x{copies})" if copies > 1 else "")
    return tensor_from_cache(cache), note


def _synthetic_kv(tokens: int) -> Any:
    """Gaussian KV with SmolLM2's shape and a few large key channels, as real keys have."""
    import torch  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(30, 2, 3, tokens, 64, generator=gen)  # [layers, 2, heads, tokens, dim]
    channel = torch.rand(30, 1, 3, 1, 64, generator=gen) ** 4 * 8 + 0.5
    kv[:, :1] *= channel
    return kv


def _rel_err(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _row(kv: Any, spec: Any, repeat: int, arrays: str = "torch") -> dict[str, Any]:
    """One spec's row; with `arrays` "numpy" the codec encodes and decodes numpy arrays (errors measured alike)."""
    from cachestore.codec import Codec, CodecSpec  # noqa: PLC0415
    from cachestore.codec.arrays import from_host, to_host  # noqa: PLC0415

    codec = Codec(spec)
    fp16_mb = kv.numel() * 2 / 1e6
    data, device = (kv, "cpu") if arrays == "torch" else (to_host(kv), None)
    frame = codec.encode(data)
    out = from_host(to_host(codec.decode(frame, device=device)), _torch_ns())
    return {
        "mode": spec.mode, "compressor": spec.compressor, "spec": spec.name(),
        "group_size": spec.group_size if spec.mode in ("int4", "int2") else None,
        "default_variant": spec.mode in ("int4", "int2") and (spec.variant, spec.hi) == (
            CodecSpec(spec.mode).variant, CodecSpec(spec.mode).hi),
        "frame_bytes": len(frame),
        "ratio_vs_fp16": kv.numel() * 2 / len(frame),
        "encode_mb_s": fp16_mb / _median_s(lambda: codec.encode(data), repeat),
        "decode_mb_s": fp16_mb / _median_s(lambda: codec.decode(frame, device=device), repeat),
        "k_rel_err": _rel_err(out[:, 0], kv[:, 0]),
        "v_rel_err": _rel_err(out[:, 1], kv[:, 1]),
    }


def _torch_ns() -> Any:
    from cachestore.codec.arrays import torch_ns  # noqa: PLC0415

    return torch_ns()


def _shuffle_rows(kv: Any, level: int, repeat: int) -> list[dict[str, Any]]:
    """Ratio and decompression speed of the fp16 payload with and without byte shuffle."""
    import torch  # noqa: PLC0415

    from cachestore.codec.arrays import host_bytes  # noqa: PLC0415
    from cachestore.codec.compress import compress, decompress, shuffle  # noqa: PLC0415

    raw = host_bytes(kv.to(torch.float16))
    rows = []
    for comp in ("lz4", "zstd"):
        for shuffled in (False, True):
            data = shuffle(raw, 2) if shuffled else raw
            packed = compress(memoryview(data.data), comp, level)
            secs = _median_s(partial(decompress, memoryview(packed), comp, raw.shape[0]), repeat)
            rows.append({"compressor": comp, "shuffle": shuffled,
                         "ratio": raw.shape[0] / len(packed),
                         "decompress_mb_s": raw.shape[0] / 1e6 / secs})
    return rows


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from cachestore.codec import CodecSpec  # noqa: PLC0415

    source, note = "synthetic", "--synthetic given"
    kv = None
    if not args.synthetic:
        try:
            kv, note = _model_kv(args.tokens)
            source = "smollm2"
        except Exception as exc:  # noqa: BLE001 - any failure to get the model means the synthetic fallback
            note = f"model unavailable ({type(exc).__name__}: {exc})"
    if kv is None:
        kv = _synthetic_kv(args.tokens)
        print(f"WARNING: SYNTHETIC KV, not a model's: {note}", file=sys.stderr)
    kv = kv.to(getattr(torch, args.dtype)).contiguous()
    torch.set_num_threads(1)  # throughput per core, as the targets state it
    groups = [int(g) for g in str(args.groups).split(",") if g]
    specs = [CodecSpec(m, c, args.level) for m in MODES for c in COMPRESSORS
             if m not in ("int4", "int2")]
    for mode in ("int4", "int2"):
        for group in groups:
            for option in str(args.variants).split(","):
                suffix = "" if option.strip() == "default" else f"/{option.strip()}"
                base = CodecSpec.parse(f"{mode}/g{group}{suffix}")
                specs += [s for c in COMPRESSORS  # int4's default is plain: listed once
                          if (s := CodecSpec(mode, c, args.level, group, base.variant, base.hi)) not in specs]
    memcpy_mb_s = kv.numel() * kv.element_size() / 1e6 / _median_s(kv.clone, args.repeat)
    rows = [_row(kv, spec, args.repeat, args.arrays) for spec in specs]
    shuffle_rows = _shuffle_rows(kv, args.level, args.repeat)
    _print(rows, shuffle_rows, memcpy_mb_s, source, note, kv)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "rows": rows, "memcpy_mb_s": memcpy_mb_s, "source": source, "source_note": note,
            "shape": list(kv.shape), "dtype": args.dtype, "threads": 1, "arrays": args.arrays,
            "shuffle": shuffle_rows, "targets": _targets(rows),
        }, indent=2))
    return 0


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best ratio per mode against its target, and int8+lz4 decode speed against 1 GB/s."""
    out: dict[str, Any] = {}
    for mode, target in TARGETS.items():
        best = max(r["ratio_vs_fp16"] for r in rows if r["mode"] == mode)
        out[f"{mode}_ratio"] = {"best": best, "target": target, "met": best >= target}
    speed = next(r["decode_mb_s"] for r in rows if r["spec"] == "int8+lz4")
    out["int8_lz4_decode_mb_s"] = {"value": speed, "target": DECODE_TARGET_MB_S,
                                   "met": speed >= DECODE_TARGET_MB_S}
    for mode, before in BEFORE_DECODE_MB_S.items():
        mine = [r["decode_mb_s"] for r in rows if r["mode"] == mode and r["default_variant"]
                and r["compressor"] == "lz4" and r["group_size"] == 64]
        if mine:
            out[f"{mode}_lz4_g64_default_decode_mb_s"] = {"value": mine[0], "target": before,
                                                          "met": mine[0] >= before}
    return out


def _print(rows: list[dict[str, Any]], shuffle_rows: list[dict[str, Any]], memcpy_mb_s: float,
           source: str, note: str, kv: Any) -> None:
    print(f"KV source: {source} ({note}); shape {list(kv.shape)} {kv.dtype}, "
          f"{kv.numel() * 2 / 1e6:.1f} MB as fp16; 1 thread")
    print(f"memcpy: {memcpy_mb_s:,.0f} MB/s")
    print(f"{'spec':<34}{'ratio':>8}{'enc MB/s':>10}{'dec MB/s':>10}{'K rel err':>11}"
          f"{'V rel err':>11}")
    for r in rows:
        print(f"{r['spec']:<34}{r['ratio_vs_fp16']:>8.2f}{r['encode_mb_s']:>10,.0f}"
              f"{r['decode_mb_s']:>10,.0f}{r['k_rel_err']:>11.2e}{r['v_rel_err']:>11.2e}")
    print("byte shuffle on the fp16 payload:")
    for s in shuffle_rows:
        print(f"  {s['compressor']:<5} shuffle={s['shuffle']!s:<5} ratio {s['ratio']:.3f}, "
              f"decompress {s['decompress_mb_s']:,.0f} MB/s")
    for name, t in _targets(rows).items():
        value = t.get("best", t.get("value"))
        print(f"target {name}: {value:,.2f} (>= {t['target']}) {'met' if t['met'] else 'MISSED'}")
