"""`kvstash bench fleet --churn` and `--skew`: bad schedules refused before anything starts, the phases a run's
turns fall into, the users' uneven activity, the results page's section, and one short run that kills a pod."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops import churntables
from ops.bench.fleet import phases, targets
from ops.bench.fleet.churn import plan
from ops.bench.fleet.command import merged
from ops.bench.fleet.workload import Workload, deal, make_users, session_id
from ops.cli import main
from ops.pods import nginx_binary
from tests.paths import ROOT

TINY = ["bench", "fleet", "--engine", "hf", "--model", "tiny-random", "--codec", "exact", "--pods", "2", "--users",
        "2", "--system-tokens", "40", "--history-tokens", "150", "--query-tokens", "8", "--max-tokens", "4",
        "--budget-mb", "64"]


def _refused(extra: list[str]) -> str:
    """The one line `bench fleet` exits 2 with, before it starts anything (no Redis, no pod: it would take seconds)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*TINY, *extra]) == 2
    (line,) = err.getvalue().strip().splitlines()
    return line


def test_an_unknown_event_is_refused_in_one_line() -> None:
    assert "--churn takes rolling, scale-out, kill (comma-separated), not explode" in _refused(["--churn", "explode"])
    assert "not restart" in _refused(["--churn", "kill,restart"])


def test_a_schedule_longer_than_the_run_is_refused() -> None:
    assert "--churn kill at 70 s is not within the run: arrivals last --duration-s 60 s" in _refused(
        ["--churn", "kill", "--churn-at", "70", "--duration-s", "60"])
    # three pods restarted 10 s apart from 45 s: the last one would go at 65 s at the earliest
    refused = _refused(["--churn", "rolling", "--pods", "3", "--churn-at", "45", "--churn-gap", "10",
                        "--duration-s", "60"])
    assert "(its last pod 20 s later at the least) is not within the run" in refused, refused
    assert "2 moment(s) for 1 event(s)" in _refused(["--churn", "kill", "--churn-at", "10,20"])
    assert "in the order of the events" in _refused(["--churn", "kill,rolling", "--churn-at", "30,10"])
    assert "--churn runs one rate" in _refused(["--churn", "kill", "--rates", "0.1,0.2"])
    assert "--churn-at schedules the events of --churn" in _refused(["--churn-at", "10"])


def test_a_scale_out_beyond_the_cores_is_refused() -> None:
    cores = os.cpu_count() or 1
    refused = _refused(["--churn", "scale-out", "--pods", str(cores)])
    assert f"grows the fleet to {cores + 1} pods: {cores} cores cannot give each 1 thread(s)" in refused, refused
    assert "cannot give each 2 thread(s)" in _refused(["--churn", "scale-out", "--pods", "1", "--threads-per-pod",
                                                       str(cores)])


def test_the_command_line_says_one_line_and_exits_non_zero() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "ops.cli", *TINY, "--churn", "explode"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "kvstash: error: --churn takes rolling, scale-out, kill (comma-separated), not explode"]
    moved = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "load", "--restart-pod-at", "30%"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
    assert moved.returncode == 2 and len(moved.stderr.strip().splitlines()) == 1
    assert "moved into kvstash bench fleet" in moved.stderr and "--churn kill" in moved.stderr


def test_events_default_to_moments_spread_over_the_run() -> None:
    assert [(e.kind, e.at_s) for e in plan("kill", "", 90.0, 2, 10.0)] == [("kill", 30.0)]
    assert [e.at_s for e in plan("rolling,scale-out", "", 100.0, 2, 10.0)] == [25.0, 50.0]
    assert [e.at_s for e in plan("kill,kill", "10, 20", 30.0, 2, 0.0)] == [10.0, 20.0]


def test_phases_are_the_windows_before_during_and_after_each_event() -> None:
    events = [{"event": "rolling", "done": True, "began_s": 10.0, "ended_s": 25.0},
              {"event": "kill", "done": False, "began_s": 40.0, "error": "ProcessError: pod exited"},
              {"event": "scale-out", "done": False}]  # never began: the run ended first
    assert phases.windows(events, 60.0) == [("before", 0.0, 10.0), ("during rolling", 10.0, 25.0),
                                            ("after rolling", 25.0, 40.0), ("during kill", 40.0, 60.0)]
    assert phases.windows([], 60.0) == [("before", 0.0, 60.0)]


def test_a_pod_is_busy_while_it_holds_a_request_counted_once() -> None:
    # two requests decoded together (2-5 and 3-6), one later (8-9), the window 4-10: 4-6 and 8-9
    assert phases.busy_s([(2.0, 5.0), (8.0, 9.0), (3.0, 6.0)], 4.0, 10.0) == pytest.approx(3.0)
    assert phases.busy_s([], 0.0, 10.0) == 0.0


