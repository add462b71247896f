"""`kvstash bench store` runs end to end on a private redis-server and reports paired and unpaired ratios."""

from __future__ import annotations

import json
from pathlib import Path

from ops.cli import main


def test_bench_store_small_run_reports_both_ratios(tmp_path: Path) -> None:
    out = tmp_path / "store.json"
    assert main(["bench", "store", "--block-sizes", "256K", "--reps", "3", "--tokens", "512",
                 "--json", str(out)]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"get", "get_reader", "get_landing", "put", "put_nobudget"}
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


def test_bench_store_on_a_cluster_reads_every_node_at_once(tmp_path: Path) -> None:
    """`--cluster 3 --server valkey`: a private 3-primary Valkey cluster; kvstash's cluster pipeline and its landing
    read beside raw redis-py's (the landing ones asserted to have landed inside the bench)."""
    out = tmp_path / "cluster.json"
    assert main(["bench", "store", "--cluster", "3", "--server", "valkey", "--block-sizes", "256K", "--reps", "2",
                 "--tokens", "256", "--json", str(out)]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"get_cluster", "get_landing"}
    for row in rows.values():
        assert row["reps"] == 2 and row["context_bytes"] == 256 * 23040
        assert row["kvstash_mb_s"] > 0 and row["raw_mb_s"] > 0 and 0 < row["paired_ratio"] < 100
