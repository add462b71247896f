"""Pod settings: read from the environment (KVSTASH_*) and CLI flags in this one place."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from cachestore.errors import ConfigError
from cachestore.keys import TENANT_PATTERN, TENANT_RE
from cachestore.settings import StoreSettings, mask_url
from service.cache.fetchplan import POLICIES as FETCH_POLICIES
from service.engines import ENGINES

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class PodSettings:
    """Everything a pod needs; frozen so every request sees one consistent view."""

    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "hf"  # hf (transformers) | llamacpp (llama-cpp-python)
    model: str = "smollm2"
    device: str = "cpu"
    parallel: int = 0  # sequences the engine decodes together; 0: the engine's own (hf 8, llama.cpp 4)
    threads: int = 0  # CPU threads of the model (llama.cpp's, or torch's for hf); 0 = one per core
    flash_attn: str = "auto"  # llama.cpp's flash attention: auto (llama.cpp decides), on or off (llama.cpp engines)
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "kvstash"
    cache_enabled: bool = True
    codec: str = "exact"  # lossless: a hit never changes the answer (README, "Picking a codec")
    block_tokens: int = 64
    block_ttl_s: int = StoreSettings.block_ttl_s  # the store's defaults are the only ones
    session_ttl_s: int = StoreSettings.session_ttl_s
    budget_bytes: int = StoreSettings.budget_bytes
    max_value_bytes: int = StoreSettings.max_value_bytes  # the store caps its default at a smaller budget
    redis_timeout_s: float = 0.5  # the request path waits on Redis at most this long
    usage_sample_s: float = 15.0  # how often the pod samples the namespace's bytes for its own gauges
    write_wait_s: float | None = None  # a reply's last byte waits at most this long for its writes (None: the
    # Redis budget, redis_timeout_s); never when this request's read already found Redis failing
    local_tier_bytes: int = 64 << 20
    fetch_policy: str = "auto"  # auto: read a hit only when that beats prefilling it (service.cache.fetchplan); always
    link_bytes_s: float = 0.0  # the read bandwidth from Redis fetch_policy=auto assumes (bytes/s); 0 = measured
    prefill_tokens_s: float = 0.0  # the prefill rate fetch_policy=auto assumes (tokens/s); 0 = measured
    memory_kv_bytes: int = 0  # > 0: the sticky-sessions baseline, KV kept in this pod's memory (service.cache.memkv),
    # no Redis; needs the cache disabled
    max_queue: int = 8  # requests admitted (running + waiting) before 503
    write_queue: int = 64  # background writes waiting before new ones are dropped
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0  # a request body must arrive within this (slow bodies get 408)
    max_tokens_limit: int = 2048
    default_max_tokens: int = 128
    api_keys: Mapping[str, str] = field(default_factory=dict, repr=False)  # key -> tenant
    tenant_secret: str = field(default="", repr=False)
    frame_key: str = field(default="", repr=False)  # signs every value this pod writes (docs/security.md)
    frame_key_previous: str = field(default="", repr=False)  # also accepted when reading: a key rotation
    tenant_quota_bytes: int = 0  # bytes each tenant may hold in the namespace (0: only the namespace budget)
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)  # tenant -> bytes, over tenant_quota_bytes
    upstream_api_key: str = field(default="", repr=False)  # the sidecar's key to llama-server (its --api-key)
    pod_name: str = ""
    drain_grace_s: float = 25.0  # SIGTERM: requests and write-back finish within this, else the pod exits at once
    drain_delay_s: float = 0.0  # SIGTERM: keep listening this long, not ready (service.runtime.drain)
    cache_dir: str = ""  # where converted models live (KVSTASH_CACHE_DIR); "" = ~/.cache/kvstash/models

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not 0 <= self.parallel <= 64 or self.threads < 0:
            raise ConfigError("parallel must be in 0..64 (0: the engine's default) and threads >= 0")
        from service.engines.llama.gguf import check_flash_attn  # noqa: PLC0415 - the engine's, with torch

        check_flash_attn(self.flash_attn)  # the codec's cache type, and the hf engine, are checked when it loads
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.block_tokens < 1 or self.block_tokens > 4096:
            raise ConfigError("block_tokens must be in 1..4096")
        if self.usage_sample_s <= 0:
            raise ConfigError("usage_sample_s must be positive")
        if self.write_wait_s is not None and self.write_wait_s < 0:
            raise ConfigError("write_wait_s must be >= 0")
        if self.redis_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ConfigError("redis_timeout_s and body_timeout_s must be positive")
        if self.fetch_policy not in FETCH_POLICIES:
            raise ConfigError(f"fetch_policy must be one of {', '.join(FETCH_POLICIES)}, got {self.fetch_policy!r}")
        if self.link_bytes_s < 0 or self.prefill_tokens_s < 0:
            raise ConfigError("link_bytes_s and prefill_tokens_s must be >= 0 (0: measured)")
        if self.memory_kv_bytes < 0:
            raise ConfigError("memory_kv_bytes must be >= 0")
        if self.memory_kv_bytes and self.cache_enabled:
            raise ConfigError("the in-memory KV cache (memory_kv_bytes) replaces Redis: run it with the Redis cache "
                              "disabled (--no-cache, KVSTASH_NO_CACHE=1)")
        if not 0 <= self.drain_delay_s < self.drain_grace_s:
            raise ConfigError("drain_grace_s must be positive and drain_delay_s in 0..drain_grace_s")
        if self.max_queue < 1 or self.write_queue < 1:
            raise ConfigError("max_queue and write_queue must be at least 1")
        if self.frame_key_previous and not self.frame_key:
            raise ConfigError("KVSTASH_FRAME_KEY_PREVIOUS needs KVSTASH_FRAME_KEY (the key pods write with)")
        if PLACEHOLDER in (self.frame_key, self.frame_key_previous, self.tenant_secret):
            raise ConfigError(f"a secret still holds the manifests' placeholder {PLACEHOLDER!r}: create it "
                              "(docs/security.md)")
        if self.frame_key and self.frame_key == self.tenant_secret:
            raise ConfigError("the frame key must differ from the tenant secret")
        if self.tenant_quota_bytes < 0:
            raise ConfigError("tenant_quota_bytes must be >= 0 (0: no default quota)")
        for tenant, quota in self.tenant_quotas.items():
            if not TENANT_RE.match(tenant) or quota <= 0:
                raise ConfigError(f"tenant quotas need a tenant matching {TENANT_PATTERN} and a positive size")
        for key, tenant in self.api_keys.items():
            if not key or not TENANT_RE.match(tenant):
                raise ConfigError(f"api keys need a non-empty key and a tenant matching {TENANT_PATTERN}")

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["redis_url"] = mask_url(self.redis_url)
        shown["api_keys"] = f"<{len(self.api_keys)} keys>"
        shown["tenant_secret"] = "***" if self.tenant_secret else ""
        shown["frame_key"] = "***" if self.frame_key else ""
        shown["frame_key_previous"] = "***" if self.frame_key_previous else ""
        shown["upstream_api_key"] = "***" if self.upstream_api_key else ""
        return "PodSettings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    @property
    def multi_tenant(self) -> bool:
        return bool(self.api_keys)

    @property
    def tenants(self) -> list[str]:
        """The tenants this pod serves (its API keys', or the default one), and those given a quota."""
        served = set(self.api_keys.values()) if self.api_keys else {DEFAULT_TENANT}
        return sorted(served | set(self.tenant_quotas))

    @property
    def write_wait(self) -> float:
        return self.redis_timeout_s if self.write_wait_s is None else self.write_wait_s

    def tenant_salt(self, tenant: str) -> bytes:
        """Salt folded into a tenant's hash chain; keyed by the shared secret when one is set."""
        if not self.tenant_secret:
            return tenant.encode()
        return hmac.new(self.tenant_secret.encode(), tenant.encode(), hashlib.sha256).digest()

    def with_overrides(self, **overrides: Any) -> PodSettings:
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


# What each setting means, in one place: `kvstash serve --help` (ops/serve_cmd.py) and docs/configuration.md
# (ops.gendocs) both read it, and `describe` adds the default from PodSettings.
SETTING_HELP: Mapping[str, str] = {
    "host": "address to bind",
    "port": "port to bind",
    "engine": "model runtime: hf (transformers) or llamacpp (llama-cpp-python); both decode requests together",
    "model": "smollm2, or kvgeom-8b, kvgeom-32b, kvgeom-70b (random weights, a real model's KV shape); hf: "
             "tiny-random or a local HF model directory; llamacpp: a local .gguf file",
    "device": "cpu or cuda[:N]",
    "parallel": "sequences decoded together (hf and llamacpp; llama-server: its slots); 0: the engine's own, 8 for "
                "hf, 4 for llama.cpp (docs/engines-codecs.md)",
    "threads": "CPU threads of the model: llama.cpp's, or torch's for hf (0: one per core)",
    "flash_attn": "llamacpp: llama.cpp's flash attention: auto (llama.cpp decides: on), on or off (off: faster "
                  "hits and decoding on CPU, docs/engines-codecs.md; a q8 cache needs it on)",
    "redis_url": "redis://, rediss://, unix:// or redis+sentinel:// URL (cluster: add ?cluster=1; store options as "
                 "query arguments)",
    "namespace": "prefix of every Redis key",
    "cache_enabled": "read and write the cache (KVSTASH_NO_CACHE=1 or --no-cache turns it off, for comparisons)",
    "codec": "exact (lossless), fp16, int8, q8 (llamacpp: a q8_0 KV cache, stored exactly), int4, int2: int4 and "
             "int2 mean the best codec of their size for the model served, by a plan made once per model and "
             "shared through Redis; a full spec (MODE+COMPRESSOR/OPTIONS...) means itself (docs/codec-spec.md)",
    "block_tokens": "tokens per cached block",
    "block_ttl_s": "TTL of cached blocks, tails and reply ids in seconds (slid by every hit)",
    "session_ttl_s": "TTL of session records in seconds (slid by every read)",
    "budget_bytes": "byte budget of the namespace in Redis (blocks evicted above it, chain ends first)",
    "max_value_bytes": "largest value written to Redis (the default is capped at budget_bytes where that is smaller)",
    "redis_timeout_s": "most a request waits on Redis before it recomputes",
    "usage_sample_s": "how often the pod samples the namespace's bytes for its gauges",
    "write_wait_s": "most a reply's last byte waits for its writes (unset: redis_timeout_s)",
    "fetch_policy": "auto: read a hit only when that beats prefilling its tokens, from the measured read "
                    "bandwidth and prefill rate; always: read every block Redis holds (docs/fetch-or-recompute.md)",
    "link_bytes_s": "with fetch_policy auto: assume this read bandwidth from Redis, bytes/s (0: measure)",
    "prefill_tokens_s": "with fetch_policy auto: assume this prefill rate, tokens/s (0: measure)",
    "local_tier_bytes": "bytes of recently used blocks kept in the pod's memory in front of Redis",
    "memory_kv_bytes": "with the cache off: KV of recent sequences kept in this pod's memory, at most this many "
                       "bytes, least recently used evicted (the sticky-sessions fleet of `kvstash bench fleet`: "
                       "only this pod can reuse it, and a restart loses it)",
    "max_queue": "requests admitted (running + waiting) before 503",
    "write_queue": "background writes waiting before new ones are dropped (and counted)",
    "max_body_bytes": "largest request body (413 above)",
    "body_timeout_s": "a request body must arrive within this (408 after)",
    "max_tokens_limit": "largest max_tokens a request may ask for",
    "default_max_tokens": "max_tokens of a request that gives none",
    "api_keys": "key1:tenantA,key2:tenantB: Bearer keys and the tenant each maps to (unset: one tenant, no auth)",
    "tenant_secret": "secret keying each tenant's hash-chain salt (set it: block keys then cannot be predicted)",
    "frame_key": "key that signs every value this pod writes (docs/security.md)",
    "frame_key_previous": "also accepted when reading: the key before a rotation",
    "tenant_quota_bytes": "bytes each tenant may hold in the namespace; a tenant over it evicts its own least "
                          "recently used entries (0: only the namespace budget)",
    "tenant_quotas": "tenantA=1GiB,tenantB=200MiB: per-tenant quotas over tenant_quota_bytes",
    "upstream_api_key": "the sidecar's key to llama-server (its --api-key)",
    "pod_name": "name reported in /readyz and the X-KV-Pod header",
    "drain_grace_s": "on SIGTERM the pod stops listening, finishes its requests and writes back what they computed "
                     "within this many seconds, then exits 0; past it, or on a second SIGTERM, it exits at once "
                     "(keep it under Kubernetes' terminationGracePeriodSeconds less the preStop sleep)",
    "drain_delay_s": "on SIGTERM, keep listening this many seconds first, answering /readyz with 503 and serving "
                     "requests with Connection: close (for balancers that only read readiness; 0: refuse new "
                     "connections at once)",
    "cache_dir": "where converted models live (unset: ~/.cache/kvstash/models)",
}


def describe(name: str) -> str:
    """A setting's meaning and its default, as `kvstash serve --help` and docs/configuration.md show them."""
    default = next(f.default for f in fields(PodSettings) if f.name == name)
    shown = "" if default in ("", None) or not isinstance(default, (str, int, float)) else f" (default {default})"
    return SETTING_HELP.get(name, "(no description yet: add one to SETTING_HELP)") + shown


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """`1GiB`, `512M`, `4096`: bytes (binary units; a ValueError for anything else)."""
    raw = text.strip().upper()
    digits = raw.rstrip("KMGTIB")
    unit = raw[len(digits):]
    if unit not in _UNITS or not digits:
        raise ValueError(f"not a size: {text!r}")
    return int(float(digits) * _UNITS[unit])


parse_size.__name__ = "size"  # in `_env_value`'s message: "must be a size"


def parse_quotas(text: str) -> dict[str, int]:
    """`tenantA=1GiB,tenantB=200MiB` -> {tenant: bytes}."""
    quotas: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, size = item.partition("=")
        try:
            quotas[tenant.strip()] = parse_size(size)
        except ValueError:
            sep = ""
        if not sep or not tenant.strip():
            raise ConfigError(f"KVSTASH_TENANT_QUOTAS must look like tenantA=1GiB,tenantB=200MiB, got {item!r}")
    return quotas


def parse_api_keys(text: str) -> dict[str, str]:
    """`key1:tenantA,key2:tenantB` -> {key: tenant}."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, tenant = item.rpartition(":")
        if not sep or not key:
            raise ConfigError("KVSTASH_API_KEYS must look like key1:tenantA,key2:tenantB")
        keys[key] = tenant
    return keys


_ENV_CASTS: dict[str, Any] = {
    "host": str, "port": int, "engine": str, "model": str, "device": str, "parallel": int, "threads": int,
    "flash_attn": str, "redis_url": str, "namespace": str,
    "codec": str, "block_tokens": int, "block_ttl_s": int, "session_ttl_s": int,
    "budget_bytes": int, "max_value_bytes": int, "redis_timeout_s": float,
    "write_wait_s": float, "usage_sample_s": float,
    "local_tier_bytes": int, "fetch_policy": str, "link_bytes_s": float, "prefill_tokens_s": float,
    "memory_kv_bytes": int, "max_queue": int, "write_queue": int, "max_body_bytes": int,
    "body_timeout_s": float,
    "max_tokens_limit": int, "default_max_tokens": int, "tenant_secret": str, "pod_name": str, "cache_dir": str,
    "drain_grace_s": float, "drain_delay_s": float,
    "frame_key": str, "frame_key_previous": str, "tenant_quota_bytes": parse_size,
    "upstream_api_key": str,
}


def configured_redis_url(environ: Mapping[str, str] | None = None) -> str | None:
    """KVSTASH_REDIS_URL when it is set (tools that must not fall back to a default Redis ask this)."""
    env = os.environ if environ is None else environ
    return env.get("KVSTASH_REDIS_URL") or None


def _env_value(env: Mapping[str, str], var: str, cast: Any) -> Any:
    """The variable `var` of `env` as `cast` makes it, None when unset or empty; a ConfigError naming it if it is not
    one."""
    raw = env.get(var)
    if raw is None or raw == "":
        return None
    try:
        return cast(raw)
    except ValueError as exc:
        name = cast.__name__
        raise ConfigError(f"{var} must be {'an' if name[0] in 'aeiou' else 'a'} {name}, got {raw!r}") from exc


MALLOC_ARENAS = 1  # service/runtime/malloc.py: one glibc arena, memory kept mapped between hits


def hub_offline() -> None:
    """No network, ever, for transformers: huggingface_hub reads HF_HUB_OFFLINE when it is first imported, so the hf
    engine's package sets it before any of its modules imports transformers."""
    os.environ["HF_HUB_OFFLINE"] = "1"


def malloc_arenas(environ: Mapping[str, str] | None = None) -> int:
    """KVSTASH_MALLOC_ARENAS: glibc malloc arenas of a kvstash process (service/runtime/malloc.py); 0 leaves glibc's
    defaults. Read by the command line before anything else runs, so not a PodSettings field."""
    value = _env_value(os.environ if environ is None else environ, "KVSTASH_MALLOC_ARENAS", int)
    if value is None:
        return MALLOC_ARENAS
    if value < 0:
        raise ConfigError(f"KVSTASH_MALLOC_ARENAS must be 0 (glibc's defaults) or more, got {value}")
    return value


# secrets a container may mount as files: KVSTASH_<NAME>_FILE holds the path (Docker and Kubernetes secrets)
SECRET_VARS = ("FRAME_KEY", "FRAME_KEY_PREVIOUS", "TENANT_SECRET", "REDIS_URL", "API_KEYS", "UPSTREAM_API_KEY")
PLACEHOLDER = "CHANGE-ME"  # what the example manifests hold until an operator creates the secret


def with_secret_files(env: Mapping[str, str]) -> Mapping[str, str]:
    """`env` with each KVSTASH_<NAME>_FILE read into KVSTASH_<NAME> (its content, surrounding whitespace stripped)."""
    out = dict(env)
    for name in SECRET_VARS:
        path = env.get(f"KVSTASH_{name}_FILE")
        if not path:
            continue
        if env.get(f"KVSTASH_{name}"):
            raise ConfigError(f"set KVSTASH_{name} or KVSTASH_{name}_FILE, not both")
        try:
            out[f"KVSTASH_{name}"] = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"KVSTASH_{name}_FILE: cannot read {path}: {exc.strerror}") from None
    return out


def settings_from_env(environ: Mapping[str, str] | None = None) -> PodSettings:
    """Build settings from KVSTASH_* variables (e.g. KVSTASH_REDIS_URL, KVSTASH_CODEC), a secret's from the file its
    KVSTASH_<NAME>_FILE names where that is set."""
    env = with_secret_files(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    for name, cast in _ENV_CASTS.items():
        value = _env_value(env, f"KVSTASH_{name.upper()}", cast)
        if value is not None:
            values[name] = value
    if env.get("KVSTASH_NO_CACHE", "").lower() in {"1", "true", "yes"}:
        values["cache_enabled"] = False
    if env.get("KVSTASH_TENANT_QUOTAS"):
        values["tenant_quotas"] = parse_quotas(env["KVSTASH_TENANT_QUOTAS"])
    if env.get("KVSTASH_API_KEYS"):
        values["api_keys"] = parse_api_keys(env["KVSTASH_API_KEYS"])
    return PodSettings(**values)
