"""The numbers `kvstash bench load` reports from its turn rows (TTFT percentiles, hit rate against the best
possible, heavy against light sessions, the turns after a pod was killed) and the tables it prints."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ops.bench.common import percentile, print_table


def hit_rate(rows: list[dict[str, Any]]) -> float:
    """Cached tokens over the tokens some earlier turn of the session had computed (0.0 when none could be)."""
    cacheable = sum(r["cacheable_tokens"] for r in rows)
    cached = sum(min(r["cached_tokens"], r["cacheable_tokens"]) for r in rows)
    return cached / cacheable if cacheable else 0.0


def ttft(rows: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """{prefix}_p50 / _p99 (ms) and {prefix}_n of the rows' TTFT."""
    values = [r["ttft_ms"] for r in rows]
    return {f"{prefix}_p50": percentile(values, 0.5), f"{prefix}_p99": percentile(values, 0.99),
            f"{prefix}_n": len(values)}


def summary(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    ok = [r for r in rows if r.get("status") == 200]
    first = [r["ttft_ms"] for r in ok if r["turn"] == 1]
    later = [r["ttft_ms"] for r in ok if r["turn"] > 1]
    hits = [r["ttft_ms"] for r in ok if r.get("cache") == "hit"]
    misses = [r["ttft_ms"] for r in ok if r.get("cache") in ("miss", "bypass", "recompute")]
    per_pod: Counter[str] = Counter()
    computed: Counter[str] = Counter()
    for r in ok:
        per_pod[r["pod"]] += 1
        computed[r["pod"]] += r["prompt_tokens"] - r["cached_tokens"]
    return {
        "requests": len(rows), "ok": len(ok), "errors": len(rows) - len(ok), "wall_s": wall_s,
        "retries": sum(r.get("retries", 0) for r in rows),
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "completion_tokens_per_s": sum(r["completion_tokens"] for r in ok) / wall_s if wall_s else 0.0,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "cached_tokens": sum(r["cached_tokens"] for r in ok),
        "cacheable_tokens": sum(r["cacheable_tokens"] for r in ok), "hit_rate_vs_possible": hit_rate(ok),
        "lookup_results": dict(Counter(r["cache"] for r in ok)), "pods_used": sorted(per_pod),
        "turns_per_pod": dict(sorted(per_pod.items())), "computed_tokens_per_pod": dict(sorted(computed.items())),
        "ttft_ms_hit_p50": percentile(hits, 0.5), "ttft_ms_hit_p99": percentile(hits, 0.99), "hits": len(hits),
        "ttft_ms_miss_p50": percentile(misses, 0.5), "ttft_ms_miss_p99": percentile(misses, 0.99),
        "misses": len(misses),
        "ttft_ms_first_turn_p50": percentile(first, 0.5), "ttft_ms_first_turn_p99": percentile(first, 0.99),
        "ttft_ms_later_turns_p50": percentile(later, 0.5), "ttft_ms_later_turns_p99": percentile(later, 0.99),
    }


def skew(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Later turns of the heavy sessions and of the light ones, apart."""
    later = [r for r in rows if r.get("status") == 200 and r["turn"] > 1]
    heavy = [r for r in later if r["heavy"]]
    light = [r for r in later if not r["heavy"]]
    return {**ttft(heavy, "ttft_ms_heavy"), **ttft(light, "ttft_ms_light"),
            "hit_rate_heavy": hit_rate(heavy), "hit_rate_light": hit_rate(light)}


def after_kill(rows: list[dict[str, Any]], restart: dict[str, Any]) -> dict[str, Any]:
    """Later turns answered after the kill (in flight then, or sent later), all of them and those of the sessions
    whose last turn before the kill ran on the killed pod (sticky routing pinned them there)."""
    if not restart.get("done"):
        return {}
    killed_at = restart["killed_at_s"]
    ok = [r for r in rows if r.get("status") == 200]
    last_before: dict[int, dict[str, Any]] = {}
    for r in sorted(ok, key=lambda r: r["ended_s"]):
        if r["ended_s"] <= killed_at:
            last_before[r["session"]] = r
    pinned = {s for s, r in last_before.items() if r["pod"] == restart["pod"]}
    after = [r for r in ok if r["turn"] > 1 and r["ended_s"] > killed_at]
    theirs = [r for r in after if r["session"] in pinned]
    first: dict[int, dict[str, Any]] = {}
    for r in sorted(theirs, key=lambda r: r["ended_s"]):
        first.setdefault(r["session"], r)
    ready = restart.get("ready_at_s")
    back = [r for r in after if ready is not None and r["started_s"] >= ready]
    return {
        **ttft(after, "after_kill_ttft_ms"), "after_kill_hit_rate": hit_rate(after),
        "after_kill_misses": sum(1 for r in after if r["cache"] in ("miss", "bypass", "recompute")),
        "pinned_sessions": len(pinned), **ttft(theirs, "pinned_after_kill_ttft_ms"),
        "pinned_after_kill_hit_rate": hit_rate(theirs), "pinned_first_turns": len(first),
        # of those sessions' first turns after the kill, how many found every token of their history cached
        "pinned_resumed_whole": sum(1 for r in first.values() if r["cached_tokens"] >= r["cacheable_tokens"]),
        **ttft(back, "after_ready_ttft_ms"), "after_ready_hit_rate": hit_rate(back),
    }


MAIN_COLUMNS = [("label", "run", ""), ("ok", "ok", "d"), ("errors", "err", "d"), ("requests_per_s", "req/s", ".2f"),
                ("completion_tokens_per_s", "tok/s", ".1f"), ("ttft_ms_first_turn_p50", "turn1 p50", ".0f"),
                ("ttft_ms_hit_p50", "hit p50", ".0f"), ("ttft_ms_hit_p99", "hit p99", ".0f"),
                ("ttft_ms_later_turns_p50", "turn2+ p50", ".0f"), ("ttft_ms_later_turns_p99", "turn2+ p99", ".0f"),
                ("ttft_ms_miss_p50", "miss p50", ".0f"), ("hit_rate_vs_possible", "hit rate", ".3f")]
SKEW_COLUMNS = [("label", "run", ""), ("ttft_ms_heavy_p50", "heavy p50", ".0f"),
                ("ttft_ms_heavy_p99", "heavy p99", ".0f"), ("hit_rate_heavy", "heavy hit", ".3f"),
                ("ttft_ms_light_p50", "light p50", ".0f"), ("ttft_ms_light_p99", "light p99", ".0f"),
                ("hit_rate_light", "light hit", ".3f"), ("turns_per_pod", "turns per pod", "")]
RESTART_COLUMNS = [("label", "run", ""), ("after_kill_ttft_ms_n", "turns after kill", "d"),
                   ("after_kill_hit_rate", "hit rate", ".3f"), ("after_kill_ttft_ms_p50", "p50", ".0f"),
                   ("after_kill_ttft_ms_p99", "p99", ".0f"), ("pinned_sessions", "its sessions", "d"),
                   ("pinned_resumed_whole", "resumed whole", "d"), ("pinned_first_turns", "of", "d"),
                   ("pinned_after_kill_hit_rate", "their hit rate", ".3f"),
                   ("pinned_after_kill_ttft_ms_p50", "their p50", ".0f"),
                   ("after_ready_hit_rate", "hit rate once back", ".3f")]


def print_report(runs: list[dict[str, Any]], skewed: bool, restart: str | None) -> None:
    """One row per run; then the heavy and light sessions apart, and the turns after the kill, when asked."""
    print_table(runs, MAIN_COLUMNS)
    if skewed:
        print("\nskewed mix: later turns of the heavy sessions and of the light ones")
        print_table(runs, SKEW_COLUMNS)
    if restart is not None:
        print(f"\npod killed ({restart}) and restarted: later turns answered after the kill")
        for r in runs:
            event = r.get("restart", {})
            print(f"  {r['label']}: " + (f"{event['pod']} killed at {event['killed_at_s']:.1f} s, ready again at "
                                         f"{event.get('ready_at_s', float('nan')):.1f} s"
                                         if event.get("done") else "not restarted (the run ended first)"))
        print_table(runs, RESTART_COLUMNS)
