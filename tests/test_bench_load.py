"""`kvstash bench load` runs end to end: tiny-model pods, a few sessions, cache on and off, JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.cli import main


@pytest.mark.slow
def test_bench_load_tiny_cache_on_and_off(tmp_path: Path) -> None:
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    assert main(["bench", "load", "--model", "tiny-random", "--pods", "2", "--sessions", "3", "--turns", "3",
                 "--max-tokens", "4", "--doc-tokens", "100", "--think-ms", "300", "--budget-mb", "64",
                 "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    on, off = report["runs"]
    assert on["cache"] is True and off["cache"] is False
    for run in (on, off):
        assert run["ok"] == run["requests"] == 9 and run["errors"] == 0
        for field in ("requests_per_s", "ttft_ms_hit_p50", "ttft_ms_hit_p99", "ttft_ms_miss_p50",
                      "ttft_ms_miss_p99", "hit_rate_vs_possible", "bytes_held", "budget_bytes", "evictions"):
            assert field in run, field
    assert on["lookup_results"].get("miss") == 3 and on["hits"] > 0 and on["cacheable_tokens"] > 0
    assert 0 < on["bytes_held"] <= on["budget_bytes"] and on["hit_rate_vs_possible"] > 0.5
    assert off["lookup_results"] == {"bypass": 9} and off["cached_tokens"] == 0
    assert len({t["pod"] for t in report["turns"] if t["cache_enabled"]}) == 2  # the turns really hopped
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_load_sticky_baseline_skew_and_a_restart(tmp_path: Path) -> None:
    """kvstash against sticky sessions (pod-local memory KV, consistent hash on X-Session-Id), a skewed mix, and
    the busiest pod killed mid-run in both: the sessions pinned to it lose their KV with sticky routing only."""
    out, png = tmp_path / "sticky.json", tmp_path / "sticky.png"
    assert main(["bench", "load", "--model", "tiny-random", "--pods", "2", "--sessions", "4", "--turns", "4",
                 "--max-tokens", "4", "--doc-tokens", "100", "--think-ms", "1000", "--budget-mb", "64",
                 "--baseline", "sticky", "--skew", "--restart-pod-at", "30%",
                 "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    kv, sticky = report["runs"]
    assert (kv["run"], kv["cache"], sticky["run"], sticky["cache"]) == ("kvstash", True, "sticky", False)
    planned = 8 + 3 * 4  # one heavy session of twice the turns, three light ones
    for run in (kv, sticky):
        assert run["errors"] == 0 and run["ok"] == run["requests"] == planned, run
        assert run["restart"]["done"] and run["restart"]["ready_at_s"] > run["restart"]["killed_at_s"] > 0
        assert run["after_kill_ttft_ms_n"] > 0 and run["ttft_ms_heavy_n"] == 7 and run["ttft_ms_light_n"] == 9
    assert sticky["hits"] > 0 and sticky["hit_rate_vs_possible"] > 0 and sticky["pinned_sessions"] >= 1
    assert kv["after_kill_hit_rate"] >= 0.9
    rows = [t for t in report["turns"] if t["run"] == "sticky"]
    killed_at = sticky["restart"]["killed_at_s"]
    for session in {t["session"] for t in rows}:  # sticky: one pod per session until the kill
        assert len({t["pod"] for t in rows if t["session"] == session and t["ended_s"] < killed_at}) <= 1, session
    # the sessions whose last turn before the kill ran on the killed pod, at their next turn: kvstash finds all
    # of their history in Redis, sticky routing has lost it (first turns excluded: nothing to find)
    assert kv["pinned_first_turns"] > 0 and kv["pinned_resumed_whole"] == kv["pinned_first_turns"], kv
    assert sticky["pinned_first_turns"] > 0 and sticky["pinned_resumed_whole"] == 0, sticky
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
