"""Small SVG charts written as text: grouped bars, lines and named points, the same bytes for the same data on any
machine.

The one way kvstash draws a chart: the results page (ops/resultspage.py), so that a test can tell a stale chart from
a fresh one byte for byte, and the benches' `--plot`.
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

    def __init__(self, values: Sequence[float], log: bool, bottom: float = HEIGHT - BOTTOM) -> None:
        self.log, self.bottom = log, bottom
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
        top, bottom = TOP, self.bottom
        if self.log:
            frac = (math.log10(max(v, self.lo)) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            frac = (v - self.lo) / (self.hi - self.lo)
        return bottom - frac * (bottom - top)


def _frame(title: str, ylabel: str, scale: _Scale | _SymlogScale, width: int = WIDTH, height: int = HEIGHT,
           right: int = RIGHT) -> list[str]:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2 - right / 2:.0f}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<text transform="translate(16,{(TOP + height - BOTTOM) / 2:.0f}) rotate(-90)" '
           f'text-anchor="middle">{escape(ylabel)}</text>']
    for t in scale.ticks:
        y = _num(scale.y(t))
        out.append(f'<line x1="{LEFT}" x2="{width - right}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y}" text-anchor="end" dominant-baseline="middle">{_label(t)}</text>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{height - BOTTOM}" stroke="#333"/>')
    return out


def _legend(names: Sequence[str], colors: Sequence[str] = COLORS, x: int = WIDTH - RIGHT, step: int = 20,
            font: str = "") -> list[str]:
    out = []
    for i, name in enumerate(names):
        y = TOP + 8 + i * step
        color = colors[i % len(colors)]
        out.append(f'<rect x="{x + 14}" y="{y - 9}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 32}" y="{y + 1}"{font}>{escape(name)}</text>')
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


class _SymlogScale:
    """Value -> y pixel on a symmetric log: sign(v) log10(1 + |v| / linear), ticks at 0 and +-linear x 10^k."""

    def __init__(self, values: Sequence[float], linear: float, bottom: float) -> None:
        self.linear, self.bottom = linear, bottom

        def ticks(reach: float) -> list[float]:
            out = [linear]
            while out[-1] < reach:
                out.append(out[-1] * 10)
            return out

        hi, lo = max([0.0, *values]), min([0.0, *values])
        below = [-t for t in reversed(ticks(-lo))] if lo < 0 else []
        above = ticks(hi) if hi > 0 or lo == 0 else []
        self.ticks = [*below, 0.0, *above]
        self.lo, self.hi = self._t(self.ticks[0]), self._t(self.ticks[-1])

    def _t(self, v: float) -> float:
        return math.copysign(math.log10(1 + abs(v) / self.linear), v)

    def y(self, v: float) -> float:
        return self.bottom - (self._t(v) - self.lo) / (self.hi - self.lo) * (self.bottom - TOP)


class _XScale:
    """Value -> x pixel between `left` and `right`, linear (ticks as the y axis has them) or log2 (powers of 2)."""

    def __init__(self, values: Sequence[float], log2: bool, left: float, right: float) -> None:
        self.log2, self.left, self.right = log2, left, right
        if log2:
            lo = min(v for v in values if v > 0) if any(v > 0 for v in values) else 1.0
            hi = max(values, default=1.0)
            exps = range(math.floor(math.log2(lo)), max(math.ceil(math.log2(hi)), math.floor(math.log2(lo)) + 1) + 1)
            self.ticks = [2.0 ** e for e in exps]
        else:
            self.ticks = _Scale(values, False).ticks
        self.lo, self.hi = self._t(self.ticks[0]), self._t(self.ticks[-1])

    def _t(self, v: float) -> float:
        return math.log2(max(v, 1e-12)) if self.log2 else v

    def x(self, v: float) -> float:
        return self.left + (self._t(v) - self.lo) / (self.hi - self.lo) * (self.right - self.left)


SCATTER_PLOT, SCATTER_ROW, SCATTER_CHAR = 530, 16, 5.6  # plot width; the legend's row and (10 px) character widths


def scatter(points: Mapping[str, tuple[float, float]], *, title: str, xlabel: str, ylabel: str, logx: bool = False,
            symlog: float | None = None, joined: Sequence[str] = (),
            intervals: Mapping[str, tuple[float, float]] | None = None, fmt: str = ".3g") -> str:
    """Named points over numbers on both axes ({name: (x, y)}), numbered at the point and named with y (`fmt`) in
    the legend, smallest x first. `logx`: x on log2. `symlog`: y on a symmetric log, linear within +-symlog, so that
    0.1 and 10 both read. `joined` (a frontier): those points in the second colour, joined by a line in x order.
    `intervals`: {name: (low, high)} of y, drawn as a vertical bar through the point."""
    spans = intervals or {}
    items = sorted(points.items(), key=lambda kv: (kv[1][0], abs(kv[1][1])))
    height = max(HEIGHT, TOP + 8 + len(items) * SCATTER_ROW + BOTTOM)
    ys = [y for _, y in points.values()] + [v for span in spans.values() for v in span]
    yscale: _Scale | _SymlogScale = (_SymlogScale(ys, symlog, height - BOTTOM) if symlog
                                     else _Scale(ys, False, height - BOTTOM))

    def entry(i: int, name: str, y: float) -> str:
        span = spans.get(name)
        return f"{i}: {name} ({y:{fmt}}" + (f" [{span[0]:{fmt}}, {span[1]:{fmt}}])" if span is not None else ")")

    names = [entry(i, name, y) for i, (name, (_, y)) in enumerate(items, 1)]
    right = LEFT + SCATTER_PLOT  # the legend names every point beside the plot: as wide as its longest line
    width = right + 40 + math.ceil(SCATTER_CHAR * max(map(len, names), default=0))
    xscale = _XScale([x for x, _ in points.values()], logx, LEFT + 10, right - 10)
    out = _frame(title, ylabel, yscale, width, height, width - right)
    for t in xscale.ticks:
        tx = _num(xscale.x(t))
        out.append(f'<line x1="{tx}" x2="{tx}" y1="{TOP}" y2="{height - BOTTOM}" stroke="#eee"/>')
        out.append(f'<text x="{tx}" y="{height - BOTTOM + 18}" text-anchor="middle">{_label(t)}</text>')
    out.append(f'<text x="{(LEFT + right) / 2:.0f}" y="{height - 12}" text-anchor="middle">{escape(xlabel)}</text>')
    if yscale.ticks[0] < 0:
        out.append(f'<line x1="{LEFT}" x2="{right}" y1="{_num(yscale.y(0))}" y2="{_num(yscale.y(0))}" '
                   f'stroke="#999"/>')
    on = set(joined)
    if joined:
        line = " ".join(f"{_num(xscale.x(x))},{_num(yscale.y(y))}" for x, y in sorted(points[n] for n in joined))
        out.append(f'<polyline points="{line}" fill="none" stroke="{COLORS[1]}" stroke-width="1.5" '
                   f'stroke-opacity="0.6"/>')
    colors = []
    for i, (name, (x, y)) in enumerate(items, 1):
        color = COLORS[1] if name in on else COLORS[0]
        px, py = _num(xscale.x(x)), _num(yscale.y(y))
        span = spans.get(name)
        if span is not None:
            out.append(f'<line x1="{px}" x2="{px}" y1="{_num(yscale.y(span[0]))}" y2="{_num(yscale.y(span[1]))}" '
                       f'stroke="{color}" stroke-opacity="0.7"/>')
        out.append(f'<circle cx="{px}" cy="{py}" r="4" fill="{color}"><title>{escape(name)}: {_label(x)}, '
                   f'{y:{fmt}}</title></circle>')
        out.append(f'<text x="{_num(xscale.x(x) + 5)}" y="{_num(yscale.y(y) - 5)}" font-size="9">{i}</text>')
        colors.append(color)
    out.append(f'<line x1="{LEFT}" x2="{right}" y1="{height - BOTTOM}" y2="{height - BOTTOM}" stroke="#333"/>')
    return "\n".join(out + _legend(names, colors, right, SCATTER_ROW, ' font-size="10"') + ["</svg>"]) + "\n"
