"""The learning-rate finder's plot (:meth:`LRFinderResult.plot`): the
smoothed loss against the learning rate, as a PNG, drawn with Pillow.

Pillow, not matplotlib: hookloop depends on neither, and Pillow is already
what its PNG grids (``SampleGrid``) and ``hookloop demo`` use (the ``demo``
extra). Lightning's ``lr_finder.plot`` needs matplotlib instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WIDTH, HEIGHT = 800, 500
#: the plot area's distance from the image's left, top, right and bottom edges
LEFT, TOP, RIGHT, BOTTOM = 90, 50, 30, 70
CURVE = (31, 119, 180)
MARK = (214, 39, 40)
GRID = (225, 225, 225)


def draw(lrs: Sequence[float], losses: Sequence[float], path: Path, *, log_x: bool,
         marked: int | None, title: str) -> None:
    """Write the curve of ``losses`` against ``lrs`` to ``path`` (PNG): a log
    x axis when ``log_x``, the point ``marked`` (an index) in red with a
    dashed line and its learning rate. Non-finite losses are left out."""
    try:
        from PIL import Image, ImageDraw
    except ImportError as exc:  # an optional dependency: say which
        raise ImportError("LRFinderResult.plot draws the PNG with Pillow, which is not installed: "
                          "pip install pillow (or pip install 'hookloop[demo]')") from exc
    points = [(math.log10(x) if log_x else x, y) for x, y in zip(lrs, losses) if math.isfinite(y)]
    if not points:
        raise ValueError("LRFinderResult.plot: the curve has no finite loss to draw")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_range, y_range = _padded(min(xs), max(xs), 0.0), _padded(min(ys), max(ys), 0.05)

    def at(x: float, y: float) -> tuple[float, float]:
        fx = (x - x_range[0]) / (x_range[1] - x_range[0])
        fy = (y - y_range[0]) / (y_range[1] - y_range[0])
        return LEFT + fx * (WIDTH - LEFT - RIGHT), HEIGHT - BOTTOM - fy * (HEIGHT - TOP - BOTTOM)

    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    pen = ImageDraw.Draw(image)
    font = _font(13)
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    x_ticks = _decades(*x_range) if log_x else []
    for x in x_ticks or _ticks(*x_range):
        px = at(x, y_range[0])[0]
        pen.line([(px, TOP), (px, bottom)], fill=GRID)
        label = f"1e{int(round(x))}" if x_ticks else (f"{10 ** x:.2g}" if log_x else f"{x:.3g}")
        _text(pen, (px, bottom + 6), label, font, anchor="ma")
    for y in _ticks(*y_range):
        py = at(x_range[0], y)[1]
        pen.line([(LEFT, py), (right, py)], fill=GRID)
        _text(pen, (LEFT - 6, py), f"{y:.3g}", font, anchor="rm")
    pen.rectangle([LEFT, TOP, right, bottom], outline="black")
    pen.line([at(x, y) for x, y in points], fill=CURVE, width=2)
    if marked is not None and math.isfinite(losses[marked]):
        mx, my = at(math.log10(lrs[marked]) if log_x else lrs[marked], losses[marked])
        for y0 in range(TOP, bottom, 12):  # dashed
            pen.line([(mx, y0), (mx, min(y0 + 6, bottom))], fill=MARK, width=1)
        pen.ellipse([mx - 6, my - 6, mx + 6, my + 6], outline=MARK, fill=MARK)
        left = mx > (LEFT + right) / 2  # the label on the side with room for it
        _text(pen, (mx - 8 if left else mx + 8, TOP + 6), f"suggestion {lrs[marked]:.3g}", font,
              anchor="ra" if left else "la", fill=MARK)
    _text(pen, (WIDTH / 2, 16), title, _font(16), anchor="ma")
    _text(pen, ((LEFT + right) / 2, HEIGHT - 28), "learning rate" + (" (log scale)" if log_x else ""),
          font, anchor="ma")
    sideways = Image.new("RGB", (200, 20), "white")  # the y axis's label
    _text(ImageDraw.Draw(sideways), (100, 10), "loss (smoothed)", font, anchor="mm")
    turned = sideways.rotate(90, expand=True)
    image.paste(turned, (8, (TOP + bottom) // 2 - turned.height // 2))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")


def _padded(lo: float, hi: float, fraction: float) -> tuple[float, float]:
    if hi <= lo:
        return lo - 0.5, hi + 0.5
    pad = (hi - lo) * fraction
    return lo - pad, hi + pad


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values between ``lo`` and ``hi``, about ``count`` of them."""
    step = 10 ** math.floor(math.log10((hi - lo) / count))
    for factor in (1, 2, 5, 10):
        if (hi - lo) / (step * factor) <= count:
            step *= factor
            break
    first = math.ceil(lo / step)
    return [i * step for i in range(first, math.floor(hi / step) + 1)]


def _decades(lo: float, hi: float) -> list[float]:
    """The whole powers of ten between ``lo`` and ``hi`` (log10 values), if
    at least two: then the log axis is labelled ``1e-8``, ``1e-7``, ..."""
    found = [float(d) for d in range(math.ceil(lo), math.floor(hi) + 1)]
    return found if len(found) >= 2 else []


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable font
    except TypeError:
        return ImageFont.load_default()


def _text(pen: Any, xy: tuple[float, float], text: str, font: Any, anchor: str,
          fill: tuple[int, int, int] | str = "black") -> None:
    try:
        pen.text(xy, text, font=font, anchor=anchor, fill=fill)
    except ValueError:  # a bitmap font takes no anchor (Pillow without FreeType)
        pen.text(xy, text, font=font, fill=fill)
