"""The results page's tables and charts: one function per benchmark, from its JSON to table lines and an SVG."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ops import svgchart
from ops.bench.quality.merge import WITHHELD, row_name, withheld

Table = list[str]


@dataclass(frozen=True)
class Bench:
    """One benchmark on the page: its JSON's name in docs/results/, how it runs and how it is drawn."""

    name: str
    title: str
    method: str
    command: str
    render: Callable[[dict[str, Any]], tuple[Table, str]]  # -> table lines, SVG chart
    extra: Callable[[dict[str, Any]], list[tuple[str, str, str]]] | None = None  # -> more charts: (name, title, SVG)


def _ms(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:,.1f}"


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}x" if v >= 10 else f"{v:.2f}x"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def machine_line(d: dict[str, Any]) -> str:
    """'2 cores (CPU), 23.6 GB RAM, load average 0.93 at the start; 2026-12-02' from a result's machine facts."""
    m = d.get("machine") or d.get("machine_before") or {}
    load = m.get("loadavg")
    parts = [f"{m.get('nproc', '?')} cores ({m.get('cpu') or 'unknown CPU'}), {m.get('ram_gb', '?')} GB RAM"]
    if load:
        parts.append(f"load average {load[0]:.2f} at the start")
    return ", ".join(parts) + f"; {m.get('date', 'date not recorded')}"


_METHOD_NAMES = {"recompute": "recompute (full prefill)", "recompute-q8_0": "recompute, q8_0 KV cache",
                 "slot-file-tmpfs": "llama-server slot file on tmpfs (one machine)"}


def _method(name: str) -> str:
    if name == "kvstash-q8":  # its speedup is against the prefill of a q8_0 cache, as a q8 pod runs
        return "hit, `q8` (vs the q8_0 recompute)"
    if name.startswith("kvstash-"):
        return f"hit, `{name.removeprefix('kvstash-')}`"
    return _METHOD_NAMES.get(name, name)


