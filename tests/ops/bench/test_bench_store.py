"""`kvstash bench store` runs end to end on a private redis-server and reports paired and unpaired ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops import resultspage
from ops.cli import main


def test_bench_store_small_run_reports_both_ratios(tmp_path: Path) -> None:
    out = tmp_path / "store.json"
    assert main(["bench", "store", "--block-sizes", "256K", "--reps", "3", "--tokens", "512",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["reps"] == 3 and result["tokens"] == 512 and result["machine"]["nproc"] >= 1
    rows = {r["op"]: r for r in result["rows"]}
    assert set(rows) == {"get", "get_reader", "get_landing", "put", "put_lru", "put_nobudget", "mac_seal", "mac_open"}
    assert rows["mac_seal"]["ms_per_gb"] > 0 and rows["mac_open"]["gb_s"] > 0
    get = rows["get"]
    assert get["reps"] == 3 and get["context_bytes"] == 512 * 23040
    assert get["kvstash_mb_s"] > 0 and get["raw_mb_s"] > 0
    assert get["ratio"] == round(get["kvstash_mb_s"] / get["raw_mb_s"], 3) or abs(
        get["ratio"] - get["kvstash_mb_s"] / get["raw_mb_s"]) < 0.01
    assert 0 < get["paired_ratio"] < 100
    reader = rows["get_reader"]  # the pod's lookups read on a thread with a blocking client: measured the same way
    assert reader["reps"] == 3 and reader["context_bytes"] == get["context_bytes"] and reader["kvstash_mb_s"] > 0
    assert 0 < reader["paired_ratio"] < 100
    landing = rows["get_landing"]  # a transformers pod's lookup: frames received into one buffer, the same bytes
    assert landing["reps"] == 3 and landing["context_bytes"] == get["context_bytes"] and landing["kvstash_mb_s"] > 0
    assert 0 < landing["paired_ratio"] < 100


def test_bench_store_json_is_what_the_results_page_renders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "store.json"  # as `kvstash bench store --json docs/results/store.json` publishes a run
    assert main(["bench", "store", "--block-sizes", "256K,512K", "--reps", "2", "--tokens", "256",
                 "--json", str(out)]) == 0
    monkeypatch.setattr(resultspage, "RESULTS", tmp_path)
    files = resultspage.render()
    page = files[resultspage.PAGE]
    assert "{#store}" in page and "| 256 KiB |" in page and "| 512 KiB |" in page
    assert json.loads(out.read_text())["machine"]["date"] in page
    assert files[tmp_path / "store.svg"].startswith("<svg")


def test_bench_store_signed_run(tmp_path: Path) -> None:
    out = tmp_path / "signed.json"
    assert main(["bench", "store", "--block-sizes", "256K", "--reps", "2", "--tokens", "256", "--frame-key", "fk",
                 "--json", str(out)]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["get_landing"]["kvstash_mb_s"] > 0 and rows["mac_open"]["ms_per_gb"] > 0


def test_bench_store_on_a_cluster_reads_every_node_at_once(tmp_path: Path) -> None:
    """`--cluster 3 --server valkey`: a private 3-primary Valkey cluster; kvstash's cluster pipeline and its landing
    read beside raw redis-py's (the landing ones asserted to have landed inside the bench)."""
    out = tmp_path / "cluster.json"
    assert main(["bench", "store", "--cluster", "3", "--server", "valkey", "--block-sizes", "256K", "--reps", "2",
                 "--tokens", "256", "--json", str(out)]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"get_cluster", "get_landing"}
    for row in rows.values():
        assert row["reps"] == 2 and row["context_bytes"] == 256 * 23040
        assert row["kvstash_mb_s"] > 0 and row["raw_mb_s"] > 0 and 0 < row["paired_ratio"] < 100
