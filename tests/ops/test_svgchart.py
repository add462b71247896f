"""ops/svgchart.py, the one way kvstash draws a chart: each kind parses as SVG and draws what it was given, and a
bench's `--plot` refuses a path not named .svg before it starts."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ops import svgchart
from ops.bench.fleet import churnrun, report
from ops.cli import main

SVG = "{http://www.w3.org/2000/svg}"


def _parse(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == f"{SVG}svg"
    return root


def _titles(root: ET.Element, tag: str) -> list[str]:
    return [el.findtext(f"{SVG}title") or "" for el in root.iter(f"{SVG}{tag}")]


def test_bars_draw_a_bar_per_group_and_series_and_leave_gaps() -> None:
    root = _parse(svgchart.bars(["a", "b"], {"x": [1.0, 2.0], "y": [3.0, None]}, title="t", ylabel="ms"))
    assert [t for t in _titles(root, "rect") if t] == ["a, x: 1", "a, y: 3", "b, x: 2"]


def test_lines_draw_a_line_per_series_and_a_point_per_value() -> None:
    root = _parse(svgchart.lines(["64", "128", "256"], {"hit": [10.0, 20.0, 40.0], "miss": [None, 5.0, 7.0]},
                                 title="t", xlabel="tokens", ylabel="ms", log=True))
    assert len(root.findall(f"{SVG}polyline")) == 2
    assert _titles(root, "circle") == ["hit: 10", "hit: 20", "hit: 40", "miss: 5", "miss: 7"]


def test_scatter_numbers_each_point_joins_the_frontier_and_draws_intervals() -> None:
    points = {"int8": (600.0, 0.05), "int4": (330.0, 0.8), "int2": (180.0, 6.0), "bad": (400.0, -2.0)}
    root = _parse(svgchart.scatter(points, title="t", xlabel="bytes", ylabel="%", logx=True, symlog=0.1,
                                   joined=["int2", "int4", "int8"], intervals={"int4": (0.5, 1.1)}, fmt="+.2f"))
    circles = list(root.iter(f"{SVG}circle"))
    assert [c.findtext(f"{SVG}title") for c in circles] == ["int2: 180, +6.00", "int4: 330, +0.80",
                                                             "bad: 400, -2.00", "int8: 600, +0.05"]
    xs = [float(c.get("cx", "")) for c in circles]
    ys = {c.findtext(f"{SVG}title"): float(c.get("cy", "")) for c in circles}
    assert xs == sorted(xs)  # smallest first, numbered in that order
    assert ys["int8: 600, +0.05"] > ys["int4: 330, +0.80"] > ys["int2: 180, +6.00"]  # a larger loss sits higher
    assert ys["bad: 400, -2.00"] > ys["int8: 600, +0.05"]  # below zero: the symmetric log keeps the sign
    frontier = root.findall(f"{SVG}polyline")
    assert len(frontier) == 1 and len(frontier[0].get("points", "").split()) == 3
    colors = {c.findtext(f"{SVG}title"): c.get("fill") for c in circles}
    assert colors["bad: 400, -2.00"] != colors["int4: 330, +0.80"] == colors["int8: 600, +0.05"]
    legend = [t.text for t in root.iter(f"{SVG}text") if t.text and t.text[0].isdigit() and ": " in t.text]
    assert legend == ["1: int2 (+6.00)", "2: int4 (+0.80 [+0.50, +1.10])", "3: bad (-2.00)", "4: int8 (+0.05)"]


def test_scatter_grows_taller_to_name_every_point() -> None:
    points = {f"codec {i}": (float(2 ** (i % 8 + 4)), float(i)) for i in range(40)}
    root = _parse(svgchart.scatter(points, title="t", xlabel="x", ylabel="y"))
    assert int(root.get("height", "0")) > svgchart.HEIGHT and len(root.findall(f"{SVG}circle")) == 40


@pytest.mark.parametrize("bench", ["resume", "quality", "fleet"])
def test_plot_refuses_a_path_not_named_svg_before_the_bench_starts(bench: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", bench, "--plot", "out.png"]) == 2
    assert capsys.readouterr().err == "kvstash: error: --plot writes an SVG chart: name a .svg file, not 'out.png'\n"


def test_fleet_charts_a_bar_per_phase_and_fleet_and_two_budget_charts(tmp_path: Path) -> None:
    runs = [{"fleet": fleet, "phases": [{"phase": p, "ttft_ms_p90": v} for p, v in zip(("before", "during"), vs,
                                                                                          strict=True)]}
            for fleet, vs in (("kvstash", (100.0, 300.0)), ("sticky", (120.0, 900.0)))]
    churnrun.plot(tmp_path / "churn.svg", runs, "t")
    bars = _titles(ET.parse(tmp_path / "churn.svg").getroot(), "rect")
    assert [t for t in bars if t] == ["before, kvstash: 100", "before, sticky: 120", "during, kvstash: 300",
                                      "during, sticky: 900"]
    report.plot_budget(tmp_path / "fleet.svg", [
        {"fleet": "working set 2x budget", "policy": "lru", "ratio": 2.0, "hit_rate": 0.3, "optimum_hit_rate": 0.6,
         "ttft_ms_p50": 90.0},
        {"fleet": "working set 2x budget", "policy": "chain", "ratio": 2.0, "hit_rate": 0.5, "optimum_hit_rate": 0.6,
         "ttft_ms_p50": 80.0},
        {"fleet": "no pressure", "policy": "chain", "ratio": 0.5, "hit_rate": 0.9, "optimum_hit_rate": 0.9,
         "ttft_ms_p50": 40.0}])
    hits = ET.parse(tmp_path / "fleet-budget-hits.svg").getroot()
    ttft = ET.parse(tmp_path / "fleet-budget-ttft.svg").getroot()
    # a line a policy, each from the no-pressure run on, by ratio, in percent; the optimum of each ratio's trace
    assert _titles(hits, "circle") == ["hit rate, lru: 90", "hit rate, lru: 30", "hit rate, chain: 90",
                                       "hit rate, chain: 50", "optimum (Belady): 90", "optimum (Belady): 60"]
    assert _titles(ttft, "circle") == ["TTFT p50, lru: 40", "TTFT p50, lru: 90", "TTFT p50, chain: 40",
                                       "TTFT p50, chain: 80"]
