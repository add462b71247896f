"""`kvstash admin`: inspect and repair a kvstash namespace in any Redis (standalone or Cluster), SCAN only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from service.engines import IN_POD

READ_COMMANDS = ("stats", "sessions", "show", "verify")


def _common() -> argparse.ArgumentParser:
    """Options accepted before or after the subcommand (SUPPRESS keeps the admin-level value).

    Each parser gets its own copy: parents share action objects, and set_defaults on one would
    change the defaults of all."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--redis-url", default=argparse.SUPPRESS,
                   help="Redis URL with ACL user and password if any (default $KVSTASH_REDIS_URL); "
                        "Redis Cluster: redis+cluster://host:port")
    p.add_argument("--namespace", default=argparse.SUPPRESS, help="key prefix (default $KVSTASH_NAMESPACE or kvstash)")
    p.add_argument("--index-shards", type=int, default=argparse.SUPPRESS, help="budget index shards (default 16)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    p.add_argument("--yes", "-y", action="store_true", default=argparse.SUPPRESS,
                   help="do not ask before changing anything")
    p.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS,
                   help="no progress counter on stderr")
    return p


def _model_options(p: argparse.ArgumentParser, tenant: bool = True) -> None:
    if tenant:
        p.add_argument("--tenant", default="default", help="the session's tenant (default: default)")
    p.add_argument("--engine", choices=IN_POD, help="the pods' engine (default $KVSTASH_ENGINE or hf)")
    p.add_argument("--model", help="served model, as the pods run it (default $KVSTASH_MODEL or smollm2)")
    p.add_argument("--codec", help="the pods' codec (default $KVSTASH_CODEC or int8)")
    p.add_argument("--block-tokens", type=int, help="the pods' block size (default $KVSTASH_BLOCK_TOKENS or 64)")
    p.add_argument("--device", help="device to load the model on for its fingerprint (default cpu)")


def register(sub: Any) -> None:
    admin: argparse.ArgumentParser = sub.add_parser(
        "admin", parents=[_common()], help="inspect and repair what kvstash holds in Redis",
        description="Inspect and repair a kvstash namespace in Redis (standalone or Cluster). Reads use SCAN, "
                    "never KEYS. Commands that change data ask first unless --yes. The tenant secret, when the "
                    "pods use one, is read from $KVSTASH_TENANT_SECRET only.",
    )
    admin.set_defaults(redis_url=None, namespace=None, index_shards=None, json=False, yes=False, no_progress=False)
    cmds = admin.add_subparsers(dest="admin_command", metavar="COMMAND")
    cmds.required = True
    cmds.add_parser("stats", parents=[_common()], help="keys and bytes by kind and model, budget, server counters")
    p = cmds.add_parser("sessions", parents=[_common()], help="list session records")
    p.add_argument("--tenant", help="only this tenant's sessions")
    p.add_argument("--limit", type=int, default=100_000, help="list at most this many (default 100000)")
    for name, text in (("show", "print one session record"), ("delete", "delete one session record")):
        p = cmds.add_parser(name, parents=[_common()], help=text)
        p.add_argument("session", help="session id")
        p.add_argument("--tenant", default="default", help="the session's tenant (default: default)")
    p = cmds.add_parser("verify", parents=[_common()], help="check frames, records, TTLs and the budget index")
    p.add_argument("--fix", action="store_true", help="repair what verify finds (asks first unless --yes)")
    p = cmds.add_parser("evict", parents=[_common()], help="evict blocks down to a size, chain ends first")
    p.add_argument("--to-bytes", type=int, required=True, help="bytes the namespace may hold afterwards")
    p = cmds.add_parser("purge", parents=[_common()], help="delete every block and session of one model")
    p.add_argument("--model", required=True, metavar="FINGERPRINT", help="16-hex model id (see `stats`)")
    p = cmds.add_parser("export", parents=[_common()], help="write a session and its blocks to a portable file")
    p.add_argument("session", help="session id")
    p.add_argument("file", type=Path, help="output file (JSON)")
    _model_options(p)
    p = cmds.add_parser("import", parents=[_common()], help="load a session file written by `export`")
    p.add_argument("file", type=Path, help="input file")
    p.add_argument("--replace", action="store_true", help="overwrite an existing session of the same id")
    _model_options(p, tenant=False)
    admin.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ops import admin_cmds  # noqa: PLC0415 - commands import the cache library; --help does not need it
    from ops.admin_console import progress, store_settings  # noqa: PLC0415

    settings = store_settings(args)
    handler = getattr(admin_cmds, f"cmd_{args.admin_command}")
    result = handler(args, settings)
    if progress(args) is not None:
        print("", file=sys.stderr)
    return int(result or 0)
