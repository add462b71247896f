"""Each hit's ratio to its floor (p50 / p50) before a wave's change and after it, alternating runs:
resume-waveN-{before,after}-run{1,2,...}.json -> resume-waveN.png. Targets: 1.15 (fp16, int8), 1.25 (int4).
Wave 6 (section 12): before 15fd1ae, after 4d78c65. Wave 7 (section 13): before 6dab61d, after 53dd95a.
Wave 8 (section 14): the native kernels off and on (KVSTASH_NATIVE_KERNELS), at 048fe55; "8" is hf,
"8-llamacpp" llama.cpp in the pod. Wave 9 (section 15): before d816347, after the first step's scratch (runs 1-2
at 7d2b39b, 3-4 at fa1432f; the same hit path). Wave 10 (section 16): before deef57c, after the first step's
attention over the landed codes (c48f3fb). Wave 11 (section 17): llama.cpp in the pod, before 7589bc0, after its
hits' token rows are received into the sequence state (9c342ad); "11-llamacpp" fp16 and int8, "11-exact" exact.
Wave 12 (section 18): llama.cpp's q8_0 cache and codec q8, before 81cfa32, after a0b4fa1 and the
bench's fixes for it (818666d); "12-llamacpp" the ratios
of fp16 and int8 (q8 exists after only), "12-ms" every after run's hit and floor in ms, q8 included.
Wave 13 (section 19): the sidecar beside llama-server, before fe4ea80, after 8ac8199 (its hits land in the slot
file's state); "13-sidecar" every run's hit p50 in ms (its floor changed with it: ratios compare two floors).
Wave 14 (section 20): int8 streamed into the llama.cpp state, before b91f278, after 7610d2a; "14-llamacpp" and
"14-llama-server" (the sidecar) the ratios. Wave 15 (section 21): the native RESP reader, before c5cb5ae, after
75451ea; "15-llamacpp" the ratios (an AMD Zen 5 VM). Wave 16 (section 22): "16-fa" the llamacpp engine's hit and
floor in ms with llama.cpp's flash attention auto (on) and off, back to back at 9d3db79 (-llamacpp-fa-{auto,off}-run3),
an Intel VM. Wave 17 (section 23): int8 into the llama.cpp state by runs of frames, four at a time, the tail shared
with a second thread and a finer-grained streaming kernel, before e4b8cf7, after 918e634 (runs 0-2, pair 1) and
69a876d (run 3, pairs 5-7: the same path for a lookup alone); "17-llamacpp" the ratios at 2048 and 8128 (--long),
"17-llamacpp-2048" four pairs at 2048 alone (those taken while the host stole up to 37% of the VM's CPU are apart,
-stolen-, and not drawn).

Run: PYTHONPATH=. .venv/bin/python docs/benchmarks/resume_floor_plot.py 7
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ops.bench.common import plot_bars

HERE = Path(__file__).parent


def ratios(path: Path) -> dict[str, float]:
    rows = json.loads(path.read_text())["rows"]
    return {f"{r['method'].removeprefix('kvstash-')}\n{r['context']}": r["ratio_to_floor"] for r in rows
            if r["method"].startswith("kvstash-") and r["ratio_to_floor"] is not None}


def milliseconds(wave: str) -> None:
    """Each after run's hit and floor p50 (ms) for every codec and context, side by side."""
    paths = sorted(HERE.glob(f"resume-wave{wave}-llamacpp-after-run*.json"))
    runs = [json.loads(path.read_text())["rows"] for path in paths]
    labels = [f"{r['method'].removeprefix('kvstash-')}\n{r['context']}" for r in runs[0]
              if r["method"].startswith("kvstash-")]
    groups = {}
    for n, rows in enumerate(runs, 1):
        p50 = {(r["method"], r["context"]): r["ttft_ms_p50"] for r in rows}
        for kind in ("kvstash", "floor"):
            groups[f"{'hit' if kind == 'kvstash' else 'floor'}, run {n}"] = [
                p50[(f"{kind}-{lab.split(chr(10))[0]}", int(lab.split(chr(10))[1]))] for lab in labels]
    plot_bars(HERE / f"resume-wave{wave}-ms.png", labels, groups, ylabel="TTFT p50, ms (log)", logy=True,
              title=f"llama.cpp hit and floor, wave {wave}: q8 over a q8_0 cache, fp16 and int8 over f16")