def _resume(d: dict[str, Any]) -> tuple[Table, str]:
    rows = sorted((r for r in d["rows"] if not r["method"].startswith(("floor-", "naive"))), key=lambda r: r["context"])
    table = ["| context | method | TTFT p50 ms | p90 ms | MB read | vs recompute | hit / floor |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        floor = f"{r['ratio_to_floor']:.2f}" if r.get("ratio_to_floor") else ""
        mb = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] else ""
        speedup = _x(r["speedup_vs_recompute"]) if r["method"].startswith("kvstash-") or "slot" in r["method"] else ""
        table.append(_row([f"{r['context']:,}", _method(r["method"]), _ms(r["ttft_ms_p50"]), _ms(r["ttft_ms_p90"]),
                           mb, speedup, floor]))
    contexts = sorted({r["context"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    series = {_method(m).replace("`", "").split(" (")[0]: [next((r["ttft_ms_p50"] for r in rows
                                                 if r["context"] == c and r["method"] == m), None) for c in contexts]
              for m in methods}
    chart = svgchart.bars([f"{c:,} tokens" for c in contexts], series, title="Time to first token, p50",
                          ylabel="ms (log scale)", log=True)
    return table + _stored_per_token(rows), chart


def _resume_link(d: dict[str, Any]) -> tuple[Table, str]:
    """A hit over a shaped link (`bench resume --link-gbit`): each codec's hit beside its floor, the floor's reads
    against the link's arithmetic (bytes x 8 / rate), recompute, and what the hit allocated against its KV."""
    by = {(r["context"], r["method"]): r for r in d["rows"]}
    hits = sorted((r for r in d["rows"] if r["method"].startswith("kvstash-")), key=lambda r: r["context"])
    table = ["| context | codec | MB read | hit p50 ms | floor p50 ms | hit / floor | floor's reads / link | "
             "recompute ms | vs recompute | hit memory / KV |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    contexts = sorted({r["context"] for r in hits})
    series: dict[str, list[float | None]] = {}
    for r in hits:
        mode = r["method"].removeprefix("kvstash-")
        floor = by.get((r["context"], f"floor-{mode}"), {})
        recompute: dict[str, Any] = next((x for (c, m), x in by.items()
                                          if c == r["context"] and m.startswith("recompute")), {})
        cold = r.get("memory_cold", r is next(x for x in hits if x["context"] == r["context"]))  # measured first
        memory = r.get("hit_memory_to_kv") if cold else None  # a warm hit's figure says only what pools lacked
        table.append(_row([f"{r['context']:,}", f"`{mode}`", f"{r['bytes'] / 1e6:,.0f}", _ms(r["ttft_ms_p50"]),
                           _ms(floor["ttft_ms_p50"]) if floor else "", f"{r['ratio_to_floor']:.2f}"
                           if r.get("ratio_to_floor") else "", f"{floor['to_link']:.2f}" if floor.get("to_link")
                           else "", _ms(recompute["ttft_ms_p50"]) if recompute else "",
                           _x(r["speedup_vs_recompute"]),
                           f"{memory:.2f}" if memory is not None else ""]))
        for name, row in ((f"hit {mode}", r), (f"floor {mode}", floor)):
            series.setdefault(name, [None] * len(contexts))[contexts.index(r["context"])] = row.get("ttft_ms_p50")
    series["recompute"] = [next((x["ttft_ms_p50"] for (c, m), x in by.items() if c == ctx and m.startswith(
        "recompute")), None) for ctx in contexts]
    link = d.get("link") or {}
    chart = svgchart.bars([f"{c:,} tokens" for c in contexts], series, ylabel="ms (log scale)", log=True,
                          title=f"Time to first token over a {link.get('gbit', '?'):g} Gbit/s link, p50")
    return table, chart


def _stored_per_token(rows: list[dict[str, Any]]) -> Table:
    """A sliding-window or hybrid model's bytes stored a token (blocks of its full-attention layers and one
    boundary record) against blocks of every layer, where the run measured them."""
    sized = [r for r in rows if r.get("bytes_per_token")]
    if not sized:
        return []
    table = ["", "| context | codec | stored B/token | of which the boundary record, MB | every layer's blocks B/token "
                 "| saved |", "|---:|---|---:|---:|---:|---:|"]
    for r in sized:
        table.append(_row([f"{r['context']:,}", f"`{r['method'].removeprefix('kvstash-')}`",
                           f"{r['bytes_per_token']:,.0f}", f"{r['record_bytes'] / 1e6:.1f}",
                           f"{r['every_layer_bytes_per_token']:,.0f}",
                           _x(r["every_layer_bytes_per_token"] / r["bytes_per_token"])]))
    return table


def _signed(d: dict[str, Any]) -> tuple[Table, str]:
    """Each codec's hit on a signing pod against the same hit unsigned, by context (the rows of --frame-key)."""
    by = {(r["context"], r["method"]): r for r in d["rows"]}
    signed = sorted((r for r in d["rows"] if r["method"].startswith("signed-")), key=lambda r: r["context"])
    table = ["| context | codec | unsigned hit p50 ms | signed hit p50 ms | signed / unsigned (paired median) | "
             "target |", "|---:|---|---:|---:|---:|---|"]
    groups, unsigned_ms, signed_ms = [], [], []
    for r in signed:
        mode = r["method"].removeprefix("signed-")
        plain = by.get((r["context"], f"kvstash-{mode}"))
        ratio = r.get("ratio_to_unsigned")
        table.append(_row([f"{r['context']:,}", f"`{mode}`", _ms(plain["ttft_ms_p50"]) if plain else "",
                           _ms(r["ttft_ms_p50"]), f"{ratio:.3f}" if ratio else "",
                           ("met" if ratio <= 1.05 else "missed") + " (<= 1.05)" if ratio else ""]))
        groups.append(f"{r['context']:,} tokens, {mode}")
        unsigned_ms.append(plain["ttft_ms_p50"] if plain else None)
        signed_ms.append(r["ttft_ms_p50"])
    chart = svgchart.bars(groups, {"unsigned hit": unsigned_ms, "signed hit": signed_ms},
                          title="Time to first token of a hit, p50", ylabel="ms")
    if signed and "mac" not in d:  # runs before the bench recorded its MAC: trailer version 1
        table += ["", "This run predates AES-256-GMAC: its signed pod used trailer version 1's keyed BLAKE3 MAC "
                      "(40 bytes a block: the signed rows' bytes)."]
    return table, chart


_STORE_OPS = {"get": "fetch", "get_reader": "fetch, reader thread", "get_landing": "fetch into one buffer",
              "put": "store", "put_nobudget": "store, budget off"}
_MAC_OPS = {"mac_seal": "MAC: seal", "mac_open": "MAC: open"}


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 1024} KiB"


def _store(d: dict[str, Any]) -> tuple[Table, str]:
    rows = d["rows"]
    sizes = sorted({r["block_bytes"] for r in rows})
    cell = {(r["block_bytes"], r["op"]): r for r in rows}
    ops = [op for op in _STORE_OPS if any((s, op) in cell for s in sizes)]
    macs = [op for op in _MAC_OPS if any((s, op) in cell for s in sizes)]
    table = [_row(["block"] + [f"{_STORE_OPS[op]} MB/s (vs raw)" for op in ops]
                  + [f"{_MAC_OPS[op]} ms per GB" for op in macs]), "|---:|" + "---:|" * (len(ops) + len(macs))]
    for s in sizes:
        cells = [_size(s)]
        for op in ops:
            r = cell.get((s, op))
            cells.append(f"{r['kvstash_mb_s']:,.0f} ({r['ratio']:.2f})" if r else "")
        for op in macs:
            r = cell.get((s, op))
            cells.append(f"{r['ms_per_gb']:,.0f}" if r else "")
        table.append(_row(cells))
    series = {_STORE_OPS[op]: [cell[(s, op)]["kvstash_mb_s"] for s in sizes] for op in ops}
    series["raw redis-py GET"] = [cell[(s, "get")]["raw_mb_s"] for s in sizes]
    series["raw redis-py SET"] = [cell[(s, "put")]["raw_mb_s"] for s in sizes]
    chart = svgchart.lines([_size(s) for s in sizes], series, title="Throughput by block size",
                           xlabel="block size", ylabel="MB/s")
    return table, chart


def _quality(d: dict[str, Any]) -> tuple[Table, str]:
    rows = d["rows"]
    greedy = d.get("greedy", "")
    size = d.get("size_tokens", 2048)
    mid = size + d.get("block_tokens", 64) // 2
    table = [f"| text | codec | windows | x fewer bytes than fp16 ({size:,} / {mid:,} tokens) | perplexity | "
             f"change % [95% interval] | top-1 agree | greedy tokens equal (of {greedy}): min / median / mean |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(_row([r["text"], f"`{r['spec']}`" + (WITHHELD if withheld(r) else ""),
                           str(r["windows"]),
                           f"{r['ratio_vs_fp16_ctx']:.2f} / {r.get('ratio_vs_fp16_mid', r['ratio_vs_fp16_ctx']):.2f}",
                           f"{r['ppl']:.2f}",
                           f"{r['ppl_delta_pct']:+.2f} [{r['ppl_delta_lo']:+.2f}, {r['ppl_delta_hi']:+.2f}]",
                           f"{r['top1_agree']:.3f}",
                           f"{r['greedy_match_min']} / {r['greedy_match_median']:.1f} / {r['greedy_match_mean']:.1f}"]))
    texts = list(dict.fromkeys(r["text"] for r in rows))
    modes = [m for m in dict.fromkeys(row_name(r) for r in rows) if m != "exact"]
    series = {m: [next((max(r["ppl_delta_hi"], 1e-3) for r in rows if r["text"] == t and row_name(r) == m), None)
                  for t in texts] for m in modes}
    chart = svgchart.bars(texts, series, title="Perplexity change, upper end of the 95% interval",
                          ylabel="% (log scale)", log=True)
    return table, chart


def _budget(d: dict[str, Any]) -> tuple[Table, str]:
    """Each eviction policy's hit rate beside the offline optimum's, by workload and budget ratio."""
    rows = d["rows"]
    table = ["| workload | working set / budget | policy | hit rate | optimum (Belady) | of the optimum | "
             "dead bytes / budget | evictions | Lua us a write |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(_row([r["workload"], f"{r['budget_ratio']:g}",
                           f"`{r['policy']}`" + (" (default)" if r["default"] else ""), f"{r['hit_rate']:.3f}",
                           f"{r['optimum_hit_rate']:.3f}", f"{r['vs_optimum']:.3f}", f"{r['dead_fraction']:.3f}",
                           f"{r['evictions']:,}", f"{r['lua_us_per_write']:,.0f}"]))
    groups = list(dict.fromkeys(f"{r['workload']} x{r['budget_ratio']:g}" for r in rows))
    cell = {(f"{r['workload']} x{r['budget_ratio']:g}", r["policy"]): r for r in rows}
    series: dict[str, list[float | None]] = {"optimum (Belady)": [
        next(r["optimum_hit_rate"] for r in rows if f"{r['workload']} x{r['budget_ratio']:g}" == g) for g in groups]}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        series[policy] = [cell[(g, policy)]["hit_rate"] if (g, policy) in cell else None for g in groups]
    return table, svgchart.bars(groups, series, title="Hit rate by eviction policy", ylabel="hit rate")


