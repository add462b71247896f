"""Issue 37's held-out run was two `bench quality` processes side by side (alice + difflib.py; twelfthnight +
froschkoenig): print their rows as one table, its markdown for docs/fidelity.md, and one chart.

    PYTHONPATH=. .venv/bin/python docs/fidelity-runs/quality_fidelity_merge.py \
        docs/fidelity-runs/quality-fidelity-heldout-v2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ops.bench.common import plot_pareto, print_table
from ops.bench.quality import pareto_intervals, pareto_points

HERE = Path(__file__).parent


def pct(v: float) -> str:
    return (f"{v:+.3f}%" if abs(v) < 1 else f"{v:+.2f}%").replace("-", "−")


def main() -> None:
    runs = [json.loads((HERE / f"quality-fidelity-heldout-v2-{p}.json").read_text()) for p in "ab"]
    rows = [r for run in runs for r in run["rows"]]
    print_table(rows, [("text", "text", ""), ("spec", "codec", ""), ("windows", "n", "d"), ("ppl", "ppl", ".4f"),
                       ("ppl_delta_pct", "ppl Δ %", "+.3f"), ("ppl_delta_lo", "lo", "+.3f"),
                       ("ppl_delta_hi", "hi", "+.3f"), ("top1_agree", "top-1", ".4f"), ("kl_mean", "KL", ".2e"),
                       ("greedy_match_min", "g min", "d"), ("greedy_match_p10", "p10", ".1f"),
                       ("greedy_match_median", "med", ".1f"), ("greedy_match_mean", "mean", ".1f"),
                       ("bytes_per_token_ctx", "B/token", ",.0f"), ("ratio_vs_fp16_ctx", "x fp16", ".2f")])
    for run in runs:
        for name, t in run["targets"].items():
            if name != "greedy":
                print(f"target {name}: {t['ppl_delta_pct']:+.3f}% (hi {t['ppl_delta_hi']:+.3f}%, |Δ| <= "
                      f"{t['ppl_target']}%), {t['ratio_vs_fp16']:.2f}x fp16 (>= {t['ratio_target']}) "
                      f"{'met' if t['met'] else 'MISSED'}")
    print("\n| text | codec | windows | ppl change (95% interval) | upper end | greedy of 16: min / p10 / median / "
          "mean | B/token | x fp16 |\n|---|---|---:|---|---:|---|---:|---:|")
    for r in rows:
        if r["mode"] != "exact":
            print(f"| {r['text']} | `{r['mode']}` | {r['windows']} | {pct(r['ppl_delta_pct'])} "
                  f"({pct(r['ppl_delta_lo'])} … {pct(r['ppl_delta_hi'])}) | {pct(r['ppl_delta_hi'])} | "
                  f"{r['greedy_match_min']} / {r['greedy_match_p10']:.1f} / {r['greedy_match_median']:.1f} / "
                  f"{r['greedy_match_mean']:.1f} | {r['bytes_per_token_ctx']:,.0f} | {r['ratio_vs_fp16_ctx']:.2f} |")
    if len(sys.argv) > 1:
        plot_pareto(sys.argv[1] + ".png", pareto_points(rows),
                    title="Perplexity change vs size (hf smollm2; bars: 95% interval over 24 windows)",
                    xlabel="bytes per token of a 2048-token context (log)",
                    ylabel="perplexity change vs exact, % (symmetric log)", intervals=pareto_intervals(rows))


if __name__ == "__main__":
    main()
