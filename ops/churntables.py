"""The results page's section of `kvstash bench fleet --churn`: each run's phases (before, during and after each
event) as a table per engine and events, and TTFT p90 by phase as a chart."""

from __future__ import annotations

from typing import Any

from ops import svgchart
from ops.resulttables import Table, _ms, _row

_HEAD = ["| fleet | phase | window s | turns | answered | failed | TTFT p50 ms | p90 ms | p90 / before | hit rate | "
         "requests per pod | busy s per pod |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]


_TARGETS_HEAD = ["| fleet | target | needs | value | result |", "|---|---|---|---|---|"]


def _title(r: dict[str, Any]) -> str:
    """What moved in the run: its events, and the users' skew."""
    skew = f"Zipf {r['skew']:g} users" if r.get("skew") else ""
    return ", ".join(x for x in (r.get("churn") or "", skew) if x) or "steady"


def targets_table(r: dict[str, Any]) -> Table:
    """Issue 58's targets of each fleet of the run, pass or fail (none for a run before they were evaluated)."""
    rows = [_row([run["fleet"], t["target"], t["need"], t["value"],
                  "pass" if t["met"] else "**fail**"]) for run in r["runs"] for t in run.get("targets", [])]
    return ["", "Targets (stated for kvstash; the baselines beside it):", "", *_TARGETS_HEAD, *rows] if rows else []


def _reports(d: dict[str, Any]) -> list[dict[str, Any]]:
    return list(d.get("engines", [d]))


def _summary(r: dict[str, Any]) -> str:
    a = r.get("args", {})
    load = (r.get("machine_before") or {}).get("loadavg")
    under = f" (load average {load[0]:.1f} at the start)" if load else ""
    skew = f", activity Zipf {r['skew']:g}" if r.get("skew") else ""
    return (f"**{r.get('engine', '?')}, {_title(r)}**{under}: {a.get('pods', '?')} pods, "
            f"{r.get('threads_per_pod', '?')} thread(s) each, {a.get('parallel', '?')} sequences decoded together, "
            f"{a.get('users', '?')} users{skew}, ~{a.get('system_tokens', '?')} + ~{a.get('history_tokens', '?')} "
            f"token openings, replies of at most {a.get('max_tokens', '?')} tokens, "
            f"{r['runs'][0]['rate'] if r.get('runs') else '?'} turns/s for {a.get('duration_s', 0):g} s"
            + (f"; {r['notes']}" if r.get("notes") else "")
            + (f"; each pod has {a.get('grace_s', 0):g} s to exit after SIGTERM, the next one going "
               f"{a.get('churn_gap', 0):g} s after it is ready." if "rolling" in str(r.get("churn")) else "."))


def _step(s: dict[str, Any]) -> str:
    if "replaced_by" in s:
        gone = "SIGKILLed when its grace ran out" if s.get("killed") else f"exit code {s.get('exit_code')}"
        return (f"{s['replaced_by']} started at {s['surge_s']:.1f} s and routed at {s['ready_s']:.1f} s, then "
                f"{s['pod']} off the balancer and SIGTERM ({gone}, gone after {s.get('exit_s', 0):.1f} s)")
    if "signal" not in s:
        return f"{s.get('pod', '?')} added, routed at {s.get('ready_s', 0):.1f} s"
    exit_ = "SIGKILLed when its grace ran out" if s.get("killed") and s["signal"] == "SIGTERM" else (
        f"exit code {s.get('exit_code')}" if s["signal"] == "SIGTERM" else "killed")
    return (f"{s['pod']} {s['signal']} at {s['stopped_s']:.1f} s ({exit_}, gone after {s.get('exit_s', 0):.1f} s), "
            f"ready at {s.get('ready_s', 0):.1f} s")


def _events(run: dict[str, Any]) -> str:
    parts = []
    added = run.get("added_pods", {})
    for e in run.get("events", []):
        steps = "; ".join(_step(s) + _added(added.get(s.get("pod", ""))) if "signal" not in s else _step(s)
                          for s in e.get("steps", []))
        state = "" if e.get("done") else f" (not completed: {e.get('error', 'the run ended first')})"
        parts.append(f"{e['event']}{state}: {steps or 'nothing done'}")
    return f"- {run['fleet']}: " + ". ".join(parts) + "."


def _added(a: dict[str, Any] | None) -> str:
    return "" if a is None else (f" (hit rate {a['hit_rate']:.2f} over its {a['turns']} turns, its first "
                                 f"{a['first_turn_hit_rate']:.2f}; the fleet's {a['fleet_hit_rate_since']:.2f} since)")


def _pods(per_pod: dict[str, float], spec: str) -> str:
    return ", ".join(f"{pod} {format(v, spec)}" for pod, v in per_pod.items())


def _requests(p: dict[str, Any]) -> str:
    """Each pod's answered turns, and the turns that failed on it (a lost stream counts against its pod)."""
    failed = p.get("failed_per_pod", {})
    return ", ".join(f"{pod} {n}" + (f" ({failed[pod]} failed)" if failed.get(pod) else "")
                     for pod, n in p["requests_per_pod"].items()) + (
        f", {failed['unknown']} failed on no known pod" if failed.get("unknown") else "")


def report_table(r: dict[str, Any]) -> Table:
    table = [_summary(r), "", *_HEAD]
    for run in r["runs"]:
        for p in run["phases"]:
            ratio = p.get("ttft_ms_p90_vs_before")
            table.append(_row([run["fleet"], p["phase"], f"{p['start_s']:.0f}-{p['end_s']:.0f}", f"{p['arrivals']}",
                               f"{p['ok']}", f"{p['failed']}", _ms(p["ttft_ms_p50"]), _ms(p["ttft_ms_p90"]),
                               f"{ratio:.2f}" if ratio is not None else "", f"{p['hit_rate']:.2f}",
                               _requests(p), _pods(p["busy_s_per_pod"], ".0f")]))
    return [*table, *targets_table(r), "", *(_events(run) for run in r["runs"] if run.get("events")), ""]


def chart(r: dict[str, Any]) -> str:
    """TTFT p90 by phase, a bar per fleet."""
    names = list(dict.fromkeys(p["phase"] for run in r["runs"] for p in run["phases"]))
    series = {run["fleet"]: [next((p["ttft_ms_p90"] for p in run["phases"] if p["phase"] == n), None) for n in names]
              for run in r["runs"]}
    return svgchart.bars(names, series, title=f"TTFT p90 by phase: {r.get('engine', '?')}, {_title(r)}",
                         ylabel="ms (log scale)", log=True)


def churn(d: dict[str, Any]) -> tuple[Table, str]:
    """Every report's table; the first one's chart (the others': `churn_charts`)."""
    reports = _reports(d)
    table = [line for r in reports for line in report_table(r)]
    return table[:-1] if table and not table[-1] else table, chart(reports[0])


def churn_charts(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(f"{r.get('engine', '?')}-" + "-".join([*(r.get("churn") or "steady").split(","),
                                                   *(["skew"] if r.get("skew") else [])]),
             f"TTFT p90 by phase: {r.get('engine', '?')}, {_title(r)}", chart(r)) for r in _reports(d)[1:]]
