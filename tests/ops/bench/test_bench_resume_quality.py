"""`kvstash bench resume` and `bench quality` run end to end on the tiny model and write their JSON and chart."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from ops.bench.common import pareto_frontier
from ops.bench.resume.command import _finish, _targets
from ops.cli import main

SVG = "{http://www.w3.org/2000/svg}"


def test_bench_resume_tiny_writes_rows_and_plot(tmp_path: Path) -> None:
    out, svg = tmp_path / "resume.json", tmp_path / "resume.svg"
    assert main(["bench", "resume", "--model", "tiny-random", "--contexts", "64,128", "--modes", "int8,int2",
                 "--repeat", "1", "--recompute-repeat", "1", "--json", str(out), "--plot", str(svg)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["context"], r["method"]): r for r in report["rows"]}
    methods = {"recompute", "kvstash-int8", "floor-int8", "kvstash-int2", "floor-int2", "naive"}
    assert set(rows) == {(c, m) for c in (64, 128) for m in methods}
    for r in report["rows"]:
        for field in ("context", "method", "ttft_ms_p50", "ttft_ms_p90", "bytes", "speedup_vs_recompute",
                      "ratio_to_floor"):
            assert field in r, field
        assert r["runs"] == 1 and r["ttft_ms_p90"] == r["ttft_ms_p50"] > 0  # one run: every percentile is that run
    # quantized frames are smaller than the fp32 torch.save blob, int2 smaller than int8
    int2, int8 = rows[(128, "kvstash-int2")]["bytes"], rows[(128, "kvstash-int8")]["bytes"]
    assert 0 < int2 < int8 < rows[(128, "naive")]["bytes"]
    assert rows[(128, "kvstash-int8")]["ratio_to_floor"] > 0 and rows[(128, "recompute")]["bytes"] == 0
    # what a hit allocated (Linux: its peak resident size above what the process held) beside the KV it rebuilt
    hit = rows[(128, "kvstash-int8")]
    assert hit["kv_bytes"] == 2 * rows[(64, "kvstash-int8")]["kv_bytes"] > 0
    assert isinstance(hit["hit_memory_bytes"], int) and abs(hit["hit_memory_bytes"]) < 1 << 30
    assert hit["hit_memory_to_kv"] == hit["hit_memory_bytes"] / hit["kv_bytes"]
    assert hit["memory_cold"] and "hit_memory_bytes" not in rows[(128, "kvstash-int2")]  # its length's first hit
    assert report["targets"] == {}  # targets are set at 2048 and 8128 tokens only
    chart = ET.parse(svg).getroot()  # a line per method, a point per context
    assert len(chart.findall(f"{SVG}polyline")) == len(methods) and len(chart.findall(f"{SVG}circle")) == len(rows)


def test_bench_resume_times_a_signed_hit_beside_the_unsigned_one(tmp_path: Path) -> None:
    out = tmp_path / "signed.json"
    assert main(["bench", "resume", "--model", "tiny-random", "--contexts", "64", "--modes", "int8", "--no-naive",
                 "--repeat", "2", "--recompute-repeat", "1", "--frame-key", "bench-key", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    signed, unsigned = rows["signed-int8"], rows["kvstash-int8"]
    assert signed["runs"] == unsigned["runs"] == 2 and signed["ratio_to_unsigned"] > 0
    assert signed["bytes"] == unsigned["bytes"] + 36 * (64 // 64)  # one 36-byte trailer per block
    rows_at = [{"context": c, "method": "signed-int8", "ratio_to_unsigned": v, "ratio_to_floor": None}
               for c, v in ((2048, 1.02), (8128, 1.08))]
    targets = _targets(rows_at, "hf")
    assert targets["signed_ratio_int8_2048"]["met"] and not targets["signed_ratio_int8_8128"]["met"]


def test_bench_resume_burst_reports_every_session_arriving_at_once(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    assert main(["bench", "resume", "--model", "tiny-random", "--contexts", "64", "--modes", "int8", "--no-naive",
                 "--repeat", "1", "--recompute-repeat", "1", "--burst", "3", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    hit, recompute = rows["burst3-kvstash-int8"], rows["burst3-recompute"]
    assert hit["runs"] == recompute["runs"] == 3  # one TTFT per session
    assert hit["context"] == recompute["context"] == 1984  # the tiny model's 2048-token context, less a block
    for r in (hit, recompute):  # every session timed: no percentile of an empty or unmeasured run
        assert r["ttft_ms_p50"] > 0 and r["ttft_ms_p99"] > 0
    assert hit["speedup_vs_recompute"] == recompute["ttft_ms_p50"] / hit["ttft_ms_p50"]


def test_bench_quality_tiny_writes_rows_and_plot(tmp_path: Path) -> None:
    out, svg = tmp_path / "quality.json", tmp_path / "quality.svg"
    assert main(["bench", "quality", "--text", "ops/data/sample.txt", "--model", "tiny-random", "--modes",
                 "exact,int8,int2+lz4,int2/recent=int8", "--prefix", "32", "--continuation", "16", "--windows", "2",
                 "--greedy", "3",
                 "--block-tokens", "8",  # several blocks: block 0 keeps int8 (the sink), the rest int2
                 "--size-tokens", "64", "--json", str(out), "--plot", str(svg)]) == 0
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"exact", "int8", "int2+lz4", "int2/recent=int8"}
    for r in rows.values():
        for field in ("mode", "ppl", "ppl_delta_pct", "top1_agree", "kl_mean"):
            assert field in r, field
        assert r["ppl"] > 0 and 0 <= r["top1_agree"] <= 1 and r["kl_mean"] >= 0
    assert rows["exact"]["ppl_delta_pct"] == 0 and rows["exact"]["top1_agree"] == 1 and rows["exact"]["kl_mean"] == 0
    assert rows["int2+lz4"]["kl_mean"] > rows["int8"]["kl_mean"]
    assert rows["int2+lz4"]["spec"] == "int2+lz4/g64/rotv/clip,sink=int8+lz4"
    # sizes of the 64-token context, headers included: fp32 exact is 4 bytes a value, so about half the
    # ratio of fp16 (lz4 may win a few %); int2 is smaller than int8 even with its int8 block 0
    assert 0.45 < rows["exact"]["ratio_vs_fp16_ctx"] < 0.55
    size = {mode: r["bytes_per_token_ctx"] for mode, r in rows.items()}
    assert size["int2+lz4"] < size["int8"] < size["exact"]
    # the partial block at int8 costs nothing on a context of whole blocks, something on one ending mid-block
    recent = rows["int2/recent=int8"]
    assert recent["bytes_per_token_ctx"] == size["int2+lz4"]
    assert recent["bytes_per_token_mid"] > rows["int2+lz4"]["bytes_per_token_mid"]
    assert recent["spec"] == "int2+lz4/g64/rotv/clip/recent=int8,sink=int8+lz4"
    # each window's cache ends elsewhere within a block (--ends spread): 3 blocks of 8 tokens, then 0 or 4 more
    assert report["ends"] == "spread" and sorted({w["cached_tokens"] for w in report["windows"]}) == [24, 28]
    assert len(report["windows"]) == 2 * 4 and set(report["targets"]) == {
        "sample.txt: int8", "sample.txt: int2+lz4", "sample.txt: int2/recent=int8", "greedy"}
    for r in rows.values():  # the paired interval over windows brackets the point figure
        assert r["ppl_delta_lo"] <= r["ppl_delta_pct"] <= r["ppl_delta_hi"] and r["text"] == "sample.txt"
        assert r["greedy_match_min"] <= r["greedy_match_p10"] <= r["greedy_match_median"] <= 3
    assert rows["exact"]["ppl_delta_lo"] == rows["exact"]["ppl_delta_hi"] == 0
    assert len(ET.parse(svg).getroot().findall(f"{SVG}circle")) == len(rows)  # the Pareto chart: a point a mode


def test_bench_resume_targets_follow_each_mode_and_engine() -> None:
    def row(context: int, method: str, ms: float) -> dict[str, Any]:
        return {"context": context, "method": method, "ttft_ms_p50": ms, "speedup_vs_recompute": None,
                "ratio_to_floor": None}

    rows = [row(2048, "recompute", 8000.0), row(2048, "kvstash-int8", 110.0), row(2048, "floor-int8", 100.0),
            row(8128, "kvstash-int4", 130.0), row(8128, "floor-int4", 100.0),
            row(8128, "kvstash-fp16", 120.0), row(8128, "floor-fp16", 100.0),
            row(512, "kvstash-int8", 90.0), row(512, "floor-int8", 30.0)]
    _finish(rows)
    targets = _targets(rows, "llamacpp")
    assert set(targets) == {"speedup_int8_2048_llamacpp", "floor_ratio_int8_2048", "floor_ratio_int4_8128",
                            "floor_ratio_fp16_8128"}
    assert targets["speedup_int8_2048_llamacpp"] == {"value": 8000 / 110, "target": 50.0, "met": True}
    met = {name: (round(t["value"], 2), t["target"], t["met"]) for name, t in targets.items() if "floor" in name}
    assert met == {"floor_ratio_int8_2048": (1.1, 1.15, True), "floor_ratio_int4_8128": (1.3, 1.25, False),
                   "floor_ratio_fp16_8128": (1.2, 1.15, False)}
    assert _targets(rows, "hf")["speedup_int8_2048_hf"]["target"] == 20.0
    rows[1].update(hit_memory_bytes=1400, kv_bytes=1000)  # at most 1.3x the KV bytes the hit rebuilds
    assert _targets(rows, "hf")["hit_memory_int8_2048"] == {"value": 1.4, "target": 1.3, "met": False}


def test_the_pareto_frontier_keeps_what_nothing_smaller_beats() -> None:
    points = {"exact": (46_081, 0.0), "fp16": (23_041, 0.002), "int8": (11_881, -0.017), "int4": (6_284, 0.092),
              "int4/rot": (6_306, 0.748), "int4/k8": (6_507, 0.227), "int2": (3_790, -1.364),
              "int2/plain": (3_860, 7.7)}
    assert pareto_frontier(points) == ["int2", "int4", "int8", "fp16", "exact"]
