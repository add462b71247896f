"""Helpers shared by the benchmarks: timing, percentiles, tables, JSON, PNG plots and machine facts."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

SAMPLE_TEXT = Path(__file__).resolve().parent.parent / "data" / "sample.txt"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank of the sorted values; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    return float(xs[min(len(xs) - 1, round(q * (len(xs) - 1)))])


def median_s(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of `fn` over `repeat` runs, after one untimed warm-up run."""
    fn()  # warm up: allocator, lazy imports
    times = []
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """Print rows as an aligned table; columns are (key, heading, format spec such as '.1f')."""
    cells = [[format(r.get(key, ""), spec) if r.get(key) is not None else "-" for key, _, spec in columns]
             for r in rows]
    widths = [max([len(head)] + [len(c[i]) for c in cells]) for i, (_, head, _) in enumerate(columns)]
    line = "  ".join(head.rjust(w) for (_, head, _), w in zip(columns, widths, strict=True))
    print(line)
    print("-" * len(line))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def machine() -> dict[str, Any]:
    """Where and when a benchmark ran: cores, CPU model (with its widest SIMD, which llama.cpp's and the native
    kernels' speed follows), RAM, the load average and the UTC date at call time."""
    cpu, flags = platform.processor() or "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    cpu = f"{cpu} ({simd})" if simd else cpu
    ram_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gb = int(line.split()[1]) / 1024 / 1024
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"nproc": os.cpu_count(), "cpu": cpu, "ram_gb": round(ram_gb, 1),
            "loadavg": [round(x, 2) for x in load], "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def write_json(path: Path | str, payload: Any) -> None:
    """Write `payload` as indented JSON, creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")


def _save(fig: Any, path: Path | str) -> None:
    """Legend, layout, write the figure as PNG (creating parent folders) and free it."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    if fig.axes[0].get_legend() is None:
        fig.axes[0].legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    print(f"wrote {out}")


def plot_lines(path: Path | str, series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, title: str,
               xlabel: str, ylabel: str, logx: bool = False, logy: bool = False) -> None:
    """One PNG line plot: {label: (xs, ys)} drawn with markers (matplotlib, Agg backend)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    _save(fig, path)


def pareto_frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """The labels of {label: (size, loss)} that no smaller point beats on |loss|, smallest first."""
    frontier, best = [], float("inf")
    for label, (_, y) in sorted(points.items(), key=lambda kv: (kv[1][0], abs(kv[1][1]))):
        if abs(y) < best:
            frontier.append(label)
            best = abs(y)
    return frontier


def plot_pareto(path: Path | str, points: dict[str, tuple[float, float]], *, title: str, xlabel: str,
                ylabel: str, intervals: dict[str, tuple[float, float]] | None = None) -> None:
    """A PNG scatter of {label: (size, loss)}, each point named, the frontier (no other point both smaller and
    closer to 0) joined by a line; x log2, y symmetric-log so losses of 0.1% and 10% both read. `intervals`:
    {label: (low, high)} of the loss, drawn as a vertical bar through the point."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(12, 6), dpi=100)
    items = sorted(points.items(), key=lambda kv: (kv[1][0], abs(kv[1][1])))
    best = pareto_frontier(points)
    frontier = [points[label] for label in best]
    for i, (label, (x, y)) in enumerate(items, 1):  # numbered at the point, named in the legend
        on = label in best
        color = "tab:red" if on else "tab:blue"
        span = (intervals or {}).get(label)
        if span is not None:
            ax.errorbar([x], [y], yerr=[[max(y - span[0], 0.0)], [max(span[1] - y, 0.0)]], fmt="none",
                        ecolor=color, elinewidth=1, capsize=3, alpha=0.7, zorder=2)
        interval = f" [{span[0]:+.2f}, {span[1]:+.2f}]" if span is not None else ""
        ax.scatter([x], [y], s=40, color=color, zorder=3, label=f"{i}: {label} ({y:+.2f}%{interval})")
        ax.annotate(str(i), (x, y), xytext=(-4 + 8 * (i % 3), 6 if i % 2 else -12), textcoords="offset points",
                    fontsize=8)
    fx, fy = zip(*sorted(frontier), strict=True)
    ax.plot(fx, fy, color="tab:red", alpha=0.5, label="red, joined: nothing smaller loses less")
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=0.1)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0)
    _save(fig, path)


def plot_bars(path: Path | str, labels: Sequence[str], groups: Mapping[str, Sequence[float]], *, title: str,
              ylabel: str, logy: bool = False) -> None:
    """One PNG grouped bar chart: for each label a bar per group ({group: values by label})."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    width = 0.8 / max(1, len(groups))
    for i, (name, values) in enumerate(groups.items()):
        ax.bar([x + i * width for x in range(len(labels))], list(values), width, label=name)
    ax.set_xticks([x + width * (len(groups) - 1) / 2 for x in range(len(labels))], list(labels))
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=min(4, len(groups)))  # below: bars fill the top
    _save(fig, path)
