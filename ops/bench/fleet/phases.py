"""A churn run's turns split into phases, before, during and after each event, and each phase's figures: TTFT
p50/p90, failed requests, hit rate, and the requests and busy time of each pod.

A turn belongs to the phase in which it arrived. A pod is busy while it holds at least one request (from the
moment the turn was sent to its last byte; requests decoded together count once), measured within the phase's
window of the run's clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ops.bench.common import percentile


def windows(events: Sequence[dict[str, Any]], end_s: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase: "before", then for each event that began "during E" (until it ended, or the
    run did) and "after E" (until the next event began); a phase of no length is left out."""
    out: list[tuple[str, float, float]] = []
    t, name = 0.0, "before"
    for e in events:
        if "began_s" not in e:
            continue
        began = min(e["began_s"], end_s)
        ended = min(e.get("ended_s", end_s), end_s) if e.get("done") else end_s
        out.append((name, t, began))
        out.append((f"during {e['event']}", began, ended))
        t, name = ended, f"after {e['event']}"
    out.append((name, t, end_s))
    return [w for w in out if w[2] > w[1]]


def busy_s(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end) covered by at least one of the intervals."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


def pod_of(row: dict[str, Any], names: dict[str, str]) -> str:
    """The pod that answered a turn: its own name (X-Kv-Pod), or the name of the address the balancer says it passed
    the turn to; "" where neither is known (a connection the client lost)."""
    pod = str(row.get("pod") or "")
    return pod if pod not in ("", "?") else names.get(str(row.get("upstream") or ""), "")


def phase_stats(rows: Sequence[dict[str, Any]], name: str, start: float, end: float,
                pods: Sequence[str]) -> dict[str, Any]:
    """One phase's figures, of the rows that arrived in [start, end) (rows carry "pod", see `pod_of`)."""
    inside = [r for r in rows if start <= r["arrived_s"] < end]
    ok = [r for r in inside if r.get("status") == 200]
    failed = [r for r in inside if r.get("status") not in (200, -1)]
    ttft = [r["ttft_ms"] for r in ok]
    requests = {p: sum(1 for r in ok if r["pod"] == p) for p in pods}
    served = [r for r in rows if r.get("status") == 200 and "sent_s" in r]
    busy = {p: busy_s([(r["sent_s"], r["ended_s"]) for r in served if r["pod"] == p], start, end) for p in pods}
    mean = statistics.mean(busy.values()) if busy else 0.0
    return {"phase": name, "start_s": start, "end_s": end, "arrivals": len(inside), "ok": len(ok),
            "failed": len(failed), "unsent": sum(1 for r in inside if r.get("status") == -1),
            "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p90": percentile(ttft, 0.9),
            "hit_rate": hit_rate(ok), "hit_rate_per_pod": {p: hit_rate([r for r in ok if r["pod"] == p]) for p in pods},
            "requests_per_pod": requests, "failed_per_pod": failed_per_pod(failed, pods), "busy_s_per_pod": busy,
            "busy_max_over_mean": max(busy.values()) / mean if mean > 0 else 0.0,
            "errors": sorted({str(r.get("error", ""))[:120] for r in failed})[:3]}


def failed_per_pod(failed: Sequence[dict[str, Any]], pods: Sequence[str]) -> dict[str, int]:
    """Failed turns by the pod that held them (`pod_of`; a stream lost after its headers names its pod), and under
    "unknown" those no pod is named for (a connection lost before any header), where there are any."""
    out = {p: sum(1 for r in failed if r.get("pod") == p) for p in pods}
    unknown = sum(1 for r in failed if not r.get("pod"))
    return {**out, "unknown": unknown} if unknown else out


def hit_rate(rows: Sequence[dict[str, Any]]) -> float:
    """Cached prompt tokens over prompt tokens of the answered rows (0.0 for none)."""
    ok = [r for r in rows if r.get("status") == 200]
    prompt = sum(r["prompt_tokens"] for r in ok)
    return sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0


def added_pods(rows: Sequence[dict[str, Any]], events: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each pod a scale-out added: its answered turns, their hit rate, and its first turn's, beside the fleet's hit
    rate over the same time (from the pod's first turn on); rows carry "pod" (`split` sets it)."""
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        for step in e.get("steps", []) if e["event"] == "scale-out" else []:
            theirs = sorted((r for r in rows if r.get("status") == 200 and r["pod"] == step.get("pod")),
                            key=lambda r: r["sent_s"])
            if not theirs:
                continue
            since = [r for r in rows if r.get("sent_s", -1.0) >= theirs[0]["sent_s"]]
            out[step["pod"]] = {"turns": len(theirs), "hit_rate": hit_rate(theirs),
                                "first_turn_hit_rate": hit_rate(theirs[:1]), "fleet_hit_rate_since": hit_rate(since)}
    return out


def name_pods(rows: list[dict[str, Any]], names: dict[str, str]) -> list[str]:
    """Sets each row's "pod" (`pod_of`); the fleet's pods, a pod nobody reached too."""
    for r in rows:
        r["pod"] = pod_of(r, names)
    return sorted(set(names.values()) | {r["pod"] for r in rows if r["pod"]})


def whole(rows: list[dict[str, Any]], names: dict[str, str]) -> dict[str, Any]:
    """The whole run as one phase, from the start to the last reply (every turn; each pod's busy time)."""
    end = max([r["ended_s"] for r in rows if "ended_s" in r], default=0.0)
    return phase_stats(rows, "whole run", 0.0, end + 1e-9, name_pods(rows, names))


def split(rows: list[dict[str, Any]], events: Sequence[dict[str, Any]], end_s: float,
          names: dict[str, str]) -> list[dict[str, Any]]:
    """Every phase's figures; each row gets its "pod" (`pod_of`), and each phase the ratio of its TTFT p90 and hit
    rate to the phase before the first event (`vs_before`)."""
    pods = name_pods(rows, names)
    out = [phase_stats(rows, name, a, b, pods) for name, a, b in windows(events, end_s)]
    base = out[0] if out and out[0]["phase"] == "before" else None
    for p in out:
        if base is not None and base["ttft_ms_p90"] > 0:
            p["ttft_ms_p90_vs_before"] = p["ttft_ms_p90"] / base["ttft_ms_p90"]
        if base is not None and base["hit_rate"] > 0:
            p["hit_rate_vs_before"] = p["hit_rate"] / base["hit_rate"]
    return out
