"""The generated docs (configuration, keys, results page, README's hit table) are committed fresh."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import fields
from pathlib import Path

import pytest

from cachestore import keys
from cachestore.hashing import HASH_BYTES, BlockHash
from cachestore.keys import KeySpace
from cachestore.settings import StoreSettings
from ops import gendocs, resultspage
from ops.cli import build_parser, main
from service.settings import _ENV_CASTS, SETTING_HELP, PodSettings, describe


def test_configuration_page_is_fresh() -> None:
    assert gendocs.PAGE.read_text() == gendocs.render(), "run python -m ops.gendocs"


def test_configuration_page_lists_every_setting() -> None:
    page = gendocs.PAGE.read_text()
    for name in _ENV_CASTS:
        assert f"`KVSTASH_{name.upper()}`" in page
    for f in fields(PodSettings):
        assert f"| `{f.name}` |" in page
    for f in fields(StoreSettings):
        if f.name != "url":
            assert f"| `{f.name}` |" in page
    for flag in ("--redis-url", "--codec", "--upstream", "--flash-attn", "--json"):
        assert f"`{flag}" in page


def test_every_generated_file_is_fresh() -> None:
    assert gendocs.stale() == [], "run python -m ops.gendocs"


def test_results_page_shows_every_result_with_its_machine_and_date() -> None:
    page = resultspage.PAGE.read_text()
    for path in sorted(resultspage.RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        assert f"{{#{path.stem}}}" in page and f"results/{path.stem}.svg" in page
        assert resultspage.machine_line(data) in page
        machine = data.get("machine") or data["machine_before"]
        assert machine["date"] in page


def test_a_changed_result_makes_the_page_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(resultspage.RESULTS, tmp_path, dirs_exist_ok=True)
    data = json.loads((tmp_path / "resume-llamacpp.json").read_text())
    hit = next(r for r in data["rows"] if r["method"] == "kvstash-int8")
    hit["ttft_ms_p50"] *= 2
    (tmp_path / "resume-llamacpp.json").write_text(json.dumps(data))
    monkeypatch.setattr(resultspage, "RESULTS", tmp_path)
    pages = resultspage.render()
    assert pages[resultspage.PAGE] != resultspage.PAGE.read_text()
    committed_chart = (gendocs.ROOT / "docs" / "results" / "resume-llamacpp.svg").read_text()
    assert pages[tmp_path / "resume-llamacpp.svg"] != committed_chart
    assert f"{hit['ttft_ms_p50']:,.1f}" in pages[resultspage.PAGE]
    readme = resultspage.render_readme(resultspage.README.read_text())
    assert readme != resultspage.README.read_text()


def test_a_result_no_section_renders_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mystery.json").write_text("{}")
    monkeypatch.setattr(resultspage, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="mystery"):
        resultspage.render()


def test_fleet_results_render(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine's fleets (merged by `bench fleet --merge`): knees, bound, targets, a row per rate, and with budget
    pressure its table and two more charts, with miss overhead its row."""
    def report(engine: str, budget: bool) -> dict[str, object]:
        runs = [{"kind": kind, "fleet": kind, "rate": rate, "ok": 10, "failed": 0, "ttft_ms_p50": 100.0 * rate,
                 "ttft_ms_p90": 150.0 * rate, "ttft_ms_p99": 160.0 * rate, "itl_ms_p50": 12.5,
                 "completion_tokens_per_s": 20.0, "hit_rate": 0.5, "keeps_up": True}
                for kind in ("kvstash", "off") for rate in (0.5, 1.0)]
        pressed = [{"fleet": f"working set {x:g}x budget", "budget_mb": 8, "ratio": x, "hit_rate": 0.9 / x,
                    "policy": "chain", "optimum_hit_rate": 0.5, "ttft_ms_p50": 100.0 * x, "ttft_ms_p90": 200.0 * x,
                    "failed": 0} for x in (0.5, 2.0)]
        miss = [{"fleet": f"no reuse, {k}", "kind": k, "runs": 2, "ok": 4, "failed": 0, "ttft_ms_p50": 1000.0,
                 "ttft_ms_p90": 1100.0, "completion_tokens_per_s": 0.4, "hit_rate": 0.0, "ttft_ms_p50_vs_off": 0.99,
                 "ttft_ms_p90_vs_off": 1.01, "completion_tokens_per_s_vs_off": 1.0} for k in ("kvstash", "off")]
        return {"engine": engine, "runs": runs, "knees": {"kvstash": 1.0, "off": 0.5}, "threads_per_pod": 1,
                "calibration": {"prefill_ms": 900.0, "hit_ms": 50.0, "decode_ms": 100.0, "prompt_tokens": 600,
                                "bound": 1000.0 / 150.0},
                "targets": {"no_failed_requests": {"value": 0, "met": True}},
                "budget_pressure": pressed if budget else [], "miss_overhead": miss if budget else [],
                "args": {"pods": 2, "parallel": 4, "users": 4}, "machine_before": machine}

    machine = {"nproc": 2, "cpu": "test CPU", "ram_gb": 1.0, "loadavg": [3.5, 0.1, 0.1], "date": "2026-12-02"}
    (tmp_path / "fleet.json").write_text(json.dumps({"engines": [report("hf", False), report("llamacpp", True)],
                                                     "machine_before": machine}))
    monkeypatch.setattr(resultspage, "RESULTS", tmp_path)
    out = resultspage.render()
    page = out[resultspage.PAGE]
    assert "| kvstash | 1 | 10 / 0 | 100.0 | 150.0 | 160.0 | 12.5 | 20.0 | 0.50 | yes |" in page and "test CPU" in page
    assert page.count("Knee: kvstash 1/s, no cache 0.5/s.") == 2 and "= 6.67x" in page
    assert "**hf** (load average 3.5 at the start)" in page
    assert "| working set 2x budget | chain | 8 | 2.00 | 0.45 | 0.50 | 200.0 | 400.0 | 0 |" in page
    assert "Miss overhead (llamacpp" in page and "| no reuse, off | 2 | 4 / 0 | 1,000 | 1,100 | 0.40 | 0.00 |" in page
    assert {tmp_path / "fleet-budget-hits.svg", tmp_path / "fleet-budget-ttft.svg"} <= set(out)


