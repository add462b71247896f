"""Hit TTFT p50 and p90 with glibc's malloc defaults (KVSTASH_MALLOC_ARENAS=0) and with one arena (the default
now), two interleaved runs each: resume-wave5-arenas{0,1}-run{1,2}.json -> resume-wave5.png.

Run: PYTHONPATH=. .venv/bin/python docs/benchmarks/resume_wave5_plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench.common import plot_bars

HERE = Path(__file__).parent


def hits(name: str) -> dict[str, float]:
    rows = json.loads((HERE / name).read_text())["rows"]
    return {f"{r['method'].removeprefix('kvstash-')}\n{r['context']}\n{q}": r[f"ttft_ms_{q}"] for r in rows
            if r["method"].startswith("kvstash-") for q in ("p50", "p90")}


def main() -> None:
    runs = {f"{'glibc defaults' if a == 0 else 'one arena'} run {n}": hits(f"resume-wave5-arenas{a}-run{n}.json")
            for a in (0, 1) for n in (1, 2)}
    labels = list(next(iter(runs.values())))
    plot_bars(HERE / "resume-wave5.png", labels, {k: [v[lab] for lab in labels] for k, v in runs.items()},
              title="hf hit TTFT (ms): glibc malloc defaults vs one arena", ylabel="ms")


if __name__ == "__main__":
    main()