def test_a_runs_turns_fall_into_the_phase_they_arrived_in() -> None:
    def row(arrived: float, pod: str, status: int = 200, cached: int = 90) -> dict[str, object]:
        return {"arrived_s": arrived, "sent_s": arrived, "ended_s": arrived + 1.0, "status": status, "pod": "?",
                "upstream": pod, "ttft_ms": 100.0 * (1 + arrived // 10), "prompt_tokens": 100,
                "cached_tokens": cached}

    names = {"127.0.0.1:1": "pod-a", "127.0.0.1:2": "pod-b"}
    rows = [row(1, "127.0.0.1:1"), row(2, "127.0.0.1:2"), row(12, "127.0.0.1:2", cached=0),
            {"arrived_s": 13.0, "status": 0, "error": "RemoteProtocolError"}, row(21, "127.0.0.1:1")]
    events = [{"event": "kill", "done": True, "began_s": 10.0, "ended_s": 20.0}]
    before, during, after = phases.split(rows, events, 30.0, names)
    assert [p["phase"] for p in (before, during, after)] == ["before", "during kill", "after kill"]
    assert (before["arrivals"], during["arrivals"], during["failed"], during["ok"]) == (2, 2, 1, 1)
    assert before["requests_per_pod"] == {"pod-a": 1, "pod-b": 1} and during["requests_per_pod"]["pod-a"] == 0
    assert before["busy_s_per_pod"] == {"pod-a": 1.0, "pod-b": 1.0} and before["busy_max_over_mean"] == 1.0
    assert during["hit_rate"] == 0.0 and after["hit_rate"] == 0.9 and during["ttft_ms_p90_vs_before"] == 2.0
    assert during["errors"] == ["RemoteProtocolError"] and rows[3]["pod"] == ""


def test_an_added_pods_hit_rate_is_told_from_its_first_turn() -> None:
    def row(sent: float, pod: str, cached: int) -> dict[str, object]:
        return {"sent_s": sent, "status": 200, "pod": pod, "prompt_tokens": 100, "cached_tokens": cached}

    rows = [row(1, "pod-a", 90), row(12, "pod-b", 80), row(13, "pod-a", 100), row(14, "pod-b", 100),
            {"sent_s": 15.0, "status": 0, "pod": ""}]
    events = [{"event": "scale-out", "steps": [{"pod": "pod-b", "ready_s": 10.0}]},
              {"event": "kill", "steps": [{"pod": "pod-a", "signal": "SIGKILL"}]}]
    assert phases.added_pods(rows, events) == {"pod-b": {"turns": 2, "hit_rate": 0.9, "first_turn_hit_rate": 0.8,
                                                         "fleet_hit_rate_since": pytest.approx(280 / 300)}}
    assert phases.added_pods(rows[:1], events) == {}  # no turn reached it


def _phase(name: str, p90: float, hit: float) -> dict[str, object]:
    return {"phase": name, "ok": 5, "ttft_ms_p90": p90, "hit_rate": hit}


def test_rolling_targets_compare_the_rollout_with_the_steady_phase() -> None:
    run = {"failed": 0, "phases": [_phase("before", 400.0, 0.95), _phase("during rolling", 560.0, 0.90),
                                   _phase("after rolling", 900.0, 0.5)]}
    failed, p90, hit = targets.evaluate(run, [], ["rolling"], skewed=False)
    assert (failed["met"], p90["met"], hit["met"]) == (True, True, True)
    assert p90["value"] == "1.40 (560 / 400 ms)" and hit["ratio"] == pytest.approx(0.90 / 0.95)
    run["phases"][1] = _phase("during rolling", 640.0, 0.80)  # 1.6x slower, 0.84x the hits
    assert [t["met"] for t in targets.rolling({**run, "failed": 1})] == [False, False, False]


def test_a_lost_stream_counts_against_the_pod_that_held_it() -> None:
    def row(user: int, pod: str, sent: float, ended: float, status: int = 200, cached: int = 50) -> dict[str, object]:
        return {"user": user, "pod": "", "upstream": pod, "sent_s": sent, "ended_s": ended, "arrived_s": sent,
                "status": status, "prompt_tokens": 100, "cached_tokens": cached, "ttft_ms": 10.0}

    names = {"127.0.0.1:1": "pod-a", "127.0.0.1:2": "pod-b"}
    rows = [row(0, "127.0.0.1:1", 9, 11, status=0), row(1, "127.0.0.1:1", 9.5, 10.5),  # pod-a held 2 at 10 s
            row(2, "127.0.0.1:2", 9, 11), row(0, "127.0.0.1:2", 12, 13), row(1, "127.0.0.1:1", 14, 15)]
    step = {"pod": "pod-a", "signal": "SIGKILL", "stopped_s": 10.0}
    run = {"events": [{"event": "kill", "done": True, "began_s": 10.0, "ended_s": 12.0, "steps": [step]}]}
    run["whole_run"] = phases.whole(rows, names)
    assert run["whole_run"]["failed_per_pod"] == {"pod-a": 1, "pod-b": 0}
    bound, later = targets.kill(run, rows)
    assert (bound["in_flight"], bound["failed_on_killed"], bound["met"]) == (2, 1, True)
    assert later["met"] and later["value"] == "0 of 2 not answered, 0 of 1 missed"
    rows[3]["cached_tokens"] = 0  # the lost conversation's next turn found nothing: its KV was lost with the pod
    assert not targets.kill(run, rows)[1]["met"]
    late = {"user": 2, "arrived_s": 16.0, "status": -1, "error": "not sent: run ended"}  # the fleet fell behind
    assert targets.kill(run, [*rows, late])[1]["value"] == "1 of 3 not answered (1 never sent), 1 of 1 missed"
    rows[0].update(pod="", upstream="")  # a connection lost before any header names no pod
    assert phases.whole(rows, names)["failed_per_pod"] == {"pod-a": 0, "pod-b": 0, "unknown": 1}


def test_skew_and_scale_out_targets() -> None:
    even = {"whole_run": {"busy_s_per_pod": {"pod-a": 10.0, "pod-b": 12.0}}}
    assert targets.skew(even)[0]["met"] and not targets.skew(
        {"whole_run": {"busy_s_per_pod": {"pod-a": 4.0, "pod-b": 16.0}}})[0]["met"]  # 1.6x the mean
    added = {"pod-c": {"turns": 4, "hit_rate": 0.8, "first_turn_hit_rate": 0.7, "fleet_hit_rate_since": 0.95}}
    (row,) = targets.scale_out({"added_pods": added})
    assert not row["met"] and row["ratio"] == pytest.approx(0.8 / 0.95)
    assert not targets.scale_out({"added_pods": {}})[0]["met"]  # no turn reached the added pod


def test_skewed_users_send_turns_by_zipf_weights() -> None:
    assert deal(6, 3, 0.0, seed=1) == [0, 1, 2, 0, 1, 2]
    senders = deal(3000, 4, 1.0, seed=1)
    assert senders == deal(3000, 4, 1.0, seed=1) and senders != deal(3000, 4, 1.0, seed=2)
    counts = [senders.count(u) for u in range(4)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 3 * counts[3]  # weights 1, 1/2, 1/3, 1/4


def test_a_sticky_users_session_id_is_random_looking_and_its_own() -> None:
    users = make_users(Workload(16), "sticky")
    ids = [session_id(u) for u in users]
    assert len(set(ids)) == 16 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    assert ids == [session_id(u) for u in make_users(Workload(16), "sticky")]  # the same users, the same pods
    users[0].restart()
    assert session_id(users[0]) != ids[0]  # a new conversation may land elsewhere


def test_merge_keeps_each_engines_runs_of_each_event(tmp_path: Path) -> None:
    path = tmp_path / "churn.json"
    rolling = {"engine": "llamacpp", "churn": "rolling", "runs": [1], "machine_before": {}}
    path.write_text(json.dumps(merged(path, rolling)))
    both = merged(path, {**rolling, "churn": "kill", "runs": [2]})
    assert [(r["churn"], r["runs"]) for r in both["engines"]] == [("kill", [2]), ("rolling", [1])]
    path.write_text(json.dumps(both))
    assert [r["runs"] for r in merged(path, {**rolling, "runs": [3]})["engines"]] == [[2], [3]]


def _report(churn: str) -> dict[str, object]:
    phase = {"phase": "before", "start_s": 0.0, "end_s": 30.0, "arrivals": 6, "ok": 6, "failed": 0,
             "ttft_ms_p50": 120.0, "ttft_ms_p90": 300.0, "ttft_ms_p90_vs_before": 1.0, "hit_rate": 0.93,
             "requests_per_pod": {"pod-a": 3, "pod-b": 3}, "busy_s_per_pod": {"pod-a": 4.0, "pod-b": 5.0}}
    during = {**phase, "phase": f"during {churn}", "ok": 5, "failed": 1, "ttft_ms_p90": 900.0,
              "ttft_ms_p90_vs_before": 3.0}
    step = {"pod": "pod-a", "signal": "SIGKILL", "stopped_s": 30.0, "exit_s": 0.0, "killed": True, "ready_s": 33.0}
    target = {"target": "kill: failed <= in flight on pod-a", "need": "<= 1", "value": "1 (1 on pod-a)", "met": True}
    run = {"fleet": "kvstash", "kind": "kvstash", "rate": 0.2, "phases": [phase, during],
           "events": [{"event": churn, "done": True, "steps": [step]}], "targets": [target]}
    return {"engine": "llamacpp", "churn": churn, "runs": [run, {**run, "fleet": "sticky sessions"}],
            "args": {"pods": 2, "users": 4, "duration_s": 90}, "machine_before": {"nproc": 2}}


def test_the_results_page_tables_and_charts_each_runs_phases() -> None:
    d = {"engines": [_report("kill"), _report("rolling")]}
    table, chart = churntables.churn(d)
    row = ("| kvstash | during kill | 0-30 | 6 | 5 | 1 | 120.0 | 900.0 | 3.00 | 0.93 | pod-a 3, pod-b 3 | "
           "pod-a 4, pod-b 5 |")
    assert row in table
    assert any(line.startswith("**llamacpp, rolling**") for line in table)
    assert "| kvstash | kill: failed <= in flight on pod-a | <= 1 | 1 (1 on pod-a) | pass |" in table
    assert "- sticky sessions: kill: pod-a SIGKILL at 30.0 s (killed, gone after 0.0 s), ready at 33.0 s." in table
    assert chart.startswith("<svg") and "during kill" in chart and "sticky sessions" in chart
    (name, title, extra), = churntables.churn_charts(d)
    assert name == "llamacpp-rolling" and "rolling" in title and "during rolling" in extra


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (CI installs nginx-light in .ci/run)")
def test_churn_kill_two_tiny_pods(tmp_path: Path) -> None:
    """The busiest of two pods SIGKILLed mid-run and started again: only turns it held fail, later turns hit."""
    out = tmp_path / "churn.json"
    assert main([*TINY, "--fleets", "kvstash", "--rates", "1", "--duration-s", "16", "--drain-s", "30", "--churn",
                 "kill", "--churn-at", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    (event,) = run["events"]
    (step,) = event["steps"]
    assert event["done"] and step["signal"] == "SIGKILL" and step["ready_s"] > step["stopped_s"] >= 5.0, event
    names = [p["phase"] for p in run["phases"]]  # a loaded machine may take to the end to start it again
    assert names in (["before", "during kill"], ["before", "during kill", "after kill"]), names
    rows = report["requests"]
    assert len(rows) == run["arrivals"] == 16 and all(r["status"] != -1 for r in rows)
    # a turn fails only if it was in flight when the pod died
    held = [r for r in rows if r["sent_s"] <= step["stopped_s"] <= r["ended_s"]]
    assert sum(r["status"] != 200 for r in rows) == run["failed"] <= len(held)
    later = [r for r in rows if r["arrived_s"] > step["stopped_s"] and r["status"] == 200]
    assert later and phases.hit_rate(later) > 0.5  # the conversations go on, on pod-a, their KV in Redis
    assert set(run["phases"][-1]["requests_per_pod"]) == {"pod-a", "pod-b"} and report["churn"] == "kill"
    assert "unknown" not in run["whole_run"]["failed_per_pod"]  # every lost stream names the pod that held it
    assert run["targets"][0]["failed"] == run["failed"] and run["targets"][0]["in_flight"] >= run["failed"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (CI installs nginx-light in .ci/run)")
def test_churn_rolling_surge_replaces_each_pod_before_it_leaves(tmp_path: Path) -> None:
    """A surge rollout (ops/k8s's maxSurge 1, maxUnavailable 0) of two tiny pods: each new pod is routed before the
    old one is stopped, nothing fails, and the turns after it go to the new pods and hit."""
    out = tmp_path / "churn.json"
    assert main([*TINY, "--fleets", "kvstash", "--rates", "1", "--duration-s", "30", "--drain-s", "30", "--churn",
                 "rolling", "--churn-at", "3", "--churn-gap", "1", "--grace-s", "20", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    (event,) = run["events"]
    assert event["done"] and event["rollout"] == "surge", event
    assert [(s["pod"], s["replaced_by"]) for s in event["steps"]] == [("pod-a", "pod-c"), ("pod-b", "pod-d")]
    for step in event["steps"]:  # the new pod is routed before the old one leaves the balancer, which drains
        assert step["surge_s"] < step["ready_s"] <= step["stopped_s"] < step["exited_s"] and step["exit_code"] == 0
    rows = report["requests"]
    assert run["failed"] == 0 and all(r["status"] == 200 for r in rows), [r for r in rows if r["status"] != 200]
    first = event["steps"][0]
    on_new = [r for r in rows if r["pod"] == "pod-c"]
    assert on_new and all(r["cached_tokens"] > 0 for r in on_new)  # the new pod reads what the old ones wrote
    # once off the balancer (nginx reloaded), the old pod gets no new turn
    assert not [r for r in rows if r["pod"] == "pod-a" and r["sent_s"] > first["stopped_s"] + 1.0]
