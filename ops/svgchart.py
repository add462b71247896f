"""Small SVG charts written as text: grouped bars and lines, the same bytes for the same data on any machine.

The results page (ops/resultspage.py) draws its charts with these so that a test can tell a stale chart from a
fresh one byte for byte; matplotlib's output varies with its version and fonts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

WIDTH, HEIGHT = 780, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 250, 40, 50  # margins; the legend sits in the right one
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def _num(x: float) -> str:
    """A coordinate with one decimal: short and the same on every platform."""
    return f"{x:.1f}"


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:g}"
    return f"{v:.2g}"


class _Scale:
    """Value -> y pixel, linear from 0 (or the minimum) or log10, with its tick values."""

    def __init__(self, values: Sequence[float], log: bool) -> None:
        self.log = log
        vals = [v for v in values if v > 0] if log else list(values)
        hi = max(vals) if vals else 1.0
        lo = min(vals) if vals else 0.0
        if log:
            self.lo, self.hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
            if self.lo == self.hi:
                self.hi *= 10
            self.ticks = [10.0 ** e for e in range(round(math.log10(self.lo)), round(math.log10(self.hi)) + 1)]
        else:
            self.lo = min(0.0, lo)
            step = 10 ** math.floor(math.log10(max(hi - self.lo, 1e-9)))
            for mult in (1, 2, 5, 10):
                if (hi - self.lo) / (step * mult) <= 6:
                    step *= mult
                    break
            self.hi = math.ceil(hi / step) * step or step
            n = round((self.hi - self.lo) / step)
            self.ticks = [self.lo + i * step for i in range(n + 1)]

    def y(self, v: float) -> float:
        top, bottom = TOP, HEIGHT - BOTTOM
        if self.log:
            frac = (math.log10(max(v, self.lo)) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            frac = (v - self.lo) / (self.hi - self.lo)
        return bottom - frac * (bottom - top)


def _frame(title: str, ylabel: str, scale: _Scale) -> list[str]:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
           f'height="{HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2 - RIGHT / 2:.0f}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<text transform="translate(16,{(TOP + HEIGHT - BOTTOM) / 2:.0f}) rotate(-90)" '
           f'text-anchor="middle">{escape(ylabel)}</text>']
    for t in scale.ticks:
        y = _num(scale.y(t))
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y}" text-anchor="end" dominant-baseline="middle">{_label(t)}</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#333"/>')
    return out


def _legend(names: Sequence[str]) -> list[str]:
    out = []
    for i, name in enumerate(names):
        y = TOP + 8 + i * 20
        color = COLORS[i % len(COLORS)]
        out.append(f'<rect x="{WIDTH - RIGHT + 14}" y="{y - 9}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{WIDTH - RIGHT + 32}" y="{y + 1}">{escape(name)}</text>')
    return out


def bars(groups: Sequence[str], series: Mapping[str, Sequence[float | None]], *, title: str, ylabel: str,
         log: bool = False) -> str:
    """Grouped bars: one group per `groups` entry, one bar per series in it (None leaves a gap)."""
    values = [v for vs in series.values() for v in vs if v is not None]
    scale = _Scale(values, log)
    out = _frame(title, ylabel, scale)
    plot_w = WIDTH - LEFT - RIGHT
    group_w = plot_w / max(1, len(groups))
    bar_w = group_w * 0.8 / max(1, len(series))
    base = scale.y(scale.lo if log else max(scale.lo, 0.0))
    for g, group in enumerate(groups):
        x0 = LEFT + g * group_w + group_w * 0.1
        for s, vs in enumerate(series.values()):
            v = vs[g]
            if v is None:
                continue
            y = scale.y(v)
            top, height = min(y, base), abs(base - y)
            out.append(f'<rect x="{_num(x0 + s * bar_w)}" y="{_num(top)}" width="{_num(bar_w * 0.92)}" '
                       f'height="{_num(height)}" fill="{COLORS[s % len(COLORS)]}"><title>{escape(group)}, '
                       f'{escape(list(series)[s])}: {_label(v)}</title></rect>')
        out.append(f'<text x="{_num(LEFT + (g + 0.5) * group_w)}" y="{HEIGHT - BOTTOM + 18}" '
                   f'text-anchor="middle">{escape(group)}</text>')
    out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_num(base)}" y2="{_num(base)}" stroke="#333"/>')
    return "\n".join(out + _legend(list(series)) + ["</svg>"]) + "\n"


def lines(xlabels: Sequence[str], series: Mapping[str, Sequence[float | None]], *, title: str, xlabel: str,
          ylabel: str, log: bool = False) -> str:
    """Lines with markers over evenly spaced x positions named by `xlabels` (None: no point there)."""
    scale = _Scale([v for vs in series.values() for v in vs if v is not None], log)
    out = _frame(title, ylabel, scale)
    plot_w = WIDTH - LEFT - RIGHT
    step = plot_w / max(1, len(xlabels))
    xs = [LEFT + (i + 0.5) * step for i in range(len(xlabels))]
    for x, name in zip(xs, xlabels, strict=True):
        out.append(f'<text x="{_num(x)}" y="{HEIGHT - BOTTOM + 18}" text-anchor="middle">{escape(name)}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 12}" text-anchor="middle">'
               f'{escape(xlabel)}</text>')
    for s, (name, vs) in enumerate(series.items()):
        color = COLORS[s % len(COLORS)]
        present = [(x, v) for x, v in zip(xs, vs, strict=True) if v is not None]
        points = " ".join(f"{_num(x)},{_num(scale.y(v))}" for x, v in present)
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, v in present:
            out.append(f'<circle cx="{_num(x)}" cy="{_num(scale.y(v))}" r="3.5" fill="{color}">'
                       f'<title>{escape(name)}: {_label(v)}</title></circle>')
    out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{HEIGHT - BOTTOM}" y2="{HEIGHT - BOTTOM}" stroke="#333"/>')
    return "\n".join(out + _legend(list(series)) + ["</svg>"]) + "\n"
