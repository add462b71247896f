"""`kvstash bench layers` on the tiny model: a ranking of every layer's keys and values, and a suggestion within
the size budget (the structure of its output, not its figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachestore.codec import CodecSpec
from ops.bench.quality.layers import RANK_FIELD, _halves, _rank
from ops.bench.quality.scoring import pareto_intervals, pareto_points
from ops.cli import main

ARGS = ["bench", "layers", "--model", "tiny-random", "--text", "ops/data/sample.txt", "--windows", "2",
        "--prefix", "32", "--continuation", "8", "--block-tokens", "8", "--size-tokens", "64"]


SPLIT2 = "int2+zstd/rotv/clip/outk/symv/s8"


@pytest.mark.parametrize(("base", "flag", "upgrade"), [("int4+zstd/symv/s8", "k5", ["--rank", "mean"]),
                                                       (SPLIT2, "k3", ["--upgrade", "bit"])])
def test_bench_layers_ranks_every_half_and_suggests_a_spec(tmp_path: Path, base: str, flag: str, upgrade: list[str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "layers.json"
    assert main([*ARGS, "--base", base, *upgrade, "--min-ratio", "1", "--max-layers", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    layers = 2  # the tiny model's
    assert sorted((r["layer"], r["part"]) for r in report["ranked"]) == [(n, p) for n in range(layers) for p in "KV"]
    field = RANK_FIELD[report["rank"]]
    assert report["rank"] == ("mean" if "mean" in upgrade else "relative")
    scores = [r[field] for r in report["ranked"]]
    assert scores == sorted(scores, reverse=True) and [r["rank"] for r in report["ranked"]] == [1, 2, 3, 4]
    for r in report["ranked"]:
        assert r["kl_gain_lo"] <= r["kl_gain"] <= r["kl_gain_hi"] and r["kl"] >= 0 and r["window_share_pct"] <= 100
    suggested = CodecSpec.parse(report["suggested"])
    assert (suggested.mode, suggested.variant) == (CodecSpec.parse(base).mode, CodecSpec.parse(base).variant)
    raised = [n for layers in suggested.hi for n in layers]
    assert len(raised) <= 2 and all(0 <= n < layers for n in raised)
    # exactly the best halves with a positive gain, up to the cap
    want = sorted((r["layer"], r["half"]) for r in report["ranked"][:2] if r[field] > 0)
    hi = suggested.hi
    got = sorted([(n, 0) for n in hi.up_keys] + [(n, 1) for n in hi.up_values])
    assert got == want
    if raised:
        assert f"/{flag}=" in report["suggested"] or f"/{flag[0].replace('k', 'v')}{flag[1]}=" in report["suggested"]
    assert report["suggested_ratio_vs_fp16"] >= 1 and report["windows"] == 2 and report["upgrade"] in (
        "int4 + 1 bit", "int2 + 1 bit")
    text = capsys.readouterr().out
    assert "suggested  " + report["suggested"] in text and "bench quality --modes exact," in text


def test_relative_ranking_weighs_every_window_alike_and_mean_follows_the_largest() -> None:
    # window 1's KL is 100x window 2's: (0, K) removes half of window 1's, (0, V) all of window 2's and 1% of 1's
    base = [1.0, 0.01]
    half_kl = {(0, 0): [0.5, 0.01], (0, 1): [0.99, 0.0]}
    mean = _rank(half_kl, base, "mean")
    relative = _rank(half_kl, base, "relative")
    assert [(r["layer"], r["part"]) for r in mean] == [(0, "K"), (0, "V")]
    assert [(r["layer"], r["part"]) for r in relative] == [(0, "V"), (0, "K")]
    shares = {r["part"]: r["window_share_pct"] for r in relative}
    assert shares == pytest.approx({"K": 25.0, "V": 50.5}) and [r["rank"] for r in relative] == [1, 2]
    assert {r["part"]: r["kl_gain"] for r in mean} == pytest.approx({"K": 0.25, "V": 0.01})


def test_bench_layers_keeps_to_the_size_budget(tmp_path: Path) -> None:
    """A budget the base codec alone already misses: nothing is raised."""
    out = tmp_path / "layers.json"
    assert main([*ARGS, "--base", "int2+zstd/rotv/clip/outk/symv/s8", "--min-ratio", "100", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert CodecSpec.parse(report["suggested"]).hi == CodecSpec.parse("int2+zstd/rotv/clip/outk/symv/s8").hi
    assert report["suggested_ratio_vs_fp16"] == report["base_ratio_vs_fp16"]


def test_bench_layers_refuses_a_mode_it_cannot_raise() -> None:
    with pytest.raises(SystemExit, match="int4 or int2"):
        main([*ARGS, "--base", "int8"])
    with pytest.raises(SystemExit, match="takes /s8"):
        main([*ARGS, "--base", "int4"])  # no /s8: no layer can take one bit more


def test_the_quality_chart_bars_follow_its_points() -> None:
    rows = [{"text": "alice", "spec": "int4+zstd:3/g64/rot/clip,sink=int8+zstd:3", "bytes_per_token_ctx": 6500.0,
             "ppl_delta_pct": 0.1, "ppl_delta_lo": -0.2, "ppl_delta_hi": 0.4}]
    assert set(pareto_intervals(rows)) == set(pareto_points(rows)) == {"alice: int4+zstd:3/g64/rot/clip"}
    assert pareto_intervals(rows)["alice: int4+zstd:3/g64/rot/clip"] == (-0.2, 0.4)


def test_bench_layers_ranks_one_kind_of_half_when_asked(tmp_path: Path) -> None:
    """--halves values ranks and raises value halves only (the default over /kbits, whose keys it must not touch)."""
    out = tmp_path / "layers.json"
    assert main([*ARGS, "--base", SPLIT2, "--upgrade", "bit", "--halves", "values", "--min-ratio", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted((r["layer"], r["part"]) for r in report["ranked"]) == [(0, "V"), (1, "V")]
    assert not CodecSpec.parse(report["suggested"]).hi.up_keys
    with pytest.raises(SystemExit, match="kbits"):
        _halves("both", CodecSpec.parse("int2+zstd/kbits/symv/s8"))
    assert _halves(None, CodecSpec.parse("int2+zstd/kbits/symv/s8")) == (1,)
    assert _halves(None, CodecSpec.parse("int2+zstd/rotv/clip/outk/symv/s8")) == (0, 1)
