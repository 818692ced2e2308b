"""The layer-wise transfer curve: top-1 per layer and method, drawn with matplotlib."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from featcache.probe.results import FewShotResult, KnnResult, ProbeResult, Result
from featcache.util.files import output_file
from featcache.util.plotting import require_matplotlib

if TYPE_CHECKING:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

COLOURS = {"val": "#2d6eb4", "test": "#d66027", "chance": "#8c8c8c"}
# The lines of other methods, in order (matplotlib's tab10 without its grey).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
Series = tuple[str, list[float | None], list[float | None]]  # name, top-1 and spread per layer
_MARGINS = (56, 20, 36, 64)  # left, right, top, bottom, in pixels
_DPI = 100


def plot_layers(
    results: Sequence[Result], path: str | os.PathLike, *, size: tuple[int, int] = (720, 420)
) -> Path:
    """Draw the layer-wise transfer curve (top-1 per layer, 0-100%) as a PNG at ``path``.

    For linear probes: one line for validation top-1, one for test top-1 when every
    layer has a test split. With k-NN, few-shot or recipe results: one line per method
    (k-NN at its headline k, 20 by default; few-shot lines with the standard deviation
    over the draws as error bars). The chance level is dashed; ``size`` is the image's
    ``(width, height)`` in pixels. Returns the path.

    Raises:
        FeatcacheError: matplotlib (the ``plot`` extra) is not installed."""
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
    layers = list(dict.fromkeys(r.layer for r in results))
    positions = list(range(len(layers)))

    plain = [r for r in results if isinstance(r, ProbeResult) and r.recipe is None]
    if len(plain) == len(results):
        chance = (plain[0].test or plain[0].val)["chance_top1"]
        series = _probe_series(plain)
        title = "linear probe top-1 by layer"
    else:
        chance = results[0].scores()[0].chance_top1
        series = _method_series(results, layers)
        title = "top-1 by layer"
    chance_line = axes.axhline(
        100 * chance, color=COLOURS["chance"], linewidth=1.5, linestyle=(0, (3, 3)), label="chance"
    )
    palette = iter(PALETTE)
    lines = []
    for name, values, spread in series:
        colour = COLOURS.get(name) or next(palette, "#555555")
        xs = [x for x, v in zip(positions, values, strict=True) if v is not None]
        ys = [100 * v for v in values if v is not None]
        errors = [100 * (e or 0) for v, e in zip(values, spread, strict=True) if v is not None]
        label = f"{name} top-1" if name in ("val", "test") else name
        (line,) = axes.plot(
            xs, ys, color=colour, linewidth=2.2, marker="o", markersize=6, label=label
        )
        if any(errors):
            axes.errorbar(xs, ys, yerr=errors, fmt="none", ecolor=colour, capsize=3, linewidth=1)
        lines.append(line)

    axes.set(xlim=(-0.5, len(layers) - 0.5), ylim=(0, 100), xlabel="layer")
    axes.yaxis.set_major_locator(MultipleLocator(20))
    axes.yaxis.set_minor_locator(MultipleLocator(10))
    axes.yaxis.set_major_formatter(PercentFormatter(decimals=0))
    axes.grid(axis="y", which="both", color="#e1e1e1", linewidth=0.8)
    axes.set_axisbelow(True)
    axes.tick_params(axis="x", length=0)
    axes.spines[["top", "right"]].set_visible(False)
    axes.set_xticks(positions, layers)
    slot = (width - left - right) / len(layers) - 4
    tick = axes.get_xticklabels()[0]
    axes.set_xticks(positions, [_fit_text(layer, slot, canvas, tick) for layer in layers])

    axes.set_title(title, loc="left", fontsize="medium")
    axes.legend(
        handles=[*lines, chance_line],
        loc="lower right",
        bbox_to_anchor=(1, 1),
        ncols=min(len(lines) + 1, 4),
        frameon=False,
        fontsize="small",
        borderaxespad=0.3,
    )
    canvas.print_png(path)
    return path


def _fit_text(text: str, width: float, canvas: FigureCanvasAgg, label: Text) -> str:
    """``text``, cut short with ``...`` to fit ``width`` pixels on ``canvas`` in the font
    of ``label``."""
    renderer, font = canvas.get_renderer(), label.get_fontproperties()

    def measure(shown: str) -> float:
        return renderer.get_text_width_height_descent(shown, font, ismath=False)[0]

    if measure(text) <= width:
        return text
    while text and measure(text + "...") > width:
        text = text[:-1]
    return text + "..." if text else ""


def _probe_series(results: Sequence[ProbeResult]) -> list[Series]:
    """Validation top-1, and test top-1 when every layer has a test split."""
    spread: list[float | None] = [None] * len(results)
    series: list[Series] = [("val", [r.val["top1"] for r in results], spread)]
    tests = [r.test["top1"] for r in results if r.test is not None]
    if len(tests) == len(results):
        series.append(("test", tests, spread))
    return series


def _method_series(results: Sequence[Result], layers: list[str]) -> list[Series]:
    """One series per method: its top-1 on each layer (None where it did not run) and
    the spread over few-shot draws. k-NN results give their headline k only."""
    found: dict[str, dict[str, tuple[float, float | None]]] = {}
    for result in results:
        scores = result.scores()
        if isinstance(result, KnnResult):
            scores = [s for s in scores if s.method == f"k-NN k={result.k}"]
        elif isinstance(result, FewShotResult) and result.method == "knn":
            scores = [s for s in scores if s.method.startswith(f"k-NN {result.headline} ")]
        for score in scores:
            found.setdefault(score.method, {})[result.layer] = (score.top1, score.top1_std)
    return [
        (
            name,
            [by_layer[layer][0] if layer in by_layer else None for layer in layers],
            [by_layer[layer][1] if layer in by_layer else None for layer in layers],
        )
        for name, by_layer in found.items()
    ]
