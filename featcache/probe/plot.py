"""The layer-wise transfer curve: probe top-1 per layer, drawn with matplotlib."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from featcache.plotting import require_matplotlib
from featcache.probe.results import ProbeResult
from featcache.store.paths import output_file

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

COLOURS = {"val": "#2d6eb4", "test": "#d66027", "chance": "#8c8c8c"}
_MARGINS = (56, 20, 36, 64)  # left, right, top, bottom, in pixels
_DPI = 100


def plot_layers(
    results: Sequence[ProbeResult], path: str | os.PathLike, *, size: tuple[int, int] = (720, 420)
) -> Path:
    """Draw the layer-wise transfer curve (top-1 per layer, 0-100%) as a PNG at ``path``.

    One line for validation top-1, one for test top-1 when every layer has a test split,
    and the chance level dashed; ``size`` is the image's ``(width, height)`` in pixels.
    Returns the path.

    Raises:
        FeatcacheError: matplotlib (the ``plot`` extra) is not installed.
    """
    require_matplotlib()
    path = output_file(path, (".png",), "plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MultipleLocator, PercentFormatter

    width, height = size
    left, right, top, bottom = _MARGINS
    # A Figure with its own Agg canvas: nothing global (pyplot, the backend) is touched.
    figure = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI, facecolor="white")
    canvas = FigureCanvasAgg(figure)
    figure.subplots_adjust(
        left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height
    )
    axes = figure.add_subplot()
    positions = list(range(len(results)))

    chance = (results[0].test or results[0].val)["chance_top1"]
    chance_line = axes.axhline(
        100 * chance, color=COLOURS["chance"], linewidth=1.5, linestyle=(0, (3, 3)), label="chance"
    )
    series = [("val", [r.val["top1"] for r in results])]
    tests = [r.test for r in results]
    if all(test is not None for test in tests):
        series.append(("test", [test["top1"] for test in tests if test is not None]))
    lines = [
        axes.plot(
            positions,
            [100 * v for v in values],
            color=COLOURS[name],
            linewidth=2.2,
            marker="o",
            markersize=6,
            label=f"{name} top-1",
        )[0]
        for name, values in series
    ]

    axes.set_xlim(-0.5, len(results) - 0.5)
    axes.set_ylim(0, 100)
    axes.yaxis.set_major_locator(MultipleLocator(20))
    axes.yaxis.set_minor_locator(MultipleLocator(10))
    axes.yaxis.set_major_formatter(PercentFormatter(decimals=0))
    axes.grid(axis="y", which="both", color="#e1e1e1", linewidth=0.8)
    axes.set_axisbelow(True)
    axes.tick_params(axis="x", length=0)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)
    axes.set_xticks(positions, [r.layer for r in results])
    slot = (width - left - right) / len(results) - 4
    measure = _text_width(canvas, axes.get_xticklabels()[0])
    axes.set_xticks(positions, [_fit_text(r.layer, slot, measure) for r in results])

    axes.set_xlabel("layer")
    axes.set_title("linear probe top-1 by layer", loc="left", fontsize="medium")
    axes.legend(
        handles=[*lines, chance_line],
        loc="lower right",
        bbox_to_anchor=(1, 1),
        ncols=len(lines) + 1,
        frameon=False,
        fontsize="small",
        borderaxespad=0.3,
    )
    canvas.print_png(path)
    return path


def _text_width(canvas: FigureCanvasAgg, label: Text) -> Callable[[str], float]:
    """Width in pixels of a text drawn on ``canvas`` in the font of ``label``."""
    renderer = canvas.get_renderer()
    font = label.get_fontproperties()

    def measure(text: str) -> float:
        return renderer.get_text_width_height_descent(text, font, ismath=False)[0]

    return measure


def _fit_text(text: str, width: float, measure: Callable[[str], float]) -> str:
    """``text``, cut short with ``...`` to fit ``width`` pixels."""
    if measure(text) <= width:
        return text
    while text and measure(text + "...") > width:
        text = text[:-1]
    return text + "..." if text else ""
