"""Ratio of each hit to its floor, before (162aa68: chunks read on the event loop) and after (a reader thread with a
blocking client), two interleaved runs each: resume-wave4*.json -> resume-wave4.png.

Run: PYTHONPATH=. .venv/bin/python docs/benchmarks/resume_wave4_plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench.common import plot_bars

HERE = Path(__file__).parent


def ratios(name: str) -> dict[str, float]:
    rows = json.loads((HERE / name).read_text())["rows"]
    return {f"{r['method'].removeprefix('kvstash-')} {r['context']}": r["ratio_to_floor"] for r in rows
            if r["method"].startswith("kvstash-")}


def main() -> None:
    runs = {f"{side} run {n}": ratios(f"resume-wave4{'-before' if side == 'before' else ''}-run{n}.json")
            for side in ("before", "after") for n in (1, 2)}
    labels = list(next(iter(runs.values())))
    plot_bars(HERE / "resume-wave4.png", labels, {k: [v[lab] for lab in labels] for k, v in runs.items()},
              title="hf hit / floor (1.0 = a raw GET of the same frames + the forward step)", ylabel="ratio to floor")


if __name__ == "__main__":
    main()
