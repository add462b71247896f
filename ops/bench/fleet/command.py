"""`kvstash bench fleet`: many users' multi-round chats through the balancer, and the arrival rate each fleet keeps
up with (its knee): kvstash (round robin, KV in Redis), no cache, and sticky sessions (nginx `hash $session
consistent`, KV in each pod's memory), the same pods each time.

The sweep runs the workload (ops/bench/fleet/workload.py) at each rate of `--rates` on each fleet, the same users going
on from rate to rate, their first turns sent (unmeasured) before the first rate. A fleet keeps up with
a rate when every turn that arrived was answered, none failed, and TTFT p90 (from the arrival, so a queue counts)
stays within 2x its value at the lowest rate; its knee is the highest rate it and every lower one kept up with.
The lowest rate's run lasts until `--base-arrivals` turns are due (at least `--duration-s`): its p90 is every other
rate's baseline, and the p90 of five turns is their slowest.
The bound on the gain comes from the same run's unloaded timings: one user's turns sent one at a time to the
kvstash fleet, (prefill + decode) / (hit + decode). `--budget-ratios` replays the workload with the working set
at each multiple of the byte budget (LRU under pressure); `--miss-overhead` runs a workload with no reuse with
kvstash on and off, interleaved (on, off, off, on: load drifting touches both alike). Pods get their share of the
cores (threads = cores / pods). `--merge` adds the run to an existing JSON of other engines' runs (the results page
shows every engine's fleet side by side). `--churn` runs one rate instead, while pods restart, join or die
(ops/bench/fleet/churnrun.py); the fleets and their pods: ops/bench/fleet/pods.py.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ops import netlink, svgchart
from ops.bench.common import check_chart, machine, print_table, write_chart, write_json
from ops.bench.fleet import churnrun, phases, pressure, report, targets, workload
from ops.bench.fleet.pods import FLEETS, LABELS, FleetPods, fleets_of, label
from service.engines import ENGINES

__all__ = ["FLEETS", "LABELS", "find_knee", "merged", "rate_duration", "register"]
SWEEP_RATES = "0.1,0.2,0.4,0.8"
COLUMNS = [("fleet", "fleet", ""), ("rate", "rate/s", ".3g"), ("arrivals", "n", "d"), ("ok", "ok", "d"),
           ("failed", "failed", "d"), ("ttft_ms_p50", "TTFT p50", ".0f"), ("ttft_ms_p90", "p90", ".0f"),
           ("ttft_ms_p99", "p99", ".0f"), ("itl_ms_p50", "ITL p50", ".1f"),
           ("completion_tokens_per_s", "out tok/s", ".1f"), ("prompt_tokens_per_s", "in tok/s", ".0f"),
           ("hit_rate", "hit", ".2f"), ("keeps_up", "keeps up", "")]


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("fleet", help="N users' chats through the balancer, at swept arrival rates (the "
                                    "knee) or while pods restart, join or die (--churn): kvstash against no cache "
                                    "and sticky sessions")
    p.add_argument("--engine", default="llamacpp", choices=list(ENGINES),
                   help="model runtime of the pods (llama-server: kvstash sidecars beside it, default llamacpp)")
    p.add_argument("--model", default="smollm2", help="model the pods serve (default smollm2)")
    p.add_argument("--codec", default="int8", help="codec of the cached blocks (default int8)")
    p.add_argument("--pods", type=int, default=2, help="pods behind the balancer (default 2)")
    p.add_argument("--threads-per-pod", type=int, default=0,
                   help="threads per pod (default: cores / pods, >= 1; with a scale-out, / the pods it grows to)")
    p.add_argument("--parallel", type=int, default=0,
                   help="sequences a pod decodes together (default 0: the engine's own, hf 8, llamacpp 4)")
    p.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"],
                   help="llamacpp, llama-server: the pods' flash attention (default auto: llama.cpp decides)")
    p.add_argument("--redis-url", help="an existing Redis (default: a private redis-server on a free port)")
    netlink.add_link_args(p)
    p.add_argument("--budget-mb", type=int, default=512, help="byte budget of the namespace, MiB (default 512)")
    p.add_argument("--users", type=int, default=4, help="users chatting at once (default 4)")
    p.add_argument("--system-tokens", type=int, default=300, help="system prompt, tokens (default ~300)")
    p.add_argument("--history-tokens", type=int, default=1200, help="history before the first turn (default ~1200)")
    p.add_argument("--query-tokens", type=int, default=30, help="question per turn, tokens (default ~30)")
    p.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn (default 32)")
    p.add_argument("--per-user-system", action="store_true", help="a system prompt per user (default: shared)")
    p.add_argument("--rates",
                   help=f"arrival rates to sweep, turns/s, comma-separated (default {SWEEP_RATES}; --churn: one rate)")
    p.add_argument("--duration-s", type=float, default=60.0, help="arrivals per rate run last this long")
    p.add_argument("--drain-s", type=float, default=60.0, help="after the last arrival, wait this long at most")
    p.add_argument("--base-arrivals", type=int, default=20,
                   help="the lowest rate's run lasts until this many turns are due (at least --duration-s): its "
                        "TTFT p90 is the baseline of every other rate's (default 20)")
    p.add_argument("--fleets", help=f"fleets to run (default all): {', '.join(FLEETS)}; with --engine "
                   "llama-server also kvstash-ram (the sidecar beside llama-server's own RAM cache); its sticky fleet "
                   "is stock llama-server with that cache")
    p.add_argument("--budget-ratios", default="",
                   help="kvstash only: also replay the workload at the lowest rate with the working set at these "
                        "multiples of the budget (e.g. 2,1,0.5,0.25)")
    p.add_argument("--budget-policies", default="chain,lru",
                   help="eviction policies of the budget-pressure runs, a run each per ratio (default chain,lru)")
    p.add_argument("--budget-only", action="store_true",
                   help="run only the budget-pressure runs (no sweep); with --merge their rows replace this engine's "
                        "budget-pressure rows in the JSON, the rest kept")
    p.add_argument("--trace-out", type=Path,
                   help="write the requests of the budget run with no pressure here, as `bench budget --trace` reads")
    p.add_argument("--miss-overhead", action="store_true",
                   help="also run a workload with no reuse at the lowest rate, kvstash on against off")
    p.add_argument("--budget-rate", type=float, default=0.0,
                   help="arrival rate of the budget-pressure runs (default: the lowest of --rates)")
    p.add_argument("--miss-rate", type=float, default=0.0,
                   help="arrival rate of the miss-overhead runs (default: the lowest of --rates)")
    p.add_argument("--miss-duration-s", type=float, default=0.0,
                   help="arrivals of each of the four miss-overhead runs last this long (default: --duration-s)")
    p.add_argument("--stop-at-knee", action="store_true",
                   help="stop a fleet's sweep at the first rate it does not keep up with (the knee is below it)")
    churnrun.add_args(p)
    p.add_argument("--seed", type=int, default=35, help="seed of the arrival times")
    p.add_argument("--json", type=Path, help="write the summary and every request as JSON here")
    p.add_argument("--merge", action="store_true",
                   help="with --json: keep the other runs the file holds, replacing this engine's of the same --churn "
                        "and --skew")
    p.add_argument("--plot", type=Path, help="an .svg file: TTFT p90 against the arrival rate, a line per fleet; "
                   "with --budget-ratios also <stem>-budget-hits.svg and <stem>-budget-ttft.svg; with --churn "
                   "TTFT p90 by phase, a bar per fleet")
    p.set_defaults(func=run)


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name} takes comma-separated numbers, not {text!r}") from None
    if any(v <= 0 for v in values):
        raise SystemExit(f"{name} takes positive numbers")
    return values


def _workload(args: argparse.Namespace, reuse: bool = True) -> workload.Workload:
    return workload.Workload(args.users, args.system_tokens, args.history_tokens, args.query_tokens, args.max_tokens,
                              shared_system=not args.per_user_system and reuse, reuse=reuse)


def _calibrate(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """One user's first turns sent one at a time to an idle kvstash fleet: a miss (prefill), then hits."""
    import time  # noqa: PLC0415

    wl = _workload(args)
    user = workload.ChatUser(workload.Workload(1, wl.system_tokens, wl.history_tokens, wl.query_tokens,
                                                 wl.max_tokens, shared_system=False), "calibrate", 0)
    start = time.monotonic()
    rows = [workload.send_turn(user, args.model_name, url, 0.0, time.monotonic(), start + 900, False, seq)
            for seq in range(4)]
    ok = [r for r in rows if r.get("status") == 200]
    if len(ok) < 3:
        raise SystemExit(f"calibration failed: {rows}")
    prefill = ok[0]["service_ttft_ms"]
    hits = [r["service_ttft_ms"] for r in ok[1:]]
    decode = statistics.median(r["decode_ms"] for r in ok)
    hit = statistics.median(hits)
    return {"prefill_ms": prefill, "hit_ms": hit, "decode_ms": decode, "prompt_tokens": ok[0]["prompt_tokens"],
            "bound": (prefill + decode) / (hit + decode), "turns": ok}


