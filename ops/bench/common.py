"""Helpers shared by the benchmarks: timing, percentiles, tables, JSON, charts and machine facts."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cachestore.errors import ConfigError

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


def status_bytes(field: str) -> int | None:
    """A size line of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is none (not Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    line = next((x for x in lines if x.startswith(field + ":")), None)
    return int(line.split()[1]) * 1024 if line is not None else None


def reset_peak() -> int | None:
    """Set the process's peak resident size (VmHWM) to what it holds now (Linux's clear_refs 5); that size, or None
    where the peak cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return status_bytes("VmRSS")


def kv_bytes(kv: Any, context: int) -> int:
    """Bytes of `context` tokens of a KV array [L, 2, H, n, D] in its own dtype (numpy or torch)."""
    one = kv[:, :, :, :1]
    return int(one.nbytes if hasattr(one, "nbytes") else one.numel() * one.element_size()) * context


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


def check_chart(path: Path | None) -> None:
    """Refuse a `--plot` file not named .svg before a bench starts (one line, exit 2): the charts are
    ops/svgchart.py's SVG, and a .png path would otherwise hold SVG after a long run."""
    if path is not None and path.suffix.lower() != ".svg":
        raise ConfigError(f"--plot writes an SVG chart: name a .svg file, not {str(path)!r}")


def write_chart(path: Path | str, svg: str) -> None:
    """Write one chart (ops/svgchart.py's text), creating parent folders."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(svg)
    print(f"wrote {out}")


def pareto_frontier(points: dict[str, tuple[float, float]]) -> list[str]:
    """The labels of {label: (size, loss)} that no smaller point beats on |loss|, smallest first."""
    frontier, best = [], float("inf")
    for label, (_, y) in sorted(points.items(), key=lambda kv: (kv[1][0], abs(kv[1][1]))):
        if abs(y) < best:
            frontier.append(label)
            best = abs(y)
    return frontier
