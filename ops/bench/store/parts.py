"""What `bench store` and its Cluster variant (ops/bench/store/cluster.py) share: payloads, timing, rows, the link."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from cachestore.hashing import BlockHash
from ops import netlink
from ops.bench.common import percentile

MODEL = "bench00000000000"
KIB = 1024


def split(payload: bytes, block_bytes: int) -> list[bytes]:
    return [payload[i:i + block_bytes] for i in range(0, len(payload), block_bytes)]


def fresh_hashes(n: int) -> list[BlockHash]:
    return [BlockHash(os.urandom(16)) for _ in range(n)]


def timed_blocking(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def summarize(block_bytes: int, op: str, nbytes: int, ours: list[float], raw: list[float]) -> dict[str, Any]:
    def pct(xs: list[float], q: float) -> float:
        return percentile(xs, q) * 1000

    mb = nbytes / 1e6  # MB/s from the median rep: robust to a noisy neighbour stealing the CPU
    ours_mb_s, raw_mb_s = mb / statistics.median(ours), mb / statistics.median(raw)
    return {
        "block_bytes": block_bytes, "op": op, "context_bytes": nbytes, "reps": len(ours),
        "kvstash_mb_s": round(ours_mb_s, 1), "raw_mb_s": round(raw_mb_s, 1),
        "ratio": round(ours_mb_s / raw_mb_s, 3),
        # each kvstash call against the raw call made right next to it (the order alternates rep by rep):
        # this VM's speed drifts by 10-20% over minutes, which moves both medians but not a pair
        "paired_ratio": round(statistics.median(r / o for o, r in zip(ours, raw, strict=True)), 3),
        "p50_ms": round(pct(ours, 0.5), 2), "p99_ms": round(pct(ours, 0.99), 2),
        "raw_p50_ms": round(pct(raw, 0.5), 2), "raw_p99_ms": round(pct(raw, 0.99), 2),
    }


def timeout_s(spec: netlink.LinkSpec | None, nbytes: int) -> float:
    """The stores' and raw clients' time limit for one read or write of `nbytes` (4x what a link takes, >= 30 s)."""
    return max(30.0, 4 * spec.seconds(nbytes)) if spec is not None else 30.0


def print_link(rows: list[dict[str, Any]], spec: netlink.LinkSpec, links: int) -> None:
    """Record the link in every get row (its arithmetic against raw redis-py's read, the floor) and print it."""
    print(f"\nover {links} link{'s' if links > 1 else ''} of {spec.gbit:g} Gbit/s ({spec.gbit * links:g} Gbit/s in "
          f"all), {spec.delay_ms:g} ms one way:")
    for r in rows:
        if r["op"].startswith("get"):  # on a Cluster each layout is bound by its busiest node's link
            r.update(netlink.link_fields(spec, r["context_bytes"], links, r["raw_p50_ms"] / 1000,
                                         r.get("raw_busiest_node_bytes", 0)))
            ours = netlink.link_fields(spec, r["context_bytes"], links, r["p50_ms"] / 1000,
                                       r.get("busiest_node_bytes", 0))
            r.update(kvstash_gbit_s=ours["gbit_s"], kvstash_link_ms=ours["link_ms"], kvstash_to_link=ours["to_link"])
            print(f"{r['block_bytes'] // KIB:>6}Ki {r['op']:<13} kvstash {r['kvstash_gbit_s']:.2f} Gbit/s "
                  f"({r['kvstash_to_link']:.2f}x its layout's arithmetic {r['kvstash_link_ms']:.1f} ms), raw redis-py "
                  f"{r['gbit_s']:.2f} Gbit/s ({r['to_link']:.2f}x {r['link_ms']:.1f} ms)")
    print("arithmetic: bytes x 8 / rate, of the busiest link where the bytes are not spread evenly")