def hits(wave: str) -> None:
    """Each run's hit p50 (ms) for every codec and context, before and after: resume-waveW-{before,after}-run*.json
    (W = "13-sidecar") -> resume-waveW.png."""
    runs = {f"{side} run {path.stem.rsplit('run', 1)[1]}": json.loads(path.read_text())["rows"]
            for side in ("before", "after") for path in sorted(HERE.glob(f"resume-wave{wave}-{side}-run*.json"))}
    labels = sorted({f"{r['method'].removeprefix('kvstash-')}\n{r['context']}" for rows in runs.values() for r in rows
                     if r["method"].startswith("kvstash-")}, key=lambda lab: (int(lab.split()[-1]), lab))
    groups = {}
    for name, rows in runs.items():
        p50 = {f"{r['method'].removeprefix('kvstash-')}\n{r['context']}": r["ttft_ms_p50"] for r in rows}
        groups[name] = [p50.get(lab, float("nan")) for lab in labels]  # a run without that row: no bar
    plot_bars(HERE / f"resume-wave{wave}.png", labels, groups, ylabel="hit TTFT p50, ms (log)", logy=True,
              title=f"kvstash sidecar hit beside llama-server, wave {wave.split('-')[0]}: before / after")


def flash_attention(wave: str) -> None:
    """The llamacpp hit and floor p50 (ms) for every codec and context both runs have, flash attention auto
    (resume-waveW-llamacpp-fa-auto-run3.json) and off (-fa-off-run3.json) -> resume-waveW-fa.png."""
    runs = {side: {(r["method"], r["context"]): r["ttft_ms_p50"]
                   for r in json.loads((HERE / f"resume-wave{wave}-llamacpp-{name}.json").read_text())["rows"]}
            for side, name in (("auto", "fa-auto-run3"), ("off", "fa-off-run3"))}
    keys = sorted({k for k in runs["auto"] if k[0].startswith("kvstash-") and k in runs["off"]},
                  key=lambda k: (k[1], k[0]))
    labels = [f"{method.removeprefix('kvstash-')}\n{context}" for method, context in keys]
    groups = {f"{kind}, FA {side}": [runs[side][(method.replace("kvstash", kind), context)]
                                                  for method, context in keys]
              for side in ("auto", "off") for kind in ("kvstash", "floor")}
    groups = {name.replace("kvstash", "hit"): values for name, values in groups.items()}
    plot_bars(HERE / f"resume-wave{wave}-fa.png", labels, groups, ylabel="TTFT p50, ms (log)", logy=True,
              title=f"llama.cpp in the pod, wave {wave}: hit and floor, flash attention (FA) auto (on) and off")


def main(wave: str) -> None:
    runs = {f"{side} run {path.stem.rsplit('run', 1)[1]}": ratios(path)
            for side in ("before", "after") for path in sorted(HERE.glob(f"resume-wave{wave}-{side}-run*.json"))}
    labels = list(next(iter(runs.values())))
    first = next(HERE.glob(f"resume-wave{wave}-before-run*.json"))
    engine = json.loads(first.read_text()).get("engine", "hf")
    plot_bars(HERE / f"resume-wave{wave}.png", labels, {k: [v[lab] for lab in labels] for k, v in runs.items()},
              title=f"{engine} hit / floor (p50), wave {wave.split('-')[0]}; targets 1.15 (fp16, int8) and 1.25 (int4)",
              ylabel="hit / floor")


if __name__ == "__main__":
    arg = sys.argv[1] if len(sys.argv) > 1 else "6"
    if arg.endswith("-fa"):
        flash_attention(arg.split("-")[0])
    elif arg.endswith("-ms"):
        milliseconds(arg.split("-")[0])
    elif arg.endswith("-sidecar"):
        hits(arg)
    else:
        main(arg)
