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
