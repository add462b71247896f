"""`kvstash bench fleet --churn`: the workload at one rate on each fleet while its pods are restarted, added or lost
(ops/bench/fleet/churn.py), each fleet's figures split into phases (ops/bench/fleet/phases.py).

Each fleet's users send their first turns (unmeasured), then the run's arrivals begin and the events play on the
run's clock. `--skew` makes the users' activity uneven (Zipf), in sweeps too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ops import svgchart
from ops.bench.common import print_table, write_chart
from ops.bench.fleet import churn, phases, targets, workload
from ops.bench.fleet.pods import FleetPods, label

CHURN_RATE = 0.2  # turns/s of a churn run unless --rates names one
GRACE_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds
CHURN_GAP_S = 5.0
PHASE_COLUMNS = [("fleet", "fleet", ""), ("phase", "phase", ""), ("window", "s", ""), ("arrivals", "n", "d"),
                 ("ok", "ok", "d"), ("failed", "failed", "d"), ("ttft_ms_p50", "TTFT p50", ".0f"),
                 ("ttft_ms_p90", "p90", ".0f"),
                 ("hit_rate", "hit", ".2f"), ("per_pod", "requests / busy s per pod", ""),
                 ("busy_max_over_mean", "busy max/mean", ".2f")]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--churn",
                   help=f"events while the load runs, comma-separated, of {', '.join(churn.EVENTS)}: one run at one "
                        "rate (of --rates, default 0.2) per fleet, its figures split into phases before, during and "
                        "after each event (default: none, the rate sweep)")
    p.add_argument("--churn-at",
                   help="seconds into the run each event begins, comma-separated (default: spread over the run)")
    p.add_argument("--churn-gap", type=float, default=CHURN_GAP_S,
                   help="rolling: seconds between one pod ready again and the next one stopped (a Deployment's "
                        f"minReadySeconds; default {CHURN_GAP_S:g})")
    p.add_argument("--rollout", choices=churn.ROLLOUTS, default="surge",
                   help="rolling: surge (default; as ops/k8s's Deployments: a new pod ready before the old one leaves) "
                        "or in-place (the old pod stopped first, started again on its port)")
    p.add_argument("--grace-s", type=float, default=GRACE_S,
                   help=f"rolling: seconds a pod has to exit after SIGTERM before SIGKILL (default {GRACE_S:g})")
    p.add_argument("--note",
                   help="a line the JSON and the results page carry with the run (what else loaded the machine)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="users of uneven activity: user i sends turns in proportion to 1 / (i + 1) ** SKEW "
                        "(Zipf; default 0: every user alike)")


def check(args: argparse.Namespace, rates: list[float], nproc: int) -> list[churn.ChurnEvent]:
    """The run's events, or SystemExit in one line before anything starts; sets `args.threads` (per pod: the cores
    shared by the most pods the fleet will have)."""
    if args.skew < 0 or args.skew > 10:
        raise SystemExit("--skew takes a Zipf exponent from 0 (every user alike) to 10")
    events: list[churn.ChurnEvent] = []
    if args.churn:
        if len(rates) != 1:
            raise SystemExit("--churn runs one rate: give --rates one number (default 0.2)")
        if args.budget_ratios or args.miss_overhead or args.stop_at_knee:
            raise SystemExit("--churn runs alone: --budget-ratios, --miss-overhead and --stop-at-knee belong to "
                             "the rate sweep")
        if args.grace_s < 0:
            raise SystemExit("--grace-s takes seconds, 0 or more")
        try:
            events = churn.plan(args.churn, args.churn_at or "", args.duration_s, args.pods, args.churn_gap)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    elif args.churn_at:
        raise SystemExit("--churn-at schedules the events of --churn: name them")
    most = args.pods + sum(e.kind == "scale-out" for e in events)
    if most > args.pods and (args.threads_per_pod or 1) * most > nproc:
        raise SystemExit(f"--churn scale-out grows the fleet to {most} pods: {nproc} cores cannot give each "
                         f"{args.threads_per_pod or 1} thread(s) (fewer --pods, or a machine with more cores)")
    args.threads = args.threads_per_pod or max(1, nproc // most)
    return events


def _run_fleet(args: argparse.Namespace, redis_url: str, kind: str, events: list[churn.ChurnEvent], rate: float,
               wl: workload.Workload, requests: list[dict[str, Any]]) -> dict[str, Any]:
    name = label(kind, args.engine)
    sticky = kind == "sticky"
    with FleetPods(args, redis_url, kind, f"churn-{kind}", args.budget_mb) as fleet:
        users = workload.make_users(wl, kind)
        warm = workload.warm_up(users, args.model_name, fleet.url, sticky)
        if any(r.get("status") != 200 for r in warm):
            raise SystemExit(f"[{name}] the warm-up turns failed: {warm}")
        print(f"[{name}] {len(fleet.pods)} pods ready behind nginx; {args.churn} at "
              + ", ".join(f"{e.at_s:.1f} s" for e in events), flush=True)
        runner = churn.ChurnRunner(events, fleet, grace_s=args.grace_s, gap_s=args.churn_gap, rollout=args.rollout)
        started = time.monotonic()
        runner.start(started)
        try:
            rows, _ = workload.drive(wl, fleet.url, args.model_name, rate, args.duration_s, tag=kind,
                                      seed=args.seed, sticky=sticky, drain_s=args.drain_s, users=users,
                                      skew=args.skew, started=started, on_row=runner.row_done)
        finally:
            record = runner.finish()
        names = fleet.names_by_port()
        counters = fleet.sidecar_events()
    split = phases.split(rows, record, args.duration_s, names)
    added = phases.added_pods(rows, record)
    run = {"fleet": name, "kind": kind, "events": record, "phases": split, "added_pods": added,
           "sidecar_events": counters, "whole_run": phases.whole(rows, names),
           **workload.stats(rows, rate, args.duration_s)}
    run["targets"] = targets.evaluate(run, rows, [e.kind for e in events], args.skew > 0)
    requests += [{**r, "fleet": kind, "rate": rate} for r in rows]
    for pod, a in added.items():
        print(f"[{name}] {pod}, added: hit {a['hit_rate']:.2f} over its {a['turns']} turns (its first "
              f"{a['first_turn_hit_rate']:.2f}); the fleet's {a['fleet_hit_rate_since']:.2f} since", flush=True)
    for e in record:
        steps = "; ".join(_step(s) for s in e["steps"])
        print(f"[{name}] {e['event']} at {e.get('began_s', e['at_s']):.1f} s: "
              + (f"done at {e['ended_s']:.1f} s" if e["done"] else e.get("error", "not begun (the run ended)"))
              + (f" ({steps})" if steps else ""), flush=True)
    if counters:
        print(f"[{name}] sidecar events since each pod's last start: {counters}", flush=True)
    return run


def _step(s: dict[str, Any]) -> str:
    if "replaced_by" in s:
        return (f"{s['replaced_by']} ready at {s['ready_s']:.1f} s, then {s['pod']} SIGTERM at {s['stopped_s']:.1f} s, "
                + ("SIGKILLed after the grace" if s.get("killed") else f"exit {s.get('exit_code')}")
                + f" in {s.get('exit_s', 0):.1f} s")
    if "signal" not in s:
        return f"{s.get('pod', '?')} added, routed at {s.get('ready_s', float('nan')):.1f} s"
    how = ("killed" if s["signal"] == "SIGKILL" else "SIGKILLed after the grace" if s.get("killed")
           else f"exit {s.get('exit_code')}")
    return (f"{s['pod']} {s['signal']} at {s['stopped_s']:.1f} s, {how} in {s.get('exit_s', 0):.1f} s, ready at "
            f"{s.get('ready_s', float('nan')):.1f} s")


def run(args: argparse.Namespace, redis_url: str, fleets: list[str], events: list[churn.ChurnEvent], rate: float,
        wl: workload.Workload, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One churn run per fleet, the same users, arrivals and events each time."""
    return [_run_fleet(args, redis_url, kind, events, rate, wl, requests) for kind in fleets]


def print_phases(runs: list[dict[str, Any]]) -> None:
    rows = [{"fleet": r["fleet"], **p, "window": f"{p['start_s']:.0f}-{p['end_s']:.0f}",
             "per_pod": ", ".join(f"{pod} {p['requests_per_pod'][pod]}/{p['busy_s_per_pod'][pod]:.1f}"
                                  + (f" ({n} failed)" if (n := p.get("failed_per_pod", {}).get(pod)) else "")
                                  for pod in p["requests_per_pod"])
             + (f", {n} failed on no known pod" if (n := p.get("failed_per_pod", {}).get("unknown")) else "")}
            for r in runs for p in r["phases"]]
    print_table(rows, PHASE_COLUMNS)


def plot(path: Path, runs: list[dict[str, Any]], title: str) -> None:
    """TTFT p90 by phase, a bar per fleet."""
    names = list(dict.fromkeys(p["phase"] for r in runs for p in r["phases"]))
    groups = {r["fleet"]: [next((p["ttft_ms_p90"] for p in r["phases"] if p["phase"] == n), 0.0) for n in names]
              for r in runs}
    write_chart(path, svgchart.bars(names, groups, title=title, ylabel="TTFT p90, ms"))
