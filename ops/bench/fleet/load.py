"""`kvstash bench load`: moved into `kvstash bench fleet`; the name stays only to say where each ability went."""

from __future__ import annotations

import argparse
import sys
from typing import Any

MOVED = ("kvstash bench load moved into kvstash bench fleet: --restart-pod-at is --churn kill (or rolling, "
         "scale-out), --skew is --skew 1 (Zipf users), --baseline is --fleets kvstash,off,sticky, --sessions is "
         "--users")


def register(bench_subparsers: Any) -> None:
    # no flags of its own (prefix "+"): whatever it is given, `run` says where it went
    p = bench_subparsers.add_parser("load", help="moved: kvstash bench fleet (--churn, --skew, --fleets)",
                                    add_help=False, prefix_chars="+")
    p.add_argument("given", nargs="*", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(f"kvstash: error: {MOVED}", file=sys.stderr)
    return 2
