"""The `kvstash` command line: one entry point, a subcommand per job.

Each command module exposes `register(subparsers)`; heavy imports (torch,
transformers) happen inside the command, so `kvstash --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules of the top-level commands; bench commands live under `bench`.
COMMANDS = ["ops.serve_cmd", "ops.sidecar_cmd", "ops.demo", "ops.admin"]
# the commands that run a model in this process: their malloc is tuned for it (service/runtime/malloc.py)
MODEL_COMMANDS = {"serve", "sidecar", "bench"}
BENCHES = [
    "ops.bench.codec",
    "ops.bench.store.command",
    "ops.bench.budget.command",
    "ops.bench.resume.command",
    "ops.bench.quality.command",
    "ops.bench.quality.layers",
    "ops.bench.fleet.load",
    "ops.bench.fleet.command",
    "ops.bench.sidecar",
    "ops.bench.sizing",
]


def _register_all(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in COMMANDS:
        importlib.import_module(module_name).register(sub)
    bench = sub.add_parser("bench", help="run a benchmark; prints a table, --json writes rows")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bench_sub.required = True
    for module_name in BENCHES:
        importlib.import_module(module_name).register(bench_sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstash", description="kvstash: a shared KV cache in Redis for stateless LLM pods"
    )
    _register_all(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from cachestore.errors import KvstashError  # noqa: PLC0415

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if isinstance(getattr(args, "model", None), str):
            from service.engines import kvgeom  # noqa: PLC0415

            if kvgeom.is_kvgeom(args.model):
                kvgeom.geometry(args.model)  # an unknown kvgeom-* name: one line, before anything starts
        if args.command in MODEL_COMMANDS:
            from cachestore.codec import kernels  # noqa: PLC0415
            from service import settings  # noqa: PLC0415
            from service.runtime import malloc  # noqa: PLC0415

            malloc.tune(settings.malloc_arenas())  # before any thread allocates
            kernels.configure()
        return int(args.func(args) or 0)
    except KvstashError as exc:
        print(f"kvstash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvstash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
