"""Build the redis.asyncio client for StoreSettings: standalone, TLS, unix socket, Cluster or Sentinel."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from cachestore.errors import ConfigError
from cachestore.settings import StoreSettings


def small_retry() -> Retry:
    """One quick retry (a fresh connection after a broken one), never redis-py's default 10."""
    return Retry(ExponentialBackoff(cap=0.05, base=0.005), retries=1)


def _common(settings: StoreSettings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_timeout": max(settings.op_timeout_s, settings.write_timeout_s),
        "socket_connect_timeout": settings.connect_timeout_s,
        "retry": small_retry(),
        "decode_responses": False,
    }
    if settings.tls_ca_path:
        kwargs["ssl_ca_certs"] = settings.tls_ca_path
    return kwargs


def _strip_scheme_suffix(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return scheme.split("+", 1)[0] + "://" + rest


def _sentinel_client(settings: StoreSettings) -> Redis:
    """redis+sentinel://[user:pass@]host:port[,host:port...]/master_name[/db]"""
    parts = urlsplit(settings.url)
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        creds, netloc = netloc.rsplit("@", 1)
        username, _, password = creds.partition(":")
        username, password = unquote(username) or None, unquote(password) or None
    sentinels = []
    for hostport in netloc.split(","):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("a sentinel URL lists host:port pairs separated by commas")
        sentinels.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    master = settings.sentinel_master or (path[0] if path else None)
    if not master:
        raise ConfigError("a sentinel URL needs the master name as its path, or sentinel_master=")
    db = int(path[1]) if len(path) > 1 else 0
    kwargs = _common(settings)
    kwargs.pop("retry")
    ssl = parts.scheme.startswith("rediss")
    sentinel = Sentinel(sentinels, sentinel_kwargs={"socket_timeout": settings.connect_timeout_s, "ssl": ssl},
                        username=username, password=password, db=db, ssl=ssl, **kwargs)
    return sentinel.master_for(master, max_connections=settings.max_connections, retry=small_retry())


def make_client(settings: StoreSettings) -> Any:
    """A redis.asyncio client (Redis or RedisCluster) with bounded pools and short timeouts."""
    if settings.is_sentinel:
        return _sentinel_client(settings)
    url = _strip_scheme_suffix(settings.url)
    if settings.is_cluster:
        return RedisCluster.from_url(
            url, max_connections=settings.max_connections,
            **_common(settings),
        )
    pool = BlockingConnectionPool.from_url(
        url, max_connections=settings.max_connections, timeout=settings.connect_timeout_s, **_common(settings)
    )
    return Redis(connection_pool=pool)