def _fleet_reports(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Each engine's report in a fleet JSON (one merged per engine by `bench fleet --merge`, or a single one)."""
    return list(d.get("engines", [d]))


def _met(t: dict[str, Any] | None) -> str:
    return "" if t is None else "met" if t["met"] else "missed"


def _base_run(r: dict[str, Any]) -> str:
    """How long the lowest rate ran (its TTFT p90 is every rate's baseline), where it ran longer than the rest."""
    runs, duration = r.get("runs") or [], r.get("args", {}).get("duration_s", 0)
    base = min(runs, key=lambda run: run["rate"]) if runs else {}
    seconds = base.get("duration_s", duration)
    return f" ({seconds:g} s at the lowest rate: its p90 is the baseline)" if seconds > duration else ""


def _fleet_summary(r: dict[str, Any]) -> list[str]:
    args, cal, targets = r.get("args", {}), r.get("calibration"), r.get("targets", {})
    knees = ", ".join(f"{_FLEET_NAMES.get(k, k)} {v:g}/s" for k, v in r["knees"].items())
    load = (r.get("machine_before") or {}).get("loadavg")
    under = f" (load average {load[0]:.1f} at the start)" if load else ""
    lines = [f"**{r.get('engine', args.get('engine', '?'))}**{under}: {args.get('pods', '?')} pods, "
             f"{r.get('threads_per_pod', '?')} thread(s) each, {args.get('parallel', '?')} sequences decoded together"
             f"{_flash(args)}, "
             f"{args.get('users', '?')} users, ~{args.get('system_tokens', '?')} + ~{args.get('history_tokens', '?')}"
             f" token openings, replies of at most {args.get('max_tokens', '?')} tokens, "
             f"{args.get('duration_s', 0):g} s per rate{_base_run(r)}. "
             f"Knee: {knees}."]
    if cal is not None:
        lines[-1] += (f" Bound (the fleet idle, {cal['prompt_tokens']:,} tokens): ({_ms(cal['prefill_ms'])} + "
                      f"{_ms(cal['decode_ms'])}) / ({_ms(cal['hit_ms'])} + {_ms(cal['decode_ms'])}) ms = "
                      f"{cal['bound']:.2f}x.")
    kb, gain, failed = targets.get("knee_vs_bound"), targets.get("p90_gain_at_off_knee"), targets.get(
        "no_failed_requests")
    found = []
    if kb is not None:
        found.append(f"kvstash knee {kb['value']:g}/s against 0.8 x bound x no-cache knee = {kb['target']:.3g}/s "
                     f"({_met(kb)})")
    if gain is not None:
        found.append(f"TTFT p90 at the no-cache knee {gain['value']:.1f}x lower (target 10x, {_met(gain)})")
    if failed is not None:
        found.append(f"{failed['value']} failed requests ({_met(failed)})")
    if found:
        lines[-1] += " Targets: " + "; ".join(found) + "."
    return lines


def _flash(args: dict[str, Any]) -> str:
    """How a llama.cpp fleet's pods ran flash attention, where the run set it."""
    setting = args.get("flash_attn", "auto")
    return "" if setting == "auto" else f", flash attention {setting}"


_FLEET_NAMES = {"kvstash": "kvstash", "off": "no cache", "sticky": "sticky sessions"}


def _fleet(d: dict[str, Any]) -> tuple[Table, str]:
    table: Table = []
    series: dict[str, list[float | None]] = {}
    reports = _fleet_reports(d)
    rates = sorted({run["rate"] for r in reports for run in r["runs"]})
    for r in reports:
        table += [*_fleet_summary(r), "",
                  "| fleet | rate/s | ok / failed | TTFT p50 ms | p90 ms | p99 ms | ITL p50 ms | reply tok/s | "
                  "hit rate | keeps up |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for run in r["runs"]:
            table.append(_row([run.get("fleet", run["kind"]), f"{run['rate']:g}", f"{run['ok']} / {run['failed']}",
                               _ms(run["ttft_ms_p50"]), _ms(run["ttft_ms_p90"]), _ms(run["ttft_ms_p99"]),
                               f"{run['itl_ms_p50']:.1f}", f"{run['completion_tokens_per_s']:.1f}",
                               f"{run['hit_rate']:.2f}", "yes" if run.get("keeps_up") else "no"]))
        table.append("")
        engine = r.get("engine", "?")
        for kind in dict.fromkeys(run["kind"] for run in r["runs"]):
            series[f"{engine}, {_FLEET_NAMES.get(kind, kind)}"] = [
                next((run["ttft_ms_p90"] for run in r["runs"] if run["kind"] == kind and run["rate"] == x), None)
                for x in rates]
        table += _fleet_pressure(r)
    chart = svgchart.lines([f"{x:g}" for x in rates], series, title="TTFT p90 by arrival rate",
                           xlabel="arrivals per second", ylabel="ms (log scale)", log=True)
    return table[:-1] if table and not table[-1] else table, chart


def _fleet_pressure(r: dict[str, Any]) -> Table:
    """The budget-pressure and miss-overhead tables of one engine's report (none where it ran neither)."""
    out: Table = []
    engine = r.get("engine", "?")
    if r.get("budget_pressure"):
        own = r.get("budget_run")
        out += [f"Budget pressure ({engine}, kvstash; optimum: Belady's policy on the run's own recorded trace"
                + (f"; a run of its own, {machine_line(own)}, {own['args'].get('users', '?')} users at "
                   f"{own['args'].get('budget_rate') or own['args'].get('rates') or '?'} turns/s, "
                   f"{r['budget_pressure'][0].get('arrivals', '?')} measured turns a run" if own else "") + "):", "",
                "| run | policy | budget MiB | working set / budget | hit rate | optimum | TTFT p50 ms | p90 ms | "
                "failed |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for b in sorted(r["budget_pressure"], key=lambda b: (b["ratio"], b.get("policy", "lru"))):
            best = b.get("optimum_hit_rate")
            out.append(_row([b["fleet"], b.get("policy", "lru"), f"{b['budget_mb']}", f"{b['ratio']:.2f}",
                             f"{b['hit_rate']:.2f}", "" if best is None else f"{best:.2f}", _ms(b["ttft_ms_p50"]),
                             _ms(b["ttft_ms_p90"]), f"{b['failed']}"]))
        out.append("")
    if r.get("miss_overhead"):
        on = r["miss_overhead"][0]
        out += [f"Miss overhead ({engine}, a workload with no reuse; kvstash on / off: TTFT p50 "
                f"{on.get('ttft_ms_p50_vs_off', 0):.3f}, p90 {on.get('ttft_ms_p90_vs_off', 0):.3f}, reply tokens/s "
                f"{on.get('completion_tokens_per_s_vs_off', 0):.3f}; target within 3%):", "",
                "| run | runs | ok / failed | TTFT p50 ms | p90 ms | reply tok/s | hit rate |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for m in r["miss_overhead"]:
            out.append(_row([m["fleet"], f"{m.get('runs', 1)}", f"{m['ok']} / {m['failed']}", _ms(m["ttft_ms_p50"]),
                             _ms(m["ttft_ms_p90"]), f"{m['completion_tokens_per_s']:.2f}", f"{m['hit_rate']:.2f}"]))
        out.append("")
    return out


def _fleet_budget_charts(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Hit rate and TTFT p50 against working set / budget, a line per engine that ran budget pressure."""
    pressed = [r for r in _fleet_reports(d) if r.get("budget_pressure")]
    if not pressed:
        return []
    ratios = sorted({round(b["ratio"], 2) for r in pressed for b in r["budget_pressure"]})

    def line(r: dict[str, Any], key: str, scale: float, policy: str | None) -> list[float | None]:
        # the run with no pressure evicts nothing: it starts every policy's line
        by = {round(b["ratio"], 2): b[key] * scale for b in r["budget_pressure"] if b.get(key) is not None and (
            policy is None or b.get("policy", "lru") == policy or b["fleet"] == "no pressure")}
        return [by.get(x) for x in ratios]

    def series(key: str, scale: float) -> dict[str, list[float | None]]:
        out: dict[str, list[float | None]] = {}
        for r in pressed:
            for policy in dict.fromkeys(b.get("policy", "lru") for b in r["budget_pressure"]):
                out[f"{r.get('engine', '?')}, {policy}"] = line(r, key, scale, policy)
            if key == "hit_rate" and any("optimum_hit_rate" in b for b in r["budget_pressure"]):
                out[f"{r.get('engine', '?')}, optimum"] = line(r, "optimum_hit_rate", scale, None)
        return out

    labels = [f"{x:g}x" for x in ratios]
    hits = svgchart.lines(labels, series("hit_rate", 100.0), title="Hit rate under budget pressure, by policy",
                          xlabel="working set / byte budget", ylabel="cached / prompt tokens, %")
    ttft = svgchart.lines(labels, series("ttft_ms_p50", 1.0), title="TTFT p50 under budget pressure, by policy",
                          xlabel="working set / byte budget", ylabel="ms (log scale)", log=True)
    return [("budget-hits", "Hit rate under budget pressure", hits),
            ("budget-ttft", "TTFT under budget pressure", ttft)]


_SIDECAR_NAMES = {"cold-direct": "cold, llama-server directly", "cold-sidecar": "cold, through the sidecar",
                  "resumed-prefill": "next turn, llama-server prefills it all",
                  "resumed-kept": "next turn, llama-server kept the slot",
                  "resumed-sidecar": "next turn on a second sidecar, KV from Redis"}


def _sidecar(d: dict[str, Any]) -> tuple[Table, str]:
    table = ["| request | prompt tokens | TTFT p50 ms | p90 ms | tokens processed | from Redis | vs direct | "
             "vs full prefill |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        table.append(_row([_SIDECAR_NAMES.get(r["method"], r["method"]), f"{r['prompt_tokens']:,}",
                           _ms(r["ttft_ms_p50"]), _ms(r["ttft_ms_p90"]), f"{r['processed_p50']:,.0f}",
                           f"{r['cached_tokens_p50']:,.0f}", _x(r["vs_direct"]) if r["vs_direct"] else "",
                           _x(r["speedup"]) if r["speedup"] else ""]))
    names = [_SIDECAR_NAMES.get(r["method"], r["method"]).split(", ")[-1] for r in d["rows"]]
    chart = svgchart.bars(names, {"TTFT p50": [r["ttft_ms_p50"] for r in d["rows"]]},
                          title="The sidecar against llama-server, 2,048-token prompt", ylabel="ms (log scale)",
                          log=True)
    return table, chart
