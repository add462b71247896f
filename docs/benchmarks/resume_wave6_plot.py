"""Each hit's ratio to its floor (p50 / p50) before this wave's change (15fd1ae) and after it, two alternating runs
each: resume-wave6-{before,after}-run{1,2}.json -> resume-wave6.png. Targets: 1.15 (fp16, int8), 1.25 (int4).

Run: PYTHONPATH=. .venv/bin/python docs/benchmarks/resume_wave6_plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench.common import plot_bars

HERE = Path(__file__).parent


def ratios(name: str) -> dict[str, float]:
    rows = json.loads((HERE / name).read_text())["rows"]
    return {f"{r['method'].removeprefix('kvstash-')}\n{r['context']}": r["ratio_to_floor"] for r in rows
            if r["method"].startswith("kvstash-") and r["ratio_to_floor"] is not None}


def main() -> None:
    runs = {f"{side} run {n}": ratios(f"resume-wave6-{side}-run{n}.json")
            for side in ("before", "after") for n in (1, 2)}
    labels = list(next(iter(runs.values())))
    plot_bars(HERE / "resume-wave6.png", labels, {k: [v[lab] for lab in labels] for k, v in runs.items()},
              title="hf hit / floor (p50), targets 1.15 (fp16, int8) and 1.25 (int4)", ylabel="hit / floor")


if __name__ == "__main__":
    main()
