"""Plumbing of `kvstash admin`: settings from flags and the environment, one store call, the terminal."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def store_settings(args: argparse.Namespace) -> Any:
    from cachestore.errors import ConfigError  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415

    url = args.redis_url or os.environ.get("KVSTASH_REDIS_URL")
    if not url:
        raise ConfigError("no Redis URL: pass --redis-url or set KVSTASH_REDIS_URL")
    options: dict[str, Any] = {
        "namespace": args.namespace or os.environ.get("KVSTASH_NAMESPACE") or "kvstash",
        "write_timeout_s": 30.0, "connect_timeout_s": 5.0, "max_connections": 8,
    }
    if args.index_shards:
        options["index_shards"] = args.index_shards
    for name, env in (("budget_bytes", "KVSTASH_BUDGET_BYTES"), ("block_ttl_s", "KVSTASH_BLOCK_TTL_S"),
                      ("session_ttl_s", "KVSTASH_SESSION_TTL_S"), ("max_value_bytes", "KVSTASH_MAX_VALUE_BYTES")):
        if os.environ.get(env):
            try:
                options[name] = int(os.environ[env])
            except ValueError as exc:
                raise ConfigError(f"{env} must be an integer") from exc
    return StoreSettings.from_url(url, **options)


def progress(args: argparse.Namespace) -> Callable[[int], None] | None:
    if args.no_progress or not sys.stderr.isatty():
        return None

    def show(n: int) -> None:
        print(f"\rscanned {n} keys", end="", file=sys.stderr, flush=True)

    return show


def confirm(args: argparse.Namespace, question: str) -> None:
    from cachestore.errors import KvstashError  # noqa: PLC0415

    if args.yes:
        return
    if not sys.stdin.isatty():
        raise KvstashError(f"{question} -- refusing without a terminal to confirm on; pass --yes")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise KvstashError("cancelled")


def call(settings: Any, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run `work(store)` on a fresh BlockStore; any Redis failure becomes one StoreError line."""
    from redis.exceptions import RedisClusterException, RedisError  # noqa: PLC0415

    from cachestore.errors import StoreError  # noqa: PLC0415
    from cachestore.store import BlockStore  # noqa: PLC0415

    async def main() -> T:
        store = BlockStore(settings)
        try:
            return await work(store)
        finally:
            try:
                await store.close()
            except (RedisError, RedisClusterException, OSError):
                pass

    try:
        return asyncio.run(main())
    except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
        detail = str(exc).strip() or type(exc).__name__
        raise StoreError(f"Redis at {settings.masked_url}: {detail}") from exc


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def when(ts: float | None) -> str:
    return "-" if not ts else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
