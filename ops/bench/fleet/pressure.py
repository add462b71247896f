"""`kvstash bench fleet --budget-ratios`: the fleet's workload with the working set at multiples of the byte budget,
under each eviction policy of `--budget-policies`, beside the offline optimum of the fleet's own recorded trace.

The run with room for everything (its bytes held are the working set) records the requests its pods answered as a
trace in `kvstash bench budget --trace`'s JSON lines (`--trace-out` writes it): a session per user's conversation,
its prompt's tokens as the pods counted them, the warm-up turns first and then the measured ones in the order they
were sent. A shared system prompt is the trace's prefix, of the tokens the warm-up turns found cached (whole blocks:
a new user's first turn can reuse nothing else). The optimum is Belady's policy (ops/bench/budget/trace.py) on that
trace, holding the same share of its blocks as the budget holds of the working set (below the high watermark, as the
store evicts), its hits counted as the pods count theirs (cached tokens of the measured turns over their prompt
tokens), a turn whose session's whole chain it holds reusing all its previous turn computed (the pods' tail entries
cover the tokens after the last full block).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachestore.eviction import DEFAULT_POLICY
from ops.bench.budget.trace import Trace, belady_hits, cut, possible_hits
from ops.bench.fleet import workload as fleetload
from ops.bench.fleet.pods import FleetPods

MIN_BUDGET_MB = 8  # a budget holds at least one value of the largest size (cachestore max_value_bytes)
BLOCK_TOKENS = 64  # the pods' (PodSettings.block_tokens, which bench fleet leaves as it is)
SHARED_PREFIX = "system"


def with_policy(url: str, policy: str) -> str:
    """The Redis URL a pod takes, asking its store for eviction policy `policy` (a store option in the query)."""
    return f"{url}{'&' if '?' in url else '?'}eviction_policy={policy}"


@dataclass
class Recorded:
    """A fleet run's answered turns: trace lines (warm-up first, then the measured ones in the order they were
    sent), and per line whether it was measured, its prompt tokens and the tokens its session's previous turn
    computed (prompt and reply; 0 for a session's first)."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    measured: list[bool] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)
    before: list[int] = field(default_factory=list)


def record_trace(warm: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], shared: bool) -> Recorded:
    """The answered turns of a run (its warm-up's and its measured ones) as a trace."""
    prefix = max((r.get("cached_tokens", 0) for r in warm if r.get("status") == 200), default=0) if shared else 0
    prefix -= prefix % BLOCK_TOKENS
    ordered = [(False, r) for r in sorted(warm, key=lambda r: r.get("sent_s", 0.0))]
    ordered += [(True, r) for r in sorted(rows, key=lambda r: r.get("sent_s", 0.0))]
    out = Recorded()
    computed: dict[str, int] = {}
    for is_measured, r in ordered:
        if r.get("status") != 200 or "session" not in r:
            continue
        session, prompt = r["session"], int(r["prompt_tokens"])
        line: dict[str, Any] = {"session": session, "tokens": prompt}
        if prefix and session not in computed:
            line.update(prefix=SHARED_PREFIX, prefix_tokens=prefix)
        out.lines.append(line)
        out.measured.append(is_measured)
        out.prompts.append(prompt)
        out.before.append(computed.get(session, 0))
        computed[session] = prompt + int(r.get("completion_tokens", 0))
    return out


def optimum_hit_rate(recorded: Recorded, ratio: float, high_watermark: float) -> float:
    """Belady's hit rate on the trace with the working set at `ratio` x the budget, counted as the pods count theirs:
    cached tokens of the measured turns over their prompt tokens. A turn whose whole earlier chain it holds also
    reuses the rest of what the previous turn computed (the pods' tail entry: the tokens after its last full block,
    its reply among them); a pod prefills a prompt's last token, hit or not."""
    trace = Trace()
    for line in recorded.lines:
        trace.add(line["session"], line["tokens"], line.get("prefix"), line.get("prefix_tokens"))
    blocks = cut(trace, BLOCK_TOKENS)
    hits = belady_hits(blocks, int(high_watermark * len(blocks.hashes) / ratio))
    ceiling = possible_hits(blocks)
    served = total = 0
    for i, (held, prompt) in enumerate(zip(hits, recorded.prompts, strict=True)):
        if recorded.measured[i]:
            tokens = held * BLOCK_TOKENS
            if recorded.before[i] and held == ceiling[i]:
                tokens = max(tokens, recorded.before[i])
            served += min(tokens, prompt - 1)
            total += prompt
    return served / total if total else 0.0


def run(args: argparse.Namespace, redis_url: str, rate: float, ratios: list[float], duration: float,
        workload: fleetload.Workload, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workload at `rate` once with room for everything (its trace recorded), then for each ratio and policy
    with the budget at working set / ratio; each run on a fresh namespace."""
    from cachestore.settings import StoreSettings  # noqa: PLC0415
    from cachestore.syncstore import SyncBlockStore  # noqa: PLC0415

    policies = budget_policies(args)

    def one(name: str, budget_mb: int, n: int, policy: str) -> tuple[dict[str, Any], list[Any], list[Any]]:
        namespace = f"fleet-budget-{n}"
        with FleetPods(args, with_policy(redis_url, policy), "kvstash", namespace, budget_mb) as fleet:
            users = fleetload.make_users(workload, "budget")
            warm = fleetload.warm_up(users, args.model_name, fleet.url, False)  # the same conversations every run
            rows, _ = fleetload.drive(workload, fleet.url, args.model_name, rate, duration, tag="budget",
                                      seed=args.seed, sticky=False, drain_s=args.drain_s, users=users,
                                      skew=args.skew)
        settings = StoreSettings.from_url(redis_url, namespace=namespace, budget_bytes=budget_mb << 20)
        with SyncBlockStore(settings) as store:
            usage = store.usage()
        requests.extend({**r, "fleet": "budget", "budget_mb": budget_mb, "policy": policy} for r in rows)
        got = {"fleet": name, "policy": policy, "budget_mb": budget_mb, "bytes_held": usage.bytes_held,
               **fleetload.stats(rows, rate, duration)}
        print(f"[budget {name}, {policy}] {budget_mb} MiB: hit {got['hit_rate']:.2f}, TTFT p50 "
              f"{got['ttft_ms_p50']:.0f} ms", flush=True)
        return got, warm, rows

    ample, warm, rows = one("no pressure", args.budget_mb, 0, DEFAULT_POLICY)
    recorded = record_trace(warm, rows, workload.shared_system)
    if args.trace_out:
        Path(args.trace_out).write_text("".join(json.dumps(line) + "\n" for line in recorded.lines))
        print(f"wrote {args.trace_out} ({len(recorded.lines)} requests)", flush=True)
    high = StoreSettings.high_watermark
    working_set = ample["bytes_held"]
    ample["ratio"] = working_set / (args.budget_mb << 20)
    ample["optimum_hit_rate"] = optimum_hit_rate(recorded, ample["ratio"], high)
    runs = [ample]
    n = 0
    for ratio in ratios:
        budget_mb = max(MIN_BUDGET_MB, round(working_set / ratio / (1 << 20)))  # the ratio reported is the real one
        real = working_set / (budget_mb << 20)
        best = optimum_hit_rate(recorded, real, high)
        for policy in policies:
            n += 1
            got, _, _ = one(f"working set {ratio:g}x budget", budget_mb, n, policy)
            runs.append({**got, "ratio": real, "optimum_hit_rate": best})
    return runs


def budget_policies(args: argparse.Namespace) -> list[str]:
    return [p.strip() for p in args.budget_policies.split(",") if p.strip()]
