"""`bench quality --merge`: a later codec's rows join a published run's, the others' and the exact rows kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ops.bench.quality.merge import merged

SETTINGS = {"engine": "hf", "model": "smollm2", "prefix": 512, "continuation": 256, "ends": "spread",
            "block_tokens": 64, "size_tokens": 2048}


def _run(modes: list[str], texts: list[str], windows: int, hi: float) -> dict[str, Any]:
    rows = [{"text": t, "mode": m, "windows": windows, "ppl_delta_hi": 0.0 if m == "exact" else hi}
            for t in texts for m in modes]
    return {**SETTINGS, "rows": rows, "windows": [{"text": r["text"], "mode": r["mode"], "nll": 1.0} for r in rows],
            "targets": {f"{r['text']}: {r['mode']}": {"met": hi < 3} for r in rows if r["mode"] != "exact"},
            "texts": [{"name": t} for t in texts], "machine": {"date": "d"}}


def test_a_later_codec_joins_and_replaces_only_its_own_rows(tmp_path: Path) -> None:
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(_run(["exact", "a", "b"], ["alice", "difflib.py"], 48, 4.0)))
    out = merged(path, _run(["exact", "b", "c"], ["alice", "difflib.py"], 24, 2.0))
    by = {(r["text"], r["mode"]): r for r in out["rows"]}
    assert sorted(by) == sorted((t, m) for t in ("alice", "difflib.py") for m in ("exact", "a", "b", "c"))
    assert by["alice", "exact"]["windows"] == 48 and by["alice", "a"]["ppl_delta_hi"] == 4.0  # the file's
    assert by["alice", "b"]["windows"] == 24 and by["alice", "b"]["ppl_delta_hi"] == 2.0  # replaced by the run's
    assert len(out["windows"]) == len(out["rows"])
    assert out["targets"]["alice: a"]["met"] is False and out["targets"]["alice: c"]["met"] is True
    assert out["merged"] == [{"machine": {"date": "d"}, "windows": [24], "modes": ["b", "c"]}]


def test_runs_measured_otherwise_or_files_of_another_kind_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({**_run(["exact", "a"], ["alice"], 48, 1.0), "prefix": 1024}))
    with pytest.raises(SystemExit, match="prefix"):
        merged(path, _run(["exact", "b"], ["alice"], 24, 1.0))
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a bench quality JSON"):
        merged(path, _run(["exact", "b"], ["alice"], 24, 1.0))
    with pytest.raises(SystemExit, match="cannot read"):
        merged(tmp_path / "missing.json", _run(["exact", "b"], ["alice"], 24, 1.0))


def test_the_codec_table_says_when_merged_codecs_ran() -> None:
    from ops.resultspage import _merged_line  # noqa: PLC0415

    first = {"date": "2026-12-05", "cpu": "X"}
    assert _merged_line({"machine": first, "merged": [{"machine": {"date": "2026-12-05", "cpu": "X"}}]}) == ""
    assert _merged_line({"machine": first, "merged": [{"machine": {"date": "2026-12-06", "cpu": "X"}}]}) == (
        " (codecs merged in later: 2026-12-06, the same CPU)")
    assert _merged_line({"machine": first, "merged": [{"machine": {"date": "2026-12-07", "cpu": "Y"}}]}) == (
        " (codecs merged in later: 2026-12-07, on Y)")
    assert _merged_line({"machine": first, "merged": [{"machine": {"date": "2026-12-06", "cpu": "X"}},
                                                      {"machine": {"date": "2026-12-07", "cpu": "Y"}}]}) == (
        " (codecs merged in later: 2026-12-06, 2026-12-07, some on Y)")
    assert _merged_line({"machine": first}) == ""
    from ops.resultspage import _resized_line  # noqa: PLC0415

    assert _resized_line({"resized": {"machine": {"date": "2026-12-07"}}}) == (
        "; sizes measured again on 2026-12-07 (`--resize`)")
    assert _resized_line({"machine": first}) == ""


def test_resize_measures_the_sizes_again_and_keeps_the_scores(tmp_path: Path) -> None:
    from ops.cli import main  # noqa: PLC0415

    modes = ["exact", "int8+zstd", "int4+zstd/symv/s8", "int4+zstd/rot"]  # the last retired
    run = {**_run(modes, ["alice"], 48, 0.1), "model": "tiny-random", "size_tokens": 128, "greedy": 32}
    for r in run["rows"]:
        r |= {"ratio_vs_fp16_ctx": 1.0, "ratio_vs_fp16_mid": 1.0, "bytes_per_token_ctx": 1.0, "kl_mean": 0.5}
    run["targets"] = {f"alice: {m}": {"ppl_delta_hi": 0.1, "ppl_target": 0.25, "ratio_vs_fp16": 1.0,
                                      "ratio_target": 3.5, "met": False} for m in modes[1:]}
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(run))
    assert main(["bench", "quality", "--resize", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    by = {r["mode"]: r for r in out["rows"]}
    assert 0.45 < by["exact"]["ratio_vs_fp16_ctx"] < 0.6  # fp32 KV (the default exact+lz4 saves a little)
    assert 1.8 < by["int8+zstd"]["ratio_vs_fp16_mid"] < by["int4+zstd/symv/s8"]["ratio_vs_fp16_mid"]
    assert all(r["kl_mean"] == 0.5 and r["windows"] == 48 for r in out["rows"])  # the scores as they were
    t = out["targets"]["alice: int4+zstd/symv/s8"]
    split = by["int4+zstd/symv/s8"]
    assert t["ratio_vs_fp16"] == min(split["ratio_vs_fp16_ctx"], split["ratio_vs_fp16_mid"])
    assert t["met"] == (t["ratio_vs_fp16"] >= 3.5) and "date" in out["resized"]["machine"]
    assert by["int4+zstd/rot"]["ratio_vs_fp16_mid"] == 1.0  # a retired codec's sizes as published, and said so
    assert out["resized"]["retired_sizes_kept"] == ["int4+zstd/rot"]
    path.write_text("{}")
    with pytest.raises(SystemExit, match="not a bench quality JSON"):
        main(["bench", "quality", "--resize", "--json", str(path)])


def test_rows_measured_without_the_rope_are_apart_from_the_same_codec_with_it(tmp_path: Path) -> None:
    """`--no-rope` rows (an engine that declares no RoPE encodes /kbits otherwise) join the file beside the same
    codec's rows with the RoPE, named apart in targets, and a later such run replaces only them."""
    path = tmp_path / "quality.json"
    path.write_text(json.dumps(_run(["exact", "a"], ["alice"], 48, 1.0)))
    withheld = _run(["exact", "a"], ["alice"], 48, 2.0)
    for x in withheld["rows"] + withheld["windows"]:
        if x["mode"] != "exact":
            x["rope"] = "withheld"
    withheld["targets"] = {"alice: a (RoPE withheld)": {"met": True}}
    out = merged(path, withheld)
    by = {(r["mode"], r.get("rope")): r["ppl_delta_hi"] for r in out["rows"]}
    assert by == {("exact", None): 0.0, ("a", None): 1.0, ("a", "withheld"): 2.0}
    assert set(out["targets"]) == {"alice: a", "alice: a (RoPE withheld)"} and len(out["windows"]) == 3
    path.write_text(json.dumps(out))
    withheld["rows"][1]["ppl_delta_hi"] = 3.0
    again = merged(path, withheld)
    assert {(r["mode"], r.get("rope")): r["ppl_delta_hi"] for r in again["rows"]} == {
        ("exact", None): 0.0, ("a", None): 1.0, ("a", "withheld"): 3.0}


