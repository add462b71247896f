"""StoreSettings: where the block store's Redis lives and the limits it keeps, built from a URL; and the one
process-wide setting of the library read from the environment (KVSTASH_NATIVE_KERNELS)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from cachestore.errors import ConfigError
from cachestore.eviction import POLICIES

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# URL query options that configure kvstash itself (the rest go to redis-py untouched)
_BOOL_TRUE = {"1", "true", "yes", "on"}


_SECRETS = ("frame_key", "frame_key_previous")  # never in a repr, never taken from a URL
_QUERY_SECRET_RE = re.compile(r"([?&](?:password|pass|auth|sentinel_password)=)[^&#]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """The URL with any password (user info or a `password=` query arg) replaced by '***'.

    Safe for reprs, logs and error messages; never raises (a sentinel URL lists several hosts,
    which urlsplit cannot parse a port from)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _QUERY_SECRET_RE.sub(r"\1***", url)
    netloc, slash, tail = rest.partition("/")
    if "@" in netloc:
        creds, hosts = netloc.rsplit("@", 1)
        user, colon, _ = creds.partition(":")
        netloc = f"{user}:***@{hosts}" if colon else netloc
    return scheme + sep + _QUERY_SECRET_RE.sub(r"\1***", netloc + slash + tail)


NATIVE_KERNELS_ENV = "KVSTASH_NATIVE_KERNELS"


def native_kernels(environ: Mapping[str, str] | None = None, *, strict: bool = True) -> bool:
    """Whether KVSTASH_NATIVE_KERNELS asks for the native kernels (cachestore.codec.kernels): "1" (the default, when
    unset or empty) or "0". Strictly, anything else is a ConfigError; otherwise anything but "0" means yes (a kernel
    call reads it so on first use, where it must not raise)."""
    value = (os.environ if environ is None else environ).get(NATIVE_KERNELS_ENV, "").strip() or "1"
    if strict and value not in ("0", "1"):
        raise ConfigError(f"{NATIVE_KERNELS_ENV} must be 0 (torch alone) or 1, got {value!r}")
    return value != "0"


def index_ttl_ms(block_ttl_ms: int) -> int:
    """Index keys outlive the blocks they account for: twice the block TTL (the one place this rule lives)."""
    return 2 * block_ttl_ms


DEFAULT_MAX_VALUE_BYTES = 32 << 20  # a 64-token f16 block of a 70B-class model (80 x 8 x 128) is 20 MiB


