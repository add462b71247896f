"""The targets of issue 58, evaluated on each fleet of a `kvstash bench fleet --churn` (or `--skew`) run: each one a
row of what it needs, the value the run gave, and whether it passed. They are stated for kvstash's fleet; the
baselines' rows are beside them for comparison.

    rolling    no failed request (and none left unsent); TTFT p90 during the rollout <= 1.5x before it; hit rate
               during >= 0.9x before
    scale-out  each added pod's hit rate, from its first turn on, >= 0.9x the fleet's over the same time
    kill       failed turns <= turns in flight on the killed pod when it died; every turn that arrived after the
               kill answered, and the next turn of each conversation that lost one a hit
    skew       (--skew > 0) each pod's busy time over the run within 1.3x of the pods' mean

"Before" is the phase before the first event: the fleet's steady state.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ops.bench.common import print_table

MAX_P90_RATIO = 1.5
MIN_HIT_RATIO = 0.9
MAX_BUSY_OVER_MEAN = 1.3
COLUMNS = [("fleet", "fleet", ""), ("target", "target", ""), ("need", "needs", ""), ("value", "value", ""),
           ("result", "result", "")]


def _row(target: str, need: str, value: str, met: bool, **figures: Any) -> dict[str, Any]:
    return {"target": target, "need": need, "value": value, "met": met, **figures}


def _phase(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((p for p in run.get("phases", []) if p["phase"] == name), None)


def rolling(run: dict[str, Any]) -> list[dict[str, Any]]:
    unsent = run.get("unsent", 0)  # arrived, never sent: the fleet fell behind until the run ended
    out = [_row("rolling: failed requests", "0", f"{run['failed']}" + (f" ({unsent} never sent)" if unsent else ""),
                run["failed"] == 0 and not unsent, failed=run["failed"], unsent=unsent)]
    before, during = _phase(run, "before"), _phase(run, "during rolling")
    if before is None or during is None or not before["ok"] or not during["ok"]:
        return [*out, _row("rolling: phases", "turns answered before and during", "none in one of them", False)]
    p90 = during["ttft_ms_p90"] / before["ttft_ms_p90"] if before["ttft_ms_p90"] > 0 else float("inf")
    hit = during["hit_rate"] / before["hit_rate"] if before["hit_rate"] > 0 else 0.0
    return [*out,
            _row("rolling: TTFT p90 during / before", f"<= {MAX_P90_RATIO:g}",
                 f"{p90:.2f} ({during['ttft_ms_p90']:.0f} / {before['ttft_ms_p90']:.0f} ms)", p90 <= MAX_P90_RATIO,
                 ratio=p90),
            _row("rolling: hit rate during / before", f">= {MIN_HIT_RATIO:g}",
                 f"{hit:.2f} ({during['hit_rate']:.2f} / {before['hit_rate']:.2f})", hit >= MIN_HIT_RATIO,
                 ratio=hit)]


def scale_out(run: dict[str, Any]) -> list[dict[str, Any]]:
    added = run.get("added_pods", {})
    if not added:
        return [_row("scale-out: added pod's hit rate / fleet's", f">= {MIN_HIT_RATIO:g}", "no turn reached it",
                     False)]
    out = []
    for pod, a in added.items():
        ratio = a["hit_rate"] / a["fleet_hit_rate_since"] if a["fleet_hit_rate_since"] > 0 else 0.0
        out.append(_row(f"scale-out: {pod}'s hit rate / fleet's", f">= {MIN_HIT_RATIO:g}",
                        f"{ratio:.2f} ({a['hit_rate']:.2f} over {a['turns']} turns / {a['fleet_hit_rate_since']:.2f})",
                        ratio >= MIN_HIT_RATIO, ratio=ratio))
    return out


def in_flight(rows: Sequence[dict[str, Any]], pod: str, at_s: float) -> int:
    """Turns the pod held at `at_s`: sent to it (rows carry "pod", phases.split sets it) before, ended after."""
    return sum(1 for r in rows if r.get("pod") == pod and r.get("sent_s", at_s + 1) <= at_s <= r.get("ended_s", -1))


def kill(run: dict[str, Any], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    steps = [s for e in run.get("events", []) if e["event"] == "kill" for s in e.get("steps", [])]
    if not steps:
        return [_row("kill: failed <= in flight on the killed pod", "a pod killed", "the kill did not happen", False)]
    failed = [r for r in rows if r.get("status") not in (200, -1)]
    killed = sorted({s["pod"] for s in steps})
    held = sum(in_flight(rows, s["pod"], s["stopped_s"]) for s in steps)
    theirs = sum(1 for r in failed if r.get("pod") in killed)
    names = ", ".join(killed)
    out = [_row(f"kill: failed <= in flight on {names}", f"<= {held}",
                f"{len(failed)} ({theirs} on {names}, {len(failed) - theirs} elsewhere)", len(failed) <= held,
                failed=len(failed), failed_on_killed=theirs, in_flight=held)]
    first = min(s["stopped_s"] for s in steps)
    # a turn that arrived after the kill and was never sent (the fleet fell behind until the run ended) is not
    # answered either
    later = [r for r in rows if max(r.get("sent_s", -1.0), r["arrived_s"]) > first]
    bad = [r for r in later if r.get("status") != 200]
    unsent = sum(1 for r in bad if r.get("status") == -1)
    lost_users = {r["user"] for r in failed}
    nexts = [min((r for r in later if r["user"] == u and r.get("status") == 200), key=lambda r: r["sent_s"],
                 default=None) for u in lost_users]
    missed = sum(1 for r in nexts if r is None or not r.get("cached_tokens"))
    out.append(_row("kill: later turns answered; lost conversations' next turns hit", "0 not answered, 0 missed",
                    f"{len(bad)} of {len(later)} not answered" + (f" ({unsent} never sent)" if unsent else "")
                    + f", {missed} of {len(lost_users)} missed", not bad and not missed, later=len(later),
                    later_failed=len(bad), later_unsent=unsent, next_missed=missed))
    return out


def skew(run: dict[str, Any]) -> list[dict[str, Any]]:
    busy = run.get("whole_run", {}).get("busy_s_per_pod", {})
    mean = statistics.mean(busy.values()) if busy else 0.0
    worst = max(busy.values()) / mean if mean > 0 else float("inf")
    return [_row("skew: busiest pod's busy time / mean", f"<= {MAX_BUSY_OVER_MEAN:g}",
                 f"{worst:.2f} ({', '.join(f'{p} {v:.0f} s' for p, v in busy.items())})",
                 worst <= MAX_BUSY_OVER_MEAN, ratio=worst)]


def evaluate(run: dict[str, Any], rows: Sequence[dict[str, Any]], events: Sequence[str],
             skewed: bool) -> list[dict[str, Any]]:
    """Every target of the run's events (and of --skew, where the users' activity was uneven)."""
    out: list[dict[str, Any]] = []
    for kind in dict.fromkeys(events):
        out += rolling(run) if kind == "rolling" else scale_out(run) if kind == "scale-out" else kill(run, rows)
    return out + (skew(run) if skewed else [])


def print_targets(runs: Sequence[dict[str, Any]]) -> None:
    rows = [{"fleet": r["fleet"], **t, "result": "pass" if t["met"] else "FAIL"} for r in runs
            for t in r.get("targets", [])]
    if rows:
        print("\ntargets (issue 58; stated for kvstash, the baselines beside it)")
        print_table(rows, COLUMNS)
