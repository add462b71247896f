"""Prometheus metrics of one pod, in a registry of its own (several apps may share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
BREAKER_STATES = ("closed", "half_open", "open")


class _StoreCollector(Collector):
    """Reads the store's own counters at scrape time, so they are never double-kept."""

    def __init__(self, read: Callable[[], dict[str, Any] | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        stats = self._read()
        if not stats:
            return
        counters = CounterMetricFamily("kvstash_store_events", "Store events by kind", labels=["event"])
        for key in ("hits", "misses", "partial_hits", "evictions", "errors", "dropped_writes",
                    "bytes_read", "bytes_written", "bad_records", "cas_conflicts", "timeouts", "rejected_mac",
                    "tenant_evictions", "lost_parent_writes", "blocks_restored"):
            if key in stats:
                counters.add_metric([key], float(stats[key]))
        yield counters
        breaker = GaugeMetricFamily("kvstash_breaker_state", "Redis circuit breaker (1 = current state)",
                                    labels=["state"])
        current = stats.get("breaker_state", "closed")
        for state in BREAKER_STATES:
            breaker.add_metric([state], 1.0 if state == current else 0.0)
        yield breaker


class PodMetrics:
    def __init__(self, store_stats: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstash_requests", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram("kvstash_request_latency_seconds", "Request latency", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvstash_ttft_seconds", "Time to first token", ["cache"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvstash_prompt_tokens", "Prompt tokens by source", ["source"], registry=r)
        self.lookups = Counter("kvstash_cache_lookups", "Cache lookups by result", ["result"], registry=r)
        self.bytes_fetched = Counter("kvstash_bytes_fetched", "Encoded KV bytes read from Redis", registry=r)
        self.bytes_stored = Counter("kvstash_bytes_stored", "Encoded KV bytes written to Redis", registry=r)
        self.codec_seconds = Histogram("kvstash_codec_seconds", "KV encode/decode time", ["op"],
                                       buckets=FAST_BUCKETS, registry=r)
        self.redis_seconds = Histogram("kvstash_redis_seconds", "Redis operation time", ["op"],
                                       buckets=FAST_BUCKETS, registry=r)
        self.write_queue_depth = Gauge("kvstash_write_queue_depth", "Background write jobs queued or being written",
                                       registry=r)
        self.writes_dropped = Counter("kvstash_writes_dropped", "Background writes dropped (queue full or failed)",
                                      ["reason"], registry=r)
        self.cache_rejected = Counter("kvstash_cache_rejected", "Cached values discarded as corrupt or not this "
                                      "pod's (reason: corrupt, retired: a frame format kvstash no longer reads, codec, "
                                      "model; mac: not signed under its key by an accepted frame key)", ["reason"],
                                      registry=r)
        self.frames_rejected = Counter("kvstash_frames_rejected", "Values read back that were not signed under "
                                       "their key by an accepted frame key (reason: mac), a miss; the same events "
                                       "as kvstash_cache_rejected_total{reason=\"mac\"}", ["reason"], registry=r)
        self.tenant_bytes = Gauge("kvstash_tenant_bytes_held", "Bytes a tenant's entries hold in the namespace, as "
                                  "the budget index accounts them (sampled; this pod's tenants)", ["tenant"],
                                  registry=r)
        self.tenant_quota = Gauge("kvstash_tenant_quota_bytes", "A tenant's byte quota (this pod's tenants that "
                                  "have one)", ["tenant"], registry=r)
        self.tail_lookups = Counter("kvstash_tail_lookups", "Cached tails read back (used, mismatch: they did "
                                    "not continue the prompt)", ["result"], registry=r)
        self.reply_ids = Counter("kvstash_reply_ids", "Assistant messages tokenized as the ids a pod generated "
                                 "(used) or as plain text (absent, mismatch)", ["result"], registry=r)
        self.write_waits = Counter("kvstash_write_waits", "Replies that waited for their writes before the last "
                                   "byte: written, or late (the budget ran out; the write went on)", ["result"],
                                   registry=r)
        self.bytes_held = Gauge("kvstash_cache_bytes_held", "Bytes the namespace holds in Redis, as the budget "
                                "index accounts them (sampled by every pod); with --memory-kv-bytes, the KV bytes "
                                "this pod keeps in its own memory", registry=r)
        self.dead_bytes = Gauge("kvstash_cache_dead_bytes", "Bytes of blocks the namespace holds whose chain is "
                                "broken (a block before them is gone: no lookup reaches them; `kvstash admin verify "
                                "--fix` reclaims them), from the budget index every DEAD_SAMPLE_EVERY samples",
                                registry=r)
        self.budget = Gauge("kvstash_cache_budget_bytes", "The namespace's byte budget (with --memory-kv-bytes, "
                            "this pod's)", registry=r)
        self.entries_held = Gauge("kvstash_cache_entries", "Blocks, tails and reply records the namespace holds "
                                  "(sampled); with --memory-kv-bytes, sequences this pod keeps", registry=r)
        self.inflight = Gauge("kvstash_inflight_requests", "Requests admitted and not finished", registry=r)
        self.draining = Gauge("kvstash_draining", "1 from the pod's SIGTERM on: not ready, finishing its requests "
                              "and write-back before it exits (service.runtime.drain)", registry=r)
        self.rejected = Counter("kvstash_rejected", "Requests refused with 503 (overload)", registry=r)
        self.fetch_plans = Counter("kvstash_fetch_plans", "Lookups by what their fetch-or-recompute plan read of the "
                                   "blocks Redis may hold: fetch (all), shortened (the prefix that fits the Redis "
                                   "budget), recompute (none: prefilling them is faster), probe (all: the estimates "
                                   "are not known yet, or stale)", ["decision"], registry=r)
        self.fetch_skipped_blocks = Counter("kvstash_fetch_skipped_blocks", "Blocks prefilled instead of read: for "
                                            "recompute, those Redis held (counted without reading them); for "
                                            "shortened, the prompt's blocks after the planned prefix", registry=r)
        self.link_estimate = Gauge("kvstash_link_bytes_per_second", "The read bandwidth from Redis the fetch plans "
                                   "assume (measured end to end, or configured; 0: not known yet)", registry=r)
        self.prefill_estimate = Gauge("kvstash_prefill_tokens_per_second", "The prefill rate the fetch plans assume "
                                      "(measured, or configured; 0: not known yet)", registry=r)
        self.frames_signed = Gauge("kvstash_frames_signed", "1: this pod signs every value it writes and checks every "
                                   "value it reads (KVSTASH_FRAME_KEY); 0: unsigned, so any client that can write to "
                                   "this Redis can hand the pod KV of its choosing", registry=r)
        r.register(_StoreCollector(store_stats))
