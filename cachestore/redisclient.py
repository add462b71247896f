"""Build the redis-py client for StoreSettings: standalone, TLS, unix socket, Cluster or Sentinel.

The store talks through redis.asyncio (`make_client`); the lookups' reader threads read blocks through a
blocking twin of the same client (`make_client(settings, asynchronous=False)`), which moves large values with far
less CPU than an event loop does (`kvstash bench store`: fetch, reader thread).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.retry
import redis.sentinel
from redis.asyncio.connection import parse_url
from redis.backoff import ExponentialBackoff

from cachestore.errors import ConfigError
from cachestore.settings import StoreSettings


@dataclass(frozen=True)
class _Family:
    """redis-py's classes of one flavour: asyncio, or blocking."""

    redis: Any
    pool: Any
    cluster: Any
    sentinel: Any
    retry: Any


_ASYNC = _Family(redis.asyncio.Redis, redis.asyncio.BlockingConnectionPool, redis.asyncio.cluster.RedisCluster,
                 redis.asyncio.sentinel.Sentinel, redis.asyncio.retry.Retry)
_BLOCKING = _Family(redis.Redis, redis.BlockingConnectionPool, redis.cluster.RedisCluster, redis.sentinel.Sentinel,
                    redis.retry.Retry)


def small_retry(family: _Family = _ASYNC) -> Any:
    """One quick retry (a fresh connection after a broken one), never redis-py's default 10."""
    return family.retry(ExponentialBackoff(cap=0.05, base=0.005), retries=1)


def _common(settings: StoreSettings, family: _Family) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        # a blocking client only reads blocks: its socket waits as long as a read may take
        "socket_timeout": (max(settings.op_timeout_s, settings.write_timeout_s) if family is _ASYNC
                           else settings.op_timeout_s),
        "socket_connect_timeout": settings.connect_timeout_s,
        "retry": small_retry(family),
        "decode_responses": False,
    }
    if settings.tls_ca_path:
        kwargs["ssl_ca_certs"] = settings.tls_ca_path
    return kwargs


def _strip_scheme_suffix(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return scheme.split("+", 1)[0] + "://" + rest


def _sentinel_client(settings: StoreSettings, family: _Family) -> Any:
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
    query = _query_options(parts.query)  # e.g. ?client_name=pod-a&ssl_cert_reqs=none, typed as redis-py types them
    ssl = parts.scheme.startswith("rediss")
    sentinel_kwargs = {"socket_timeout": settings.connect_timeout_s, "ssl": ssl}
    for name in ("sentinel_username", "sentinel_password"):  # credentials of the Sentinels themselves
        if name in query:
            sentinel_kwargs[name.removeprefix("sentinel_")] = query.pop(name)
    kwargs = {**_common(settings, family), "db": int(path[1]) if len(path) > 1 else 0, **query}
    kwargs.pop("retry")
    kwargs["username"] = username or kwargs.get("username")
    kwargs["password"] = password or kwargs.get("password")
    max_connections = kwargs.pop("max_connections", settings.max_connections)
    sentinel = family.sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, ssl=ssl, **kwargs)
    return sentinel.master_for(master, max_connections=max_connections, retry=small_retry(family))


def _query_options(query: str) -> dict[str, Any]:
    """A URL's query arguments as connection options, read and typed by redis-py's own URL parser."""
    if not query:
        return {}
    options: dict[str, Any] = dict(parse_url("redis://localhost/?" + query))
    options.pop("host", None)
    return options


def make_client(settings: StoreSettings, *, asynchronous: bool = True) -> Any:
    """A redis.asyncio client (Redis or RedisCluster) with bounded pools and short timeouts; with
    `asynchronous=False` its blocking twin, for threads (same URL forms, pool bound and timeouts)."""
    family = _ASYNC if asynchronous else _BLOCKING
    if settings.is_sentinel:
        return _sentinel_client(settings, family)
    url = _strip_scheme_suffix(settings.url)
    if settings.is_cluster:
        return family.cluster.from_url(
            url, max_connections=settings.max_connections,
            **_common(settings, family),
        )
    pool = family.pool.from_url(
        url, max_connections=settings.max_connections, timeout=settings.connect_timeout_s,
        **_common(settings, family),
    )
    return family.redis(connection_pool=pool)


async def check_connection(settings: StoreSettings, timeout_s: float = 5.0) -> str | None:
    """Connect, authenticate and touch one namespace key, once, at start-up.

    Raises ConfigError for what waiting cannot fix: wrong credentials, a TLS handshake or
    certificate that fails, an ACL user without access to the namespace. Returns a warning
    when Redis is merely unreachable (the pod then starts and recomputes until it is back),
    None when all is well. Messages carry the masked URL only.
    """
    import ssl  # noqa: PLC0415

    from redis import exceptions  # noqa: PLC0415

    where = settings.masked_url
    client = make_client(settings)
    try:
        probe = f"{settings.namespace}:sess:__kvstash_start_check__"
        await asyncio.wait_for(client.ping(), timeout_s)
        await asyncio.wait_for(client.exists(probe), timeout_s)
    except (exceptions.AuthenticationError, exceptions.AuthenticationWrongNumberOfArgsError) as exc:
        raise ConfigError(f"Redis at {where} refused the credentials: {exc}") from None
    except exceptions.NoPermissionError as exc:
        raise ConfigError(f"the Redis user of {where} may not use the keys {settings.namespace}:* or the "
                          f"commands kvstash needs (see docs/keys.md): {exc}") from None
    except (exceptions.ConnectionError, exceptions.TimeoutError, TimeoutError, OSError) as exc:
        chain = [exc, exc.__cause__, exc.__context__]
        tls_stalled = settings.scheme.startswith("rediss") and isinstance(exc, exceptions.TimeoutError | TimeoutError)
        if tls_stalled or any(isinstance(e, ssl.SSLError) for e in chain) or "SSL" in str(exc):
            raise ConfigError(f"TLS with Redis at {where} failed (certificate, CA or a plain-text port?): "
                              f"{exc}") from None
        return f"Redis at {where} is not reachable yet ({type(exc).__name__}); serving without the cache until it is"
    except exceptions.ResponseError as exc:
        raise ConfigError(f"Redis at {where} refused kvstash's start-up check: {exc}") from None
    finally:
        await client.aclose()
    return None
