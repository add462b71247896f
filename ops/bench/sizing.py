"""`kvstash bench sizing`: the bytes a token each kvgeom geometry's KV takes in Redis under each codec, measured by
encoding the KV a kvgeom model computed, block by block as a pod writes it (frame headers, scales and compression
included), and what follows from them: conversations a GB of Redis holds, and the link a fleet's hits need.

The KV is the model's own, on the hf engine, held as fp16 (what a GPU pod in half precision hands over; `exact` of
it is fp16's bytes). The models' weights are random, so a compressor's gain on these values is a random model's, not
a trained one's; the quantized sizes (codes and scales) do not depend on the values."""

from __future__ import annotations

import argparse
from typing import Any

from ops.bench.common import machine, print_table, write_json
from service.engines.generation import GenRequest

CODECS = "exact,int8,int4"
CONTEXTS = (2048, 8192)  # conversation lengths a GB of Redis is counted in
GB = 10**9


def register(bench_subparsers: Any) -> None:
    from service.engines.kvgeom import GEOMETRIES  # noqa: PLC0415

    p = bench_subparsers.add_parser("sizing", help="encoded KV bytes a token of each kvgeom model and codec")
    p.add_argument("--models", default=",".join(GEOMETRIES), help="kvgeom models to measure (default %(default)s)")
    p.add_argument("--codecs", default=CODECS, help="codec specs to encode with (default %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="tokens of KV encoded, a multiple of --block-tokens "
                   "(default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block, as the pod (default 64)")
    p.add_argument("--json", help="write the rows to this JSON file (docs/results/sizing.json is the published one)")
    p.set_defaults(func=run)


def _kv(model: str, tokens: int) -> tuple[Any, Any]:
    """[layers, 2, kv_heads, tokens, head_dim] fp16: the KV the model computes for `tokens` tokens of a chat, and the
    engine that computed it."""
    import torch  # noqa: PLC0415

    from ops.bench.quality.texts import HELD_OUT, read  # noqa: PLC0415
    from service.engines import GenParams  # noqa: PLC0415
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415

    engine = HfEngine.load(model, parallel=1)
    text = read(HELD_OUT[0])
    ids = engine.chat_ids([{"role": "user", "content": text}])[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"the text gives {len(ids)} tokens, fewer than --tokens {tokens}")
    kv = engine.generate(GenRequest(ids, None, GenParams(max_tokens=1))).kv[:, :, :, :tokens]
    return kv.to(torch.float16).contiguous(), engine


def measure(model: str, codecs: list[str], tokens: int, block_tokens: int) -> list[dict[str, Any]]:
    """One row a codec: `model`'s encoded bytes a token, and what they size. A name (int4, int2) is written out as
    the model's own codec plan has it, as a pod serves it; bytes are of the full blocks after block 0 (the sink block,
    one a chain, keeps int8 under 4- and 2-bit codecs), what a long conversation's blocks take."""
    from cachestore.codec import BlockCodecs  # noqa: PLC0415
    from service.cache.codecnames import written_out  # noqa: PLC0415
    from service.engines import kvgeom  # noqa: PLC0415

    shape = kvgeom.geometry(model)
    kv, engine = _kv(model, tokens)
    rope = engine.kv_layout.rope
    specs = written_out(",".join(codecs), engine, rope)[0].split(",")
    rows = []
    for name, spec in zip(codecs, specs, strict=True):
        codec = BlockCodecs.for_spec(spec, rope=rope).main
        starts = range(block_tokens, tokens, block_tokens)
        encoded = sum(len(codec.encode(kv[:, :, :, start:start + block_tokens].contiguous())) for start in starts)
        per_token = encoded / (len(starts) * block_tokens)
        row: dict[str, Any] = {
            "model": model, "geometry": f"{shape.layers}x{shape.kv_heads}x{shape.head_dim}", "codec": name,
            "spec": codec.spec.name(), "bytes_per_token": round(per_token),
            "fp16_bytes_per_token": shape.bytes_per_token(), "ratio": round(per_token / shape.bytes_per_token(), 4),
        }
        for context in CONTEXTS:
            row[f"per_gb_{context}"] = round(GB / (per_token * context), 2)
            # a hit on another pod reads the whole prefix: gigabits a turn, the link one turn a second needs
            row[f"gbit_per_turn_{context}"] = round(per_token * context * 8 / GB, 3)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from service.engines import kvgeom  # noqa: PLC0415

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for model in models:
        kvgeom.geometry(model)  # an unknown name: one line before any work
    if args.block_tokens <= 0 or args.tokens < 2 * args.block_tokens or args.tokens % args.block_tokens:
        raise SystemExit("--tokens must be a multiple of --block-tokens, at least two blocks")
    before = machine()
    rows = [row for model in models for row in measure(model, codecs, args.tokens, args.block_tokens)]
    print_table(rows, [("model", "model", ""), ("codec", "codec", ""), ("bytes_per_token", "B/token", ","),
                       ("ratio", "of fp16", ".3f"), ("per_gb_2048", "2k convs/GB", ".1f"),
                       ("per_gb_8192", "8k convs/GB", ".2f"), ("gbit_per_turn_2048", "Gbit/turn 2k", ".2f"),
                       ("gbit_per_turn_8192", "Gbit/turn 8k", ".2f")])
    if args.json:
        write_json(args.json, {"rows": rows, "tokens": args.tokens, "block_tokens": args.block_tokens,
                               "machine": before})
    return 0