def test_no_rope_runs_say_so_and_refuse_unrope(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main  # noqa: PLC0415
    from ops.resulttables import _quality  # noqa: PLC0415

    out = tmp_path / "quality.json"
    tiny = ["--text", "declaration", "--model", "tiny-random", "--prefix", "32", "--continuation", "16",
            "--windows", "2", "--greedy", "3", "--block-tokens", "8", "--size-tokens", "64"]
    assert main(["bench", "quality", "--no-rope", *tiny, "--modes", "exact,int4+zstd/symv/s8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r.get("rope") for r in report["rows"]] == [None, "withheld"]
    assert "declaration: int4+zstd/symv/s8 (RoPE withheld)" in report["targets"]
    assert "target declaration: int4+zstd/symv/s8 (RoPE withheld):" in capsys.readouterr().out
    table, _ = _quality(report)
    assert any("(RoPE withheld)" in line and "int4" in line for line in table)
    assert main(["bench", "quality", "--resize", "--json", str(out)]) == 0  # its sizes again, encoded as it ran
    assert json.loads(out.read_text())["rows"][1]["rope"] == "withheld"
    assert main(["bench", "quality", "--no-rope", *tiny, "--modes", "exact,int4+zstd/s8/symv/unrope"]) == 2
    assert "does not declare its model's RoPE" in capsys.readouterr().err
