"""Plumbing of `kvstash admin`: settings from flags and the environment, one store call, the terminal."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def store_settings(args: argparse.Namespace) -> Any:
    from cachestore.errors import ConfigError  # noqa: PLC0415
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from service.settings import configured_redis_url, settings_from_env  # noqa: PLC0415

    url = args.redis_url or configured_redis_url()
    if not url:
        raise ConfigError("no Redis URL: pass --redis-url or set KVSTASH_REDIS_URL")
    pods = settings_from_env()  # the pods' own settings: one reader of the environment
    options: dict[str, Any] = {
        "namespace": args.namespace or pods.namespace, "budget_bytes": pods.budget_bytes,
        "block_ttl_s": pods.block_ttl_s, "session_ttl_s": pods.session_ttl_s, "max_value_bytes": pods.max_value_bytes,
        "write_timeout_s": 30.0, "connect_timeout_s": 5.0, "max_connections": 8,
        "frame_key": pods.frame_key, "frame_key_previous": pods.frame_key_previous,
        "tenant_quota_bytes": pods.tenant_quota_bytes, "tenant_quotas": tuple(sorted(pods.tenant_quotas.items())),
    }
    if args.index_shards:
        options["index_shards"] = args.index_shards
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
