"""`kvstash bench quality`: its flags, and which of the two jobs a run is (scoring codecs, or `--resize`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ops.bench.common import check_chart
from ops.bench.quality import resize, scoring
from ops.bench.quality.scoring import MODES, SCORERS


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("quality", help="perplexity, top-1, KL, greedy match and size of each codec mode")
    p.add_argument("--text", action="append", default=None,
                   help="a text set (held-out, the default; calibration; all), a shipped text's name or a "
                        "plain-text file; repeatable")
    p.add_argument("--engine", default="hf", choices=sorted(SCORERS), help="engine that runs the model (default hf)")
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-random or a local HF directory")
    p.add_argument("--modes", default=MODES, help="codec specs to compare (default %(default)s)")
    p.add_argument("--prefix", type=int, default=512, help="tokens in the cache (default 512)")
    p.add_argument("--continuation", type=int, default=256, help="tokens scored after it (default 256)")
    p.add_argument("--windows", type=int, default=24, help="windows spread over each text (default 24)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per encoded block, as the pod (default 64)")
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens compared per window (default 32)")
    p.add_argument("--ends", default="spread", choices=("spread", "fixed"),
                   help="where each window's cache ends within a block: spread evenly over the windows (default), or "
                        "fixed at the prefix's last token but one")
    p.add_argument("--size-tokens", type=int, default=2048,
                   help="context whose encoded bytes per token are reported (default 2048; the text repeats if short)")
    p.add_argument("--json", type=Path, help="write rows and targets as JSON here")
    p.add_argument("--merge", action="store_true",
                   help="add this run's codec rows to the --json file's (same texts and settings), in place of any of "
                        "the same codec and text (and --no-rope or not: ops/bench/quality/merge.py)")
    p.add_argument("--resize", action="store_true",
                   help="score nothing: recompute the sizes (x fp16) of every row of the --json file with this "
                        "build's codecs, after a change to how frames are stored")
    p.add_argument("--no-rope", action="store_true",
                   help="encode as for an engine that declares no RoPE (Gemma 3, gpt-oss, a GGUF with RoPE scaling): "
                        "/kbits ranks key channels without their RoPE pairs, /unrope is refused; rows say so")
    p.add_argument("--plot", type=Path,
                   help="Pareto chart: perplexity change vs bytes per token, every mode (an .svg file)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_chart(args.plot)
    return resize.resize(args) if args.resize else scoring.run(args)
