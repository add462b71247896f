"""`kvstash bench fleet` runs end to end on the smallest settings: tiny-model pods behind nginx, every fleet, budget
pressure and the miss-overhead runs, JSON and charts. The structure of its report is checked, never its timings."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ops.bench.budget.trace import read_trace
from ops.bench.fleet.command import FLEETS, LABELS, find_knee, merged, merged_budget, rate_duration
from ops.bench.fleet.pressure import optimum_hit_rate, record_trace
from ops.bench.fleet.workload import Workload, arrivals, make_users
from ops.cli import main
from ops.pods import nginx_binary

RUN_FIELDS = ("rate", "arrivals", "ok", "failed", "unsent", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50",
              "completion_tokens_per_s", "prompt_tokens_per_s", "hit_rate", "keeps_up")


def test_the_knee_is_the_highest_rate_it_and_every_lower_rate_kept_up_with() -> None:
    def run(rate: float, p90: float, ok: int = 5, failed: int = 0) -> dict[str, object]:
        return {"rate": rate, "ttft_ms_p90": p90, "ok": ok, "arrivals": 5, "failed": failed}

    runs = [run(0.4, 250.0), run(0.1, 100.0), run(0.2, 190.0), run(0.8, 150.0)]
    assert find_knee(runs) == 0.2  # 0.4 doubled the low-rate p90; 0.8 does not count past it
    assert [r["keeps_up"] for r in runs] == [True, True, False, True]
    assert find_knee([run(0.1, 100.0, failed=1), run(0.2, 100.0)]) == 0.0
    assert find_knee([run(0.1, 100.0, ok=4)]) == 0.0  # a turn left unanswered
    assert find_knee([]) == 0.0


def test_the_lowest_rate_runs_until_its_baseline_has_enough_turns() -> None:
    args = argparse.Namespace(duration_s=60.0, base_arrivals=20)
    assert rate_duration(args, 0.1, lowest=True) == 200.0  # 20 turns due at 0.1/s
    assert rate_duration(args, 0.5, lowest=True) == 60.0  # never shorter than --duration-s
    assert rate_duration(args, 0.1, lowest=False) == 60.0


def test_a_run_sends_exactly_its_rate_times_its_duration_in_turns() -> None:
    times = arrivals(2.0, 60.0, seed=7)
    assert len(times) == 120 and times == sorted(times) and 0.0 <= times[0] and times[-1] < 60.0
    assert arrivals(2.0, 60.0, seed=7) == times and arrivals(2.0, 60.0, seed=8) != times
    assert len(arrivals(0.1, 200.0, seed=1)) == 20 and arrivals(0.01, 10.0, seed=1) == []
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) > 3 * min(gaps) + 0.2  # Poisson bursts and lulls, not a metronome


def test_the_users_start_at_every_stage_of_a_conversation() -> None:
    users = make_users(Workload(4, max_turns=8), "t")
    assert [u.turns for u in users] == [0, 2, 4, 6]  # spread over one conversation's turns: they end one by one
    for u in users:  # the opening, then as many earlier exchanges as turns taken, a question and a reply each
        assert len(u.messages) == len(users[0].messages) + 2 * u.turns
        assert [m["role"] for m in u.messages[len(users[0].messages):]] == ["user", "assistant"] * u.turns
    assert len({m["content"] for u in users for m in u.messages if m["content"].startswith("Question")}) == 12
    users[3].restart()
    assert (users[3].turns, users[3].conversation) == (0, 1) and len(users[3].messages) == len(users[0].messages)
    assert [u.turns for u in make_users(Workload(4, max_turns=8, reuse=False), "t")] == [0, 0, 0, 0]


@pytest.mark.slow
@pytest.mark.timeout(900)  # nine fleets started one after another: several minutes on a loaded 2-core machine
@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (CI installs nginx-light in .ci/run)")
def test_bench_fleet_tiny_every_fleet_budget_and_miss_overhead(tmp_path: Path) -> None:
    out, svg = tmp_path / "fleet.json", tmp_path / "fleet.svg"
    assert main(["bench", "fleet", "--engine", "hf", "--model", "tiny-random", "--codec", "exact", "--pods", "2",
                 "--users", "2", "--system-tokens", "40", "--history-tokens", "150", "--query-tokens", "8",
                 "--max-tokens", "4", "--rates", "0.5,1", "--duration-s", "4", "--base-arrivals", "3",
                 "--drain-s", "30", "--budget-mb", "64", "--budget-ratios", "2", "--miss-overhead",
                 "--trace-out", str(tmp_path / "trace.jsonl"), "--json", str(out), "--plot", str(svg)]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [(r["kind"], r["rate"]) for r in runs] == [(k, rate) for k in FLEETS for rate in (0.5, 1.0)]
    for r in runs:
        assert all(field in r for field in RUN_FIELDS), r
        assert r["fleet"] == LABELS[r["kind"]] and r["failed"] == 0 and r["ok"] == r["arrivals"] > 0, r
        assert 0 <= r["hit_rate"] <= 1
    assert max(r["hit_rate"] for r in runs if r["kind"] == "kvstash") > 0
    assert all(r["hit_rate"] == 0 for r in runs if r["kind"] == "off")
    assert set(report["knees"]) == set(FLEETS)
    cal = report["calibration"]
    assert cal["bound"] == pytest.approx((cal["prefill_ms"] + cal["decode_ms"]) / (cal["hit_ms"] + cal["decode_ms"]))
    assert {"no_failed_requests", "knee_vs_bound"} <= set(report["targets"])
    assert report["targets"]["no_failed_requests"] == {"value": 0, "met": True}
    ample, *pressed = report["budget_pressure"]
    assert ample["fleet"] == "no pressure" and ample["bytes_held"] > 0
    assert [r["policy"] for r in pressed] == ["chain", "lru"] and pressed[0]["budget_mb"] >= 8
    for r in report["budget_pressure"]:
        assert r["ratio"] > 0 and r["failed"] == 0 and 0 <= r["optimum_hit_rate"] <= 1
    assert read_trace(tmp_path / "trace.jsonl").requests  # `bench budget --trace` replays it
    on, off = report["miss_overhead"]
    assert (on["kind"], off["kind"]) == ("kvstash", "off") and on["hit_rate"] == off["hit_rate"] == 0
    assert on["runs"] == off["runs"] == 2  # interleaved: on, off, off, on
    # the same requests each side, at the same moments of their runs: throughputs compare
    arrived = {side: sorted(round(r["arrived_s"], 3) for r in report["requests"] if r["fleet"] == side)
               for side in ("miss-kvstash", "miss-off")}
    assert arrived["miss-kvstash"] == arrived["miss-off"] and on["arrivals"] == off["arrivals"] > 0
    assert "ttft_ms_p50_vs_off" in on and "completion_tokens_per_s_vs_off" in on
    rows = report["requests"]
    assert {r["fleet"] for r in rows} == {*FLEETS, "budget", "miss-kvstash", "miss-off"}
    assert all(r["status"] == 200 for r in rows)
    assert len({r["pod"] for r in rows if r["fleet"] == "kvstash"}) == 2  # round robin over both pods
    assert report["threads_per_pod"] >= 1 and report["engine"] == "hf"
    assert report["args"]["parallel"] == 8  # none named: the engine's own, as the pods were started with
    for chart in (svg, svg.with_name("fleet-budget-hits.svg"), svg.with_name("fleet-budget-ttft.svg")):
        assert ET.parse(chart).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_merge_keeps_other_engines_runs_and_replaces_its_own(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    hf = {"engine": "hf", "runs": [1], "machine_before": {"nproc": 2}}
    path.write_text(json.dumps(hf))
    first = merged(path, {"engine": "llamacpp", "runs": [2], "machine_before": {"nproc": 3}})
    assert [r["engine"] for r in first["engines"]] == ["hf", "llamacpp"]
    assert first["machine_before"] == {"nproc": 2}  # the first report's, ordered by engine
    path.write_text(json.dumps(first))
    again = merged(path, {"engine": "hf", "runs": [3], "machine_before": {"nproc": 4}})
    assert [(r["engine"], r["runs"]) for r in again["engines"]] == [("hf", [3]), ("llamacpp", [2])]
    assert merged(tmp_path / "none.json", hf) == {"engines": [hf], "machine_before": hf["machine_before"]}


def test_the_fleets_trace_replays_as_bench_budget_reads_it(tmp_path: Path) -> None:
    def turn(session: str, prompt: int, cached: int, sent: float) -> dict[str, object]:
        return {"status": 200, "session": session, "prompt_tokens": prompt, "cached_tokens": cached, "sent_s": sent,
                "completion_tokens": 30}

    # two users share a 128-token system prompt (the second's first turn found its 2 blocks cached); one failed turn
    warm = [turn("b-1.0", 300, 128, 0.2), turn("b-0.0", 290, 0, 0.1)]
    rows = [turn("b-0.0", 400, 256, 1.0), {"status": 0, "session": "b-1.0", "sent_s": 1.5},
            turn("b-1.0", 420, 256, 2.0)]
    recorded = record_trace(warm, rows, shared=True)
    assert recorded.lines == [{"session": "b-0.0", "tokens": 290, "prefix": "system", "prefix_tokens": 128},
                              {"session": "b-1.0", "tokens": 300, "prefix": "system", "prefix_tokens": 128},
                              {"session": "b-0.0", "tokens": 400}, {"session": "b-1.0", "tokens": 420}]
    assert recorded.measured == [False, False, True, True] and recorded.prompts == [290, 300, 400, 420]
    assert recorded.before == [0, 0, 320, 330]  # what each session's previous turn computed, its reply too
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in recorded.lines))
    assert len(read_trace(path).requests) == 4
    # room for all: each measured turn reuses all its previous turn computed (4 full blocks and the tail after them)
    assert optimum_hit_rate(recorded, 0.5, 0.95) == pytest.approx((320 + 330) / 820)
    assert optimum_hit_rate(recorded, 4.0, 0.95) < optimum_hit_rate(recorded, 0.5, 0.95)  # 2 of 10 blocks held


def test_budget_only_replaces_the_budget_rows_and_keeps_the_sweep(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    sweep = {"engine": "llamacpp", "runs": [1], "budget_pressure": [{"old": 1}], "machine_before": {"nproc": 2},
             "requests": [{"fleet": "kvstash"}, {"fleet": "budget"}]}
    path.write_text(json.dumps({"engines": [sweep], "machine_before": sweep["machine_before"]}))
    new = {"engine": "llamacpp", "budget_pressure": [{"new": 1}], "machine_before": {"nproc": 3},
           "machine_after": {}, "args": {"users": 16}, "requests": [{"fleet": "budget", "policy": "lru"}]}
    out = merged_budget(path, new)["engines"][0]
    assert out["runs"] == [1] and out["budget_pressure"] == [{"new": 1}] and out["budget_run"]["args"]["users"] == 16
    assert out["requests"] == [{"fleet": "kvstash"}, {"fleet": "budget", "policy": "lru"}]
    with pytest.raises(SystemExit):
        merged_budget(tmp_path / "none.json", new)