@dataclass(frozen=True)
class StoreSettings:
    """Configuration of one BlockStore. Times in seconds, sizes in bytes."""

    url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    namespace: str = "kvstash"
    cluster: bool = False
    sentinel_master: str | None = None
    block_ttl_s: int = 86400
    session_ttl_s: int = 86400
    budget_bytes: int = 2 << 30  # the one default of the namespace budget (pods and admin read it from here)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    budget_enabled: bool = True
    index_shards: int = 16
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES  # capped at budget_bytes where that is smaller
    op_timeout_s: float = 0.5
    write_timeout_s: float = 5.0  # background writes and admin calls (store_blocks, eviction, listing)
    connect_timeout_s: float = 0.5
    max_connections: int = 32
    breaker_failures: int = 5
    breaker_reset_s: float = 5.0
    local_tier_bytes: int = 0
    tls_ca_path: str | None = None
    frame_key: str = field(default="", repr=False)  # signs every value written (cachestore.signing); "" = unsigned
    frame_key_previous: str = field(default="", repr=False)  # also accepted when reading (a key rotation)
    tenant_quota_bytes: int = 0  # bytes each tenant may hold (0: no quota but the namespace budget)
    tenant_quotas: tuple[tuple[str, int], ...] = ()  # (tenant, bytes) overrides of tenant_quota_bytes
    eviction_policy: str = "chain"  # what the budget evicts first (cachestore/eviction.py; "lru": per block)

    def __post_init__(self) -> None:
        if self.max_value_bytes == DEFAULT_MAX_VALUE_BYTES and self.budget_bytes < self.max_value_bytes:
            object.__setattr__(self, "max_value_bytes", self.budget_bytes)  # the default, capped at a small budget
        self._validate()

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={'***' if getattr(self, f.name) else ''!r}" if f.name in _SECRETS
            else f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "url"
        )
        return f"StoreSettings(url={mask_url(self.url)!r}, {shown})"

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    @property
    def is_cluster(self) -> bool:
        return self.cluster or self.scheme.endswith("+cluster")

    @property
    def is_sentinel(self) -> bool:
        return self.sentinel_master is not None or self.scheme.endswith("+sentinel")

    @property
    def signed(self) -> bool:
        return bool(self.frame_key)

    def quota_of(self, tenant: str) -> int:
        """The bytes `tenant` may hold (0: no quota of its own)."""
        return next((n for name, n in self.tenant_quotas if name == tenant), self.tenant_quota_bytes)

    @property
    def index_ttl_ms(self) -> int:
        return index_ttl_ms(self.block_ttl_s * 1000)

    def _validate(self) -> None:
        scheme = self.scheme
        if scheme not in _SCHEMES:
            raise ConfigError(f"unsupported Redis URL scheme {scheme!r}; use one of {', '.join(_SCHEMES)}")
        if not _NAMESPACE_RE.match(self.namespace):
            raise ConfigError("namespace must match [A-Za-z0-9._-]{1,64}")
        positive = ("block_ttl_s", "session_ttl_s", "budget_bytes", "max_value_bytes", "op_timeout_s",
                    "write_timeout_s",
                    "connect_timeout_s", "max_connections", "breaker_failures", "index_shards")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.breaker_reset_s < 0 or self.local_tier_bytes < 0:
            raise ConfigError("breaker_reset_s and local_tier_bytes must not be negative")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError("watermarks must satisfy 0 < low_watermark < high_watermark <= 1")
        if self.index_shards > 1024:
            raise ConfigError("index_shards must be at most 1024")
        if self.max_value_bytes > self.budget_bytes:
            raise ConfigError("max_value_bytes must not exceed budget_bytes")
        if self.frame_key_previous and not self.frame_key:
            raise ConfigError("a previous frame key needs a current one (frame_key)")
        if self.tenant_quota_bytes < 0 or any(n <= 0 for _, n in self.tenant_quotas):
            raise ConfigError("tenant quotas must be positive (tenant_quota_bytes may be 0: none)")
        if self.eviction_policy not in POLICIES:
            raise ConfigError(f"eviction_policy must be one of {', '.join(POLICIES)}")
        if self.is_cluster and self.is_sentinel:
            raise ConfigError("a store is either a Redis Cluster or behind Sentinel, not both")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> StoreSettings:
        """Settings from a URL; kvstash options may come as keyword arguments or URL query args.

        Query args naming a StoreSettings field (e.g. `?namespace=x&budget_bytes=1000`) are
        taken out of the URL; the others (e.g. `ssl_cert_reqs`) stay for redis-py.
        """
        if not isinstance(url, str) or not url:
            raise ConfigError("a Redis URL is required")
        parts = urlsplit(url)
        names = {f.name: f for f in fields(cls)}
        kept: list[tuple[str, str]] = []
        from_query: dict[str, Any] = {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key in _SECRETS or key == "tenant_quotas":
                raise ConfigError(f"{key} is not taken from a Redis URL (it would show wherever the URL does)")
            if key in names and key != "url":
                from_query[key] = value
            else:
                kept.append((key, value))
        clean = url  # rebuilt by hand only when needed: geturl() turns unix:///p into unix:/p
        if from_query:
            clean = url.split("?", 1)[0] + ("?" + urlencode(kept) if kept else "")
        merged = {**from_query, **options}
        unknown = set(merged) - set(names)
        if unknown:
            raise ConfigError(f"unknown store option(s): {', '.join(sorted(unknown))}")
        typed = {k: _cast(k, v, cls) for k, v in merged.items()}
        return cls(url=clean, **typed)

    def with_options(self, **options: Any) -> StoreSettings:
        return replace(self, **options)


def _cast(name: str, value: Any, cls: type[StoreSettings]) -> Any:
    default = next(f.default for f in fields(cls) if f.name == name)
    if isinstance(default, tuple):  # tenant_quotas: (tenant, bytes) pairs, given as keyword only
        return tuple((str(t), int(n)) for t, n in value)
    if name in _SECRETS:  # keyword only, taken as given (never URL-unquoted)
        if not isinstance(value, str):
            raise ConfigError(f"store option {name} must be a string")
        return value
    try:
        if isinstance(default, bool):
            return value if isinstance(value, bool) else str(value).lower() in _BOOL_TRUE
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"store option {name}={value!r} is not a valid {type(default).__name__}") from exc
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"store option {name} must be a string")
    return unquote(value) if isinstance(value, str) else value