def _shape_regex(pattern: str) -> re.Pattern[str]:
    parts = {"<ns>": "ns", "<model16>": "[0-9a-f]{16}", "<hash32hex>": f"[0-9a-f]{{{2 * HASH_BYTES}}}",
             "sNN": r"s\d\d", "<tenant>": "[^:]+", "<session_id>": "[^:]+"}
    regex = re.escape(pattern)
    for name, part in parts.items():
        regex = regex.replace(re.escape(name), part)
    return re.compile(regex + "$")


def test_key_table_names_exactly_the_keys_keyspace_builds() -> None:
    space = KeySpace("ns", 16)
    digest = BlockHash(bytes(range(HASH_BYTES)))
    shard = space.shard(0)
    built = [space.block("0123456789abcdef", digest)[1], space.tail("0123456789abcdef", digest)[1],
             space.reply_ids("0123456789abcdef", digest)[1], space.boundary("0123456789abcdef", digest)[1],
             shard.lru, shard.size, shard.bytes, shard.chain, shard.hits, shard.kids,
             shard.owner, shard.tenant_bytes, shard.tenant_lru("acme"), space.session("acme", "trip-42"),
             space.codec_plan("0123456789abcdef")]
    shapes = [_shape_regex(k.pattern) for k in keys.KEY_SHAPES]
    for key in built:
        assert sum(1 for s in shapes if s.match(key)) == 1, key
    for shape in shapes:
        assert any(shape.match(key) for key in built), shape.pattern
    page = gendocs.KEYS_PAGE.read_text()
    assert all(f"`{k.pattern}`" in page for k in keys.KEY_SHAPES)


def test_every_setting_has_one_description_and_the_cli_shows_it() -> None:
    names = {f.name for f in fields(PodSettings)}
    assert set(SETTING_HELP) == names, "describe each PodSettings field once, in service/settings.py's SETTING_HELP"
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]  # noqa: SLF001
    shown = 0
    for action in serve._actions:  # noqa: SLF001
        if action.dest in names:
            assert action.help % {} == describe(action.dest)
            shown += 1
    assert shown >= 19  # every serve flag that sets a PodSettings field
    help_text = serve.format_help()
    assert "prefix of every Redis key (default kvstash)" in " ".join(help_text.split())


def test_reliability_figures_render_as_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "reliability.jsonl"
    path.write_text(json.dumps({"test": "tests/test_x.py::test_y", "requests": 1200, "recover_s": 0.98,
                                "statuses": ["miss", "hit"], "date": "2026-12-02", "nproc": 2}) + "\n")
    monkeypatch.setattr(resultspage, "FIGURES", path)
    table = "\n".join(resultspage.figures_table())
    assert "1 scenarios of `tests/test_x.py`" in table and "2026-12-02 (2 cores)" in table
    assert "| `test_x.py::test_y` | requests 1,200, recover_s 0.98, statuses [miss, hit] |" in table


def test_what_the_benches_write_is_what_the_page_renders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # small real runs on the tiny model, written where a published run goes (docs/results/NAME.json)
    assert main(["bench", "resume", "--model", "tiny-random", "--contexts", "64", "--modes", "int8", "--no-naive",
                 "--repeat", "1", "--recompute-repeat", "1", "--json", str(tmp_path / "resume-hf.json")]) == 0
    assert main(["bench", "quality", "--text", "ops/data/sample.txt", "--model", "tiny-random", "--modes",
                 "exact,int8", "--prefix", "32", "--continuation", "16", "--windows", "2", "--greedy", "3",
                 "--block-tokens", "8", "--size-tokens", "64", "--json", str(tmp_path / "quality.json")]) == 0
    monkeypatch.setattr(resultspage, "RESULTS", tmp_path)
    files = resultspage.render()
    page = files[resultspage.PAGE]
    assert "{#resume-hf}" in page and "| 64 | hit, `int8` |" in page
    assert "{#quality}" in page and "| sample.txt | `int8" in page
    for name in ("resume-hf", "quality"):
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert resultspage.machine_line(data) in page and files[tmp_path / f"{name}.svg"].startswith("<svg")