def find_knee(runs: list[dict[str, Any]]) -> float:
    """Mark each run's `keeps_up`; the knee: the highest rate that it and every lower rate kept up with (0 if none)."""
    runs.sort(key=lambda r: r["rate"])
    base = runs[0]["ttft_ms_p90"] if runs else 0.0
    knee, ok_so_far = 0.0, True
    for r in runs:
        r["keeps_up"] = (r["ok"] == r["arrivals"] > 0 and r["failed"] == 0 and r["ttft_ms_p90"] <= 2 * base)
        ok_so_far = ok_so_far and r["keeps_up"]
        if ok_so_far:
            knee = r["rate"]
    return knee


def rate_duration(args: argparse.Namespace, rate: float, lowest: bool) -> float:
    """How long a rate's arrivals last: `--duration-s`, and for the lowest rate until `--base-arrivals` are due."""
    return max(args.duration_s, args.base_arrivals / rate) if lowest else args.duration_s


def _sweep(args: argparse.Namespace, redis_url: str, kind: str, rates: list[float],
           requests: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    runs, calibration = [], None
    with FleetPods(args, redis_url, kind, f"fleet-{kind}", args.budget_mb) as fleet:
        url = fleet.url
        if kind == "kvstash":
            calibration = _calibrate(args, url)
            print(f"[unloaded] prefill {calibration['prefill_ms']:.0f} ms, hit {calibration['hit_ms']:.0f} ms, "
                  f"decode {calibration['decode_ms']:.0f} ms at {calibration['prompt_tokens']} tokens: bound "
                  f"{calibration['bound']:.2f}x", flush=True)
        # one set of users for the whole sweep, their first turns sent before it: each rate sees conversations
        # under way (a user starts a new one after max_turns), not every user's opening at once
        users = workload.make_users(_workload(args), kind)
        warm = workload.warm_up(users, args.model_name, url, kind == "sticky")
        if any(r.get("status") != 200 for r in warm):
            raise SystemExit(f"[{label(kind, args.engine)}] the warm-up turns failed: {warm}")
        for i, rate in enumerate(rates):
            duration = rate_duration(args, rate, i == 0)
            rows, _ = workload.drive(_workload(args), url, args.model_name, rate, duration,
                                      tag=f"{kind}-{i}", seed=args.seed + i, sticky=kind == "sticky",
                                      drain_s=args.drain_s, users=users, skew=args.skew)
            run = {"fleet": label(kind, args.engine), "kind": kind, "duration_s": duration,
                   **workload.stats(rows, rate, duration)}
            if args.skew > 0:  # uneven users: how evenly the pods were kept busy
                run["whole_run"] = phases.whole(rows, fleet.names_by_port())
                run["phases"] = [run["whole_run"]]  # the results page's churn section shows it as one phase
                run["targets"] = targets.skew(run)
            print(f"[{run['fleet']}] {rate:g}/s: {run['ok']}/{run['arrivals']} ok, {run['failed']} failed, "
                  f"TTFT p90 {run['ttft_ms_p90']:.0f} ms, hit {run['hit_rate']:.2f}", flush=True)
            runs.append(run)
            requests += [{**r, "fleet": kind, "rate": rate} for r in rows]
            if args.stop_at_knee and len(runs) > 1 and find_knee(list(runs)) < rate:
                print(f"[{run['fleet']}] fell behind at {rate:g}/s: the rates above it are not run", flush=True)
                break
    return runs, calibration


MISS_ORDER = ("kvstash", "off", "off", "kvstash")  # interleaved: load drifting over the runs touches both alike


def _miss_overhead(args: argparse.Namespace, redis_url: str, rate: float,
                   requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The no-reuse workload with kvstash on and off, in MISS_ORDER; each side's rows pooled. A side's k-th run has
    the other side's k-th run's arrivals (its seed), so both sides answer the same requests and their throughputs
    compare."""
    duration = args.miss_duration_s or args.duration_s
    rows_of: dict[str, list[dict[str, Any]]] = {"kvstash": [], "off": []}
    per_run: dict[str, list[dict[str, Any]]] = {"kvstash": [], "off": []}
    for n, kind in enumerate(MISS_ORDER):
        seed = args.seed + len(per_run[kind])  # the same for the k-th run of either side
        with FleetPods(args, redis_url, kind, f"fleet-miss-{kind}-{n}", args.budget_mb) as fleet:
            rows, _ = workload.drive(_workload(args, reuse=False), fleet.url, args.model_name, rate, duration,
                                      tag=f"miss-{kind}-{n}", seed=seed, sticky=False, drain_s=args.drain_s)
        requests += [{**r, "fleet": f"miss-{kind}", "rate": rate} for r in rows]
        rows_of[kind] += rows
        per_run[kind].append(workload.stats(rows, rate, duration))
    runs = []
    for kind in ("kvstash", "off"):
        pooled = workload.stats(rows_of[kind], rate, duration)  # latencies over every run's turns
        for key in ("completion_tokens_per_s", "prompt_tokens_per_s"):  # rates: the mean of the runs'
            pooled[key] = statistics.mean(r[key] for r in per_run[kind])
        runs.append({"fleet": f"no reuse, {label(kind, args.engine)}", "kind": kind, "runs": len(per_run[kind]),
                     **pooled})
    on, off = runs
    for key in ("ttft_ms_p50", "ttft_ms_p90", "completion_tokens_per_s"):
        on[f"{key}_vs_off"] = on[key] / off[key] if off[key] else 0.0
    return runs


def merged(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """{"engines": [...]}: the reports `path` holds (one, or several merged before) with `result` in place of any
    of its engine, churn events and skew, ordered by them; machine_before is the first report's (the
    page's machine line)."""
    import json  # noqa: PLC0415

    held: list[dict[str, Any]] = []
    if path.exists():
        old = json.loads(path.read_text())
        held = old["engines"] if "engines" in old else [old]
    def key(r: dict[str, Any]) -> tuple[str, str, float]:
        return r["engine"], r.get("churn") or "", r.get("skew") or 0.0

    reports = sorted([r for r in held if key(r) != key(result)] + [result], key=key)
    return {"engines": reports, "machine_before": reports[0]["machine_before"]}


def merged_budget(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The JSON `path` holds with `result`'s budget-pressure rows in place of its engine's (`--budget-only`), and
    `budget_run`: the machine and arguments of the run they came from."""
    import json  # noqa: PLC0415

    old = json.loads(path.read_text()) if path.exists() else {"engines": []}
    held = old["engines"] if "engines" in old else [old]
    mine = [r for r in held if r["engine"] == result["engine"] and not r.get("churn")]
    if not mine:
        raise SystemExit(f"--budget-only --merge: {path} holds no {result['engine']} sweep to add the rows to")
    mine[0]["budget_pressure"] = result["budget_pressure"]
    mine[0]["budget_run"] = {k: result[k] for k in ("machine_before", "machine_after", "args")}
    mine[0]["requests"] = [r for r in mine[0].get("requests", []) if r.get("fleet") != "budget"] + result["requests"]
    return {"engines": held, "machine_before": held[0]["machine_before"]}


def _check(args: argparse.Namespace, nproc: int) -> tuple[list[float], list[float], list[str], list[Any]]:
    """Every argument checked before anything starts (one line and exit 2 where one is wrong): the rates, budget
    ratios, fleets and churn events of the run."""
    from ops.pods import nginx_binary  # noqa: PLC0415
    from service.engines import check_runtime, default_parallel  # noqa: PLC0415

    check_chart(args.plot)
    rates = sorted(_floats(args.rates or (str(churnrun.CHURN_RATE) if args.churn else SWEEP_RATES), "--rates"))
    ratios = _floats(args.budget_ratios, "--budget-ratios") if args.budget_ratios else []
    from cachestore.eviction import POLICIES  # noqa: PLC0415

    policies = pressure.budget_policies(args)
    if not policies or any(p not in POLICIES for p in policies):
        raise SystemExit(f"--budget-policies takes {', '.join(POLICIES)} (comma-separated)")
    if args.budget_only and (not ratios or args.churn or args.miss_overhead):
        raise SystemExit("--budget-only runs the budget-pressure runs alone: give --budget-ratios, no --churn or "
                         "--miss-overhead")
    known = fleets_of(args.engine)
    fleets = [f.strip() for f in args.fleets.split(",") if f.strip()] if args.fleets else list(known)
    if not fleets or any(f not in known for f in fleets):
        raise SystemExit(f"--fleets takes {', '.join(known)} (comma-separated) with --engine {args.engine}")
    if args.users < 1 or args.pods < 1 or args.duration_s <= 0 or args.base_arrivals < 1 or args.miss_duration_s < 0:
        raise SystemExit("--users, --pods, --duration-s and --base-arrivals must be positive, --miss-duration-s "
                         "positive or 0 (the default: --duration-s)")
    if args.flash_attn != "auto" and args.engine == "hf":
        raise SystemExit("--flash-attn is llama.cpp's setting: it takes --engine llamacpp or llama-server")
    if not 0 <= args.parallel <= 64:
        raise SystemExit("--parallel must be in 0..64 (0: the engine's own)")
    events = churnrun.check(args, rates, nproc)
    netlink.spec_of(args)  # the link's arguments, checked (run builds it)
    if args.redis_url:  # any URL a pod takes (redis+cluster://...), on this machine
        from ops.bench.rawredis import operator_redis  # noqa: PLC0415

        if urlsplit(args.redis_url).hostname not in ("127.0.0.1", "localhost"):
            raise SystemExit("bench fleet sends traffic to 127.0.0.1 only: --redis-url must be a local Redis")
        operator_redis(args.redis_url)
    # what this machine lacks, once every argument is known to be right
    if nginx_binary() is None:
        raise SystemExit("bench fleet runs through nginx: install it (apt-get install nginx-light)")
    check_runtime(args.engine)
    if args.engine == "llama-server":
        from service.engines.llama.llamaserverproc import DEFAULT_BINARY  # noqa: PLC0415

        if not DEFAULT_BINARY.is_file():
            raise SystemExit(f"--engine llama-server needs the llama-server `make setup` builds at {DEFAULT_BINARY}")
    args.parallel = args.parallel or default_parallel(args.engine)  # the pods' number, in the report too
    args.model_name = Path(args.model).stem if args.engine != "hf" and args.model != "smollm2" else (
        Path(args.model).name if "/" in args.model else args.model)
    return rates, ratios, fleets, events


def run(args: argparse.Namespace) -> int:
    from cachestore.errors import ConfigError  # noqa: PLC0415
    from ops.redisproc import RedisProcess  # noqa: PLC0415

    before = machine()
    try:
        rates, ratios, fleets, events = _check(args, before["nproc"] or 1)
    except SystemExit as exc:  # bad input: one line, exit 2 (as argparse's own), before anything starts
        if not isinstance(exc.code, str):
            raise
        raise ConfigError(exc.code) from None
    spec = netlink.spec_of(args)
    with netlink.opened(spec) as link:
        redis = None if args.redis_url else RedisProcess(extra_args=("--maxmemory", f"{2 * args.budget_mb + 256}mb",
                                                                      "--maxmemory-policy", "allkeys-lru")).start()
        redis_url = args.redis_url or redis.url  # type: ignore[union-attr]
        if link is not None and redis is not None:
            link.shape(redis.port)
            print(link.describe(), flush=True)
        requests: list[dict[str, Any]] = []
        runs: list[dict[str, Any]] = []
        knees: dict[str, float] = {}
        calibration = None
        budget: list[dict[str, Any]] = []
        miss: list[dict[str, Any]] = []
        try:
            if events:
                runs = churnrun.run(args, redis_url, fleets, events, rates[0], _workload(args), requests)
            for kind in fleets if not events and not args.budget_only else []:
                fleet_runs, cal = _sweep(args, redis_url, kind, rates, requests)
                knees[kind] = find_knee(fleet_runs)
                runs += fleet_runs
                calibration = calibration or cal
            if ratios:
                rate = args.budget_rate or rates[0]
                budget = pressure.run(args, redis_url, rate, ratios, rate_duration(args, rate, True),
                                         _workload(args), requests)
            if args.miss_overhead:
                miss = _miss_overhead(args, redis_url, args.miss_rate or rates[0], requests)
        finally:
            if redis is not None:
                redis.cleanup()
    if events:
        churnrun.print_phases(runs)
        targets.print_targets(runs)
        result: dict[str, Any] = {"engine": args.engine, "churn": args.churn, "skew": args.skew, "runs": runs}
    else:
        goals = report.targets(runs, knees, calibration)
        print_table(runs, COLUMNS)
        report.print_summary(knees, calibration, goals, budget, miss)
        targets.print_targets(runs)
        result = {"engine": args.engine, "skew": args.skew, "runs": runs, "knees": knees, "calibration": calibration,
                  "targets": goals, "budget_pressure": budget, "miss_overhead": miss}
    if args.json:
        result.update(notes=args.note or "", threads_per_pod=args.threads, requests=requests, machine_before=before,
                      machine_after=machine(),
                      **({"link": link.as_json()} if link is not None else {}),
                      args={k: v for k, v in vars(args).items() if k != "func" and not isinstance(v, Path)})
        if args.budget_only and args.merge:
            write_json(args.json, merged_budget(args.json, result))
        else:
            write_json(args.json, merged(args.json, result) if args.merge else result)
    if args.plot and events:
        churnrun.plot(args.plot, runs, f"TTFT p90 by phase, {args.churn}: {args.pods} {args.engine} pods, "
                        f"{args.users} users")
    elif args.plot:
        p90 = {(r["kind"], r["rate"]): r["ttft_ms_p90"] for r in runs}
        series = {label(k, args.engine): [p90.get((k, rate)) for rate in rates] for k in fleets}
        write_chart(args.plot, svgchart.lines([f"{x:g}" for x in rates], series, log=True,
                                              title=f"TTFT p90 against arrival rate: {args.pods} {args.engine} pods, "
                                                    f"{args.users} users",
                                              xlabel="turns arriving per second", ylabel="TTFT p90, ms (log)"))
        if budget:
            report.plot_budget(args.plot, budget)
    return 0
