"""What `kvstash bench fleet` concludes from its runs: the targets of issue 35 (knee against the bound, TTFT p90 at
the no-cache knee, no failures), the summary it prints, and the budget-pressure chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ops import svgchart
from ops.bench.common import print_table, write_chart

BUDGET_COLUMNS = [("fleet", "run", ""), ("policy", "policy", ""), ("budget_mb", "budget MiB", "d"),
                  ("ratio", "working set / budget", ".2f"), ("hit_rate", "hit", ".2f"),
                  ("optimum_hit_rate", "optimum", ".2f"), ("ttft_ms_p50", "TTFT p50", ".0f"),
                  ("ttft_ms_p90", "p90", ".0f"), ("failed", "failed", "d")]
MISS_COLUMNS = [("fleet", "run", ""), ("ok", "ok", "d"), ("failed", "failed", "d"), ("ttft_ms_p50", "TTFT p50", ".0f"),
                ("ttft_ms_p90", "p90", ".0f"), ("completion_tokens_per_s", "out tok/s", ".2f"),
                ("hit_rate", "hit", ".2f")]


def targets(runs: list[dict[str, Any]], knees: dict[str, float], calibration: dict[str, Any] | None) -> dict[str, Any]:
    """kvstash's knee >= 0.8 x bound x the no-cache knee; kvstash's TTFT p90 at the no-cache knee >= 10x lower;
    no failed requests in any fleet. A target whose fleets did not run is left out."""
    out: dict[str, Any] = {"no_failed_requests": {"value": sum(r["failed"] for r in runs),
                                                  "met": all(r["failed"] == 0 for r in runs)}}
    if calibration is None or "kvstash" not in knees or "off" not in knees:
        return out
    need = 0.8 * calibration["bound"] * knees["off"]
    out["knee_vs_bound"] = {"value": knees["kvstash"], "target": need, "bound": calibration["bound"],
                            "off_knee": knees["off"], "met": knees["off"] > 0 and knees["kvstash"] >= need}
    at = knees["off"]
    kv = next((r for r in runs if r["kind"] == "kvstash" and r["rate"] == at), None)
    off = next((r for r in runs if r["kind"] == "off" and r["rate"] == at), None)
    if kv is not None and off is not None and kv["ttft_ms_p90"] > 0:
        gain = off["ttft_ms_p90"] / kv["ttft_ms_p90"]
        out["p90_gain_at_off_knee"] = {"value": gain, "target": 10.0, "rate": at, "met": gain >= 10.0}
    return out


def print_summary(knees: dict[str, float], calibration: dict[str, Any] | None, found: dict[str, Any],
                  budget: list[dict[str, Any]], miss: list[dict[str, Any]]) -> None:
    print("\nknee (highest rate kept up with, turns/s): "
          + ", ".join(f"{k} {v:g}" for k, v in knees.items()))
    if calibration is not None:
        print(f"bound on the gain (unloaded, {calibration['prompt_tokens']} tokens): ({calibration['prefill_ms']:.0f}"
              f" + {calibration['decode_ms']:.0f}) / ({calibration['hit_ms']:.0f} + {calibration['decode_ms']:.0f})"
              f" = {calibration['bound']:.2f}x")
    if budget:
        print("\nbudget pressure (kvstash; optimum: Belady on the run's own trace)")
        print_table(budget, BUDGET_COLUMNS)
    if miss:
        print("\nmiss overhead (no reuse): kvstash on / off = "
              f"TTFT p50 {miss[0].get('ttft_ms_p50_vs_off', 0):.3f}, "
              f"tokens/s {miss[0].get('completion_tokens_per_s_vs_off', 0):.3f}")
        print_table(miss, MISS_COLUMNS)
    for name, t in found.items():
        print(f"target {name}: {t['value']:.3g}" + (f" (need {t['target']:.3g})" if "target" in t else "")
              + (" met" if t["met"] else " MISSED"))


def plot_budget(path: Path, runs: list[dict[str, Any]]) -> None:
    """Hit rate and TTFT p50 against working set / budget: two charts beside `path`, -budget-hits.svg and
    -budget-ttft.svg (one axis each)."""
    points = sorted(runs, key=lambda r: r["ratio"])
    ratios = sorted({round(r["ratio"], 2) for r in points})
    policies = list(dict.fromkeys(r.get("policy", "lru") for r in points if r["fleet"] != "no pressure"))

    def at(key: str, rows: list[dict[str, Any]]) -> list[float | None]:
        got = {round(r["ratio"], 2): r[key] for r in rows if r.get(key) is not None}
        return [got.get(x) for x in ratios]

    def of(policy: str) -> list[dict[str, Any]]:  # the no-pressure run starts every policy's line
        return [r for r in points if r.get("policy", "lru") == policy or r["fleet"] == "no pressure"]

    hits = {f"hit rate, {p}": [None if v is None else 100 * v for v in at("hit_rate", of(p))] for p in policies}
    best = at("optimum_hit_rate", points)
    if any(v is not None for v in best):
        hits["optimum (Belady)"] = [None if v is None else 100 * v for v in best]
    labels = [f"{x:g}" for x in ratios]
    write_chart(path.with_name(path.stem + "-budget-hits.svg"), svgchart.lines(
        labels, hits, xlabel="working set / byte budget", title="kvstash under budget pressure, by eviction policy",
        ylabel="hit rate, % (cached / prompt)"))
    write_chart(path.with_name(path.stem + "-budget-ttft.svg"), svgchart.lines(
        labels, {f"TTFT p50, {p}": at("ttft_ms_p50", of(p)) for p in policies}, xlabel="working set / byte budget",
        title="kvstash under budget pressure, by eviction policy", ylabel="TTFT p50, ms"))
