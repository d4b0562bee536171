"""A small PNG line plot (pillow, which sglang already depends on): no matplotlib needed.

    line_plot_png({"tp4": [(1024, 30.1), (4096, 35.0)], "tp4-kvp4": [...]}, "tpot.png",
                  title="...", xlabel="context (tokens)", ylabel="TPOT (ms)", logx=True, logy=True)

One coloured line with point markers per series, a legend, and labelled ticks (powers of two or ten
on log axes). Used by ``benchmark/bench_helix_decode.py`` and ``perf_model --pareto``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (140, 86, 75), (227, 119, 194), (23, 190, 207), (188, 189, 34), (127, 127, 127), (0, 0, 128), (0, 128, 128)]


def _ticks(lo: float, hi: float, log: bool) -> List[float]:
    """Tick values in data units covering [lo, hi]."""
    if log:
        base = 2 if hi / lo <= 2**12 and lo >= 1 else 10
        a, b = math.floor(math.log(lo, base)), math.ceil(math.log(hi, base))
        step = max(1, (b - a) // 8)
        return [base**e for e in range(a, b + 1, step) if lo <= base**e <= hi] or [lo, hi]
    span = (hi - lo) or 1.0
    step = 10 ** math.floor(math.log10(span / 5))
    step *= 5 if span / step > 25 else 2 if span / step > 10 else 1
    return [lo + i * step - (lo % step) for i in range(int(span / step) + 2) if lo <= lo + i * step - (lo % step) <= hi]


def _fmt(v: float) -> str:
    if v >= 1 << 20 and v == int(v) and int(v) & (int(v) - 1) == 0:
        return f"{int(v) >> 20}M"
    if v >= 1024 and v == int(v) and int(v) & (int(v) - 1) == 0:
        return f"{int(v) >> 10}K"
    return f"{v:g}" if abs(v) >= 0.01 else f"{v:.1e}"


def line_plot_png(
    series: Dict[str, Sequence[Tuple[float, float]]],
    path: str,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    size: Tuple[int, int] = (900, 560),
) -> None:
    from PIL import Image, ImageDraw

    pts = [(x, y) for s in series.values() for x, y in s if (not logx or x > 0) and (not logy or y > 0)]
    if not pts:
        raise ValueError(f"line_plot_png: nothing to plot in {path}")
    fx = math.log10 if logx else (lambda v: v)
    fy = math.log10 if logy else (lambda v: v)
    x_lo, x_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    y_lo, y_hi = min(p[1] for p in pts), max(p[1] for p in pts)
    if logy:
        y_lo, y_hi = y_lo / 1.2, y_hi * 1.2
    else:
        y_lo, y_hi = min(0.0, y_lo), y_hi * 1.1 or 1.0
    x0, x1 = fx(x_lo), fx(x_hi) if x_hi > x_lo else fx(x_lo) + 1
    y0, y1 = fy(y_lo), fy(y_hi) if y_hi > y_lo else fy(y_lo) + 1
    w, h = size
    left, right, top, bottom = 80, 190, 40, 60
    px = lambda x: left + (fx(x) - x0) / (x1 - x0) * (w - left - right)  # noqa: E731
    py = lambda y: h - bottom - (fy(y) - y0) / (y1 - y0) * (h - top - bottom)  # noqa: E731

    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.rectangle([left, top, w - right, h - bottom], outline=(136, 136, 136))
    d.text((left, 12), title, fill="black")
    d.text(((left + w - right) // 2 - 3 * len(xlabel), h - 22), xlabel, fill="black")
    d.text((8, top - 20), ylabel, fill="black")
    for t in _ticks(x_lo, x_hi, logx):
        x = px(t)
        d.line([x, top, x, h - bottom], fill=(232, 232, 232))
        d.text((x - 3 * len(_fmt(t)), h - bottom + 6), _fmt(t), fill="black")
    for t in _ticks(y_lo, y_hi, logy):
        y = py(t)
        d.line([left, y, w - right, y], fill=(232, 232, 232))
        d.text((left - 8 - 6 * len(_fmt(t)), y - 6), _fmt(t), fill="black")
    for i, (name, s) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        xy = [(px(x), py(y)) for x, y in sorted(s) if (not logx or x > 0) and (not logy or y > 0)]
        if len(xy) > 1:
            d.line(xy, fill=c, width=2)
        for x, y in xy:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=c)
        d.line([w - right + 12, top + 10 + 18 * i, w - right + 36, top + 10 + 18 * i], fill=c, width=3)
        d.text((w - right + 42, top + 4 + 18 * i), name, fill="black")
    img.save(path, "PNG")
