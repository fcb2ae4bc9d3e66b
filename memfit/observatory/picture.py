"""Pictures of the profiled optimizer step's memory that open with no network.

torch-tb-profiler's Memory view loads its charts from the web, so on an air-gapped GPU cluster it never renders.
These draw the same step from the profiler's own trace (``memfit.observatory.timeline.role_timeline``): tensor memory
over time stacked by role, each phase (``memfit::forward``, ``backward``, ...) shaded and named, the peak marked and
annotated with the biggest allocations alive at it.

- ``memory_step.png`` (matplotlib), also in TensorBoard's Images tab;
- ``memory_step.html``: one self-contained page (plotly, with its JavaScript inlined in the file), where hovering
  shows each role's bytes over time and each allocation alive at the peak (size, role, operator, source line).
"""

from __future__ import annotations

import html
import tempfile
from pathlib import Path

import matplotlib
import numpy

matplotlib.use("Agg")  # files only: no display on a training node
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from memfit.files import write_text_whole, written_whole  # noqa: E402
from memfit.units import fmt_bytes  # noqa: E402

_PHASE_COLOURS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "optimizer_step": "#55a868",
    "zero_grad": "#8172b3",
    # the run's phases beside its steps: a window of several steps can hold a validation, a sample or a save
    "resume": "#937860",
    "first_optimizer_step": "#2f7d45",  # the optimizer step's green, darker: a run's first (its range is optimizer_step)
    "validation": "#da8bc3",
    "generation": "#64b5cd",
    "save": "#ccb974",
}
# in stacking order, bottom first: what lasts the whole step under what comes and goes
ROLE_COLOURS = {
    "cublas_workspaces": "#8172b3",
    "params_trainable": "#c44e52",
    "params_frozen": "#8c8c8c",
    "params_quantized": "#b5b5b5",
    "gradients": "#dd8452",
    "optimizer_state": "#55a868",
    "activations": "#4c72b0",
    "gathered_params": "#da8bc3",
    "loss": "#ff9f9b",
    "unattributed": "#e5ae38",
    "temporaries": "#e5ae38",
}  # the estimate's name for what a run lists as unattributed


TENSORBOARD_CARD = (6.4, 4.6)
"""The figure size (inches at 100 pixels) of a picture for TensorBoard's Images tab, which shrinks a wider one to its
card's width, text and all: drawn at 640 pixels, the text keeps its points"""


def _stacked(timeline: dict) -> list[str]:
    """The roles the timeline holds any bytes of, in stacking order."""
    return sorted((role for role, values in timeline["roles"].items() if any(values)), key=list(ROLE_COLOURS).index)


def _peak_phase(timeline: dict) -> str:
    return next((name for a, b, name in timeline["phases"] if a <= timeline["peak_ms"] <= b), "between phases")


def _corner_list(axes, heading: str, lines: list[str], top_left: bool, fontsize: float) -> None:
    """A list in monospace on a white box in a corner of ``axes`` (top left, or bottom right)."""
    axes.text(
        0.01 if top_left else 0.99,
        0.97 if top_left else 0.02,
        heading + "\n" + "\n".join(lines),
        transform=axes.transAxes,
        va="top" if top_left else "bottom",
        ha="left" if top_left else "right",
        fontsize=fontsize,
        family="monospace",
        bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "#cccccc"},
    )


def tensorboard_card(draw) -> numpy.ndarray:
    """The picture ``draw(path, figsize)`` makes, drawn at TensorBoard's card size in a scratch file and read back as
    (H, W, RGB) for ``add_image``."""
    from matplotlib import image as plt_image

    with tempfile.TemporaryDirectory() as scratch:
        card = Path(scratch) / "card.png"
        draw(card, TENSORBOARD_CARD)
        return plt_image.imread(card)[..., :3]  # (H, W, RGB)


def _lay_out(figure) -> None:
    """``tight_layout``, then no layout engine: matplotlib leaves a placeholder engine behind ``tight_layout``, and
    for any engine ``savefig`` first renders the whole figure into a scratch buffer, a third of a drawing's time."""
    figure.tight_layout()
    figure.set_layout_engine(None)


def _save_png(figure, out: Path) -> Path:
    """``figure`` laid out and written whole to ``out`` (a PNG: no half-drawn picture where a run is stopped), then
    closed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        _lay_out(figure)
        with written_whole(out) as partial:
            figure.savefig(partial, format="png")
    finally:
        plt.close(figure)
    return out


def _scale(peak: int) -> tuple[str, int]:
    return ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)


def draw_step(
    timeline: dict, title: str, out: Path, biggest: list[dict] = (), figsize: tuple[float, float] = (11, 5)
) -> dict:
    """Draws the role timeline into ``out`` (PNG), the peak annotated with the ledger's ``biggest`` allocations;
    returns what the picture states (peak, its phase, its time). ``figsize`` in inches at 100 pixels each."""
    peak, peak_ms = timeline["peak_bytes"], timeline["peak_ms"]
    peak_phase = _peak_phase(timeline)
    unit, scale = _scale(peak)
    roles = _stacked(timeline)

    figure, axes = plt.subplots(figsize=figsize, dpi=100)
    for a, b, name in timeline["phases"]:
        axes.axvspan(a, b, color=_PHASE_COLOURS.get(name, "#999999"), alpha=0.08)
    drawn = envelope(timeline, int(figsize[0] * 100 // 2))  # columns of two pixels or more: a narrower one blurs
    axes.stackplot(
        drawn["ms"],
        [[max(0, v) / scale for v in drawn["roles"][role]] for role in roles],
        labels=roles,
        colors=[ROLE_COLOURS[role] for role in roles],
        step="post",
        alpha=0.85,
    )
    axes.plot([peak_ms], [peak / scale], "o", color="#222222")
    start, end = timeline["ms"][0], timeline["ms"][-1]
    on_the_right = peak_ms > start + 0.6 * (end - start)  # the label then reads leftwards, inside the axes
    axes.annotate(
        f"peak {fmt_bytes(peak)} in {peak_phase}",
        (peak_ms, peak / scale),
        textcoords="offset points",
        xytext=(-8 if on_the_right else 8, 6),
        ha="right" if on_the_right else "left",
        color="#222222",
    )
    axes.set_xlim(start, end)  # a phase band begun before the first allocation (FSDP's) starts at the axis
    if biggest:
        lines = [
            f"{fmt_bytes(a['bytes'])}  {a['role']}  {a['op']}  {a.get('block', '')}  {a['source'].rsplit('/', 1)[-1]}"[
                : int(8 * figsize[0])
            ]
            for a in biggest[:4]
        ]
        _corner_list(axes, "biggest alive at the peak:", lines, top_left=True, fontsize=7)
    label_rows = _label_phases(figure, axes, timeline["phases"])
    axes.set_xlabel(timeline.get("x_label", "time in the profiled optimizer step (ms)"))
    axes.set_ylabel(f"allocated ({unit})")
    axes.set_ylim(0, peak / scale * (1.45 if biggest else 1.15))  # room above the curve for the list
    narrow = figsize[0] < 8  # TensorBoard's card: the title on two lines, the legend in two rows
    axes.set_title(
        title.replace(": ", ":\n", 1) if narrow else title,
        pad=14 + 10 * (label_rows - 1),
        fontsize=10 if narrow else None,
    )
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4 if narrow else 7, fontsize=8, frameon=False)
    _lay_out(figure)
    out.parent.mkdir(parents=True, exist_ok=True)
    x, y = axes.transData.transform((peak_ms, peak / scale))
    peak_pixel = (float(x), float(figure.bbox.height - y))  # from the image's top left, as an image is indexed
    try:
        with written_whole(out) as partial:
            figure.savefig(partial, format=out.suffix.lstrip(".") or "png")
    finally:
        plt.close(figure)
    return {"peak_bytes": peak, "peak_phase": peak_phase, "peak_ms": peak_ms, "peak_pixel": peak_pixel, "png": str(out)}


def _label_phases(figure, axes, phases: list) -> int:
    """Each phase's name above it; a name that would overlap the one before it (short phases, such as the optimizer
    step and zero_grad of a small model) goes a row higher. Returns the rows used."""
    axes.set_xlim(axes.get_xlim())  # the limits the labels are placed against
    renderer = figure.canvas.get_renderer()
    rows: list[float] = []  # the right edge (in pixels) of the last label in each row
    for a, b, name in phases:
        for row in range(len(rows) + 1):
            label = axes.text(
                (a + b) / 2,
                1.0,
                name,
                transform=axes.get_xaxis_transform(),
                ha="center",
                va="bottom",
                fontsize=7,
                color=_PHASE_COLOURS.get(name, "#555555"),
            )
            label.set_y(1.0 + 0.035 * row)
            box = label.get_window_extent(renderer)
            if row == len(rows) or box.x0 > rows[row] + 4:
                rows[row : row + 1] = [box.x1]
                break
            label.remove()
    return max(1, len(rows))


def _rows(phases: list, per_character: float) -> list[int]:
    """The row of each phase's name on the page, names written from each phase's start: a name that would reach the
    next one goes a row lower. A browser measures text only once the page is drawn, so a name's width is estimated
    (``per_character``, in the x axis's units: about 7 px a character of a plot 600 px wide, as in a 1200 px window)."""
    ends: list[float] = []  # where the last name of each row ends
    rows = []
    for a, _, name in phases:
        row = next((r for r, end in enumerate(ends) if a > end), len(ends))
        ends[row : row + 1] = [a + len(name) * per_character]
        rows.append(row)
    return rows


def envelope(timeline: dict, columns: int) -> dict:
    """The timeline as ``columns`` steps of equal time, each at the highest level the step reached in it (the level
    it entered with, or one inside): a temporary alive for microseconds that sets the peak is drawn a column wide at
    its height. Drawn at its own width it was invisible, the peak's dot floating over a curve a fraction of it."""
    ms, roles = timeline["ms"], timeline["roles"]
    totals = [sum(values) for values in zip(*roles.values())]
    start, end = ms[0], ms[-1]
    if end <= start or len(ms) <= columns:
        return timeline
    width = (end - start) / columns
    kept, entering, i = [], 0, 0  # entering: the sample in force as a column begins
    for column in range(columns):
        best = entering
        while i < len(ms) and ms[i] < start + (column + 1) * width:
            if totals[i] > totals[best]:
                best = i
            entering = i
            i += 1
        kept.append(best)
    return {
        **timeline,
        "ms": [start + column * width for column in range(columns)] + [end],
        "roles": {role: [values[k] for k in kept] + [values[-1]] for role, values in roles.items()},
    }


def thinned(timeline: dict, points: int) -> dict:
    """At most ``points`` samples (and the first and last) of a timeline: of each run of consecutive samples, the one
    with the highest total, so every local maximum the eye could see, the peak first of all, stays."""
    n = len(timeline["ms"])
    if n <= points + 2:
        return timeline
    totals = [sum(values) for values in zip(*timeline["roles"].values())]
    width = (n - 2) / points
    kept = [0]
    for bucket in range(points):
        a, b = 1 + int(bucket * width), 1 + int((bucket + 1) * width)
        if b > a:
            kept.append(max(range(a, b), key=totals.__getitem__))
    kept.append(n - 1)
    return {
        **timeline,
        "ms": [timeline["ms"][i] for i in kept],
        "roles": {role: [values[i] for i in kept] for role, values in timeline["roles"].items()},
    }


def _bar_label(i: int, allocation: dict) -> str:
    """``2. aten::mm model.py:95``: the rank keeps labels unique on plotly's category axis."""
    source = str(allocation.get("source") or "").rsplit("/", 1)[-1]
    return f"{i + 1}. {allocation.get('op') or '?'} {source}".strip()[:48]


def _tables(operators: list[dict], allocations: list[dict]) -> str:
    """The per-operator and per-allocation tables of the page (``memfit.trace_events.operator_memory``'s rows)."""

    def table(caption: str, head: list[str], rows: list[list[str]]) -> str:
        cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        return f"<h3>{html.escape(caption)}</h3><table><thead><tr>{header}</tr></thead><tbody>{cells}</tbody></table>"

    def ms(value) -> str:
        return "alive at the end" if value is None else f"{value:.2f}"

    shown_ops, shown_allocations = operators[:OPERATORS_SHOWN], allocations[:ALLOCATIONS_SHOWN]
    parts = []
    if shown_ops:
        parts.append(
            table(
                f"Memory by operator (the {len(shown_ops)} that allocated most, of {len(operators)})",
                ["operator", "allocations", "allocated", "largest allocation", "size increase"],
                [
                    [
                        r["operator"],
                        f"{r['count']:,}",
                        fmt_bytes(r["allocated"]),
                        fmt_bytes(r["largest"]),
                        ("-" if r["increase"] < 0 else "") + fmt_bytes(abs(r["increase"])),
                    ]
                    for r in shown_ops
                ],
            )
        )
    if shown_allocations:
        parts.append(
            table(
                f"Allocations (the {len(shown_allocations)} largest, of {len(allocations):,}; ms from the first)",
                ["operator", "size", "made (ms)", "freed (ms)"],
                [
                    [a["operator"], fmt_bytes(a["bytes"]), ms(a["made_ms"]), ms(a["freed_ms"])]
                    for a in shown_allocations
                ],
            )
        )
    return "".join(parts)


OPERATORS_SHOWN = 40
ALLOCATIONS_SHOWN = 100
_PAGE_STYLE = (
    "body{font-family:sans-serif;margin:0 16px}table{border-collapse:collapse;font-size:13px;margin-bottom:24px}"
    "th,td{border-bottom:1px solid #ddd;padding:3px 10px;text-align:right}th:first-child,td:first-child{text-align:left}"
)


def write_page(
    timeline: dict,
    title: str,
    out: Path,
    biggest: list[dict] = (),
    points: int = 2000,
    operators: list[dict] = (),
    allocations: list[dict] = (),
) -> Path:
    """The same step as one HTML file that needs nothing else: plotly's JavaScript is inlined, not fetched. Below
    the charts, the tables TensorBoard's PyTorch Profiler tab would show (``operators``, ``allocations``: from
    ``memfit.trace_events.operator_memory``), which that tab cannot draw offline.

    The figure is plotly's JSON schema written as plain dicts and handed to ``plotly.io.to_html`` unvalidated:
    building it from graph objects validated every property in Python, most of the page's 0.55 s. The curve is thinned
    to ``points`` samples (``thinned``: the peak stays): a step of a real model has tens of thousands of allocations,
    and serialising every one tripled the page's memory while it was written."""

    timeline = thinned(timeline, points)
    unit, scale = _scale(timeline["peak_bytes"])
    # left: the roles stacked over time (x, y); right: the allocations alive at the peak (x2, y2)
    x_label = timeline.get("x_label", "time in the profiled optimizer step (ms)")
    at = "at %{x:.2f} ms" if x_label.endswith("(ms)") else "at allocation %{x:.0f}"  # the x axis's unit
    data = [
        {
            "type": "scatter",
            "x": timeline["ms"],
            "y": [max(0, v) / scale for v in values],
            "name": role,
            "stackgroup": "roles",
            "mode": "lines",
            "xaxis": "x",
            "yaxis": "y",
            "line": {"shape": "hv", "width": 0.5, "color": ROLE_COLOURS[role]},
            "hovertemplate": f"{role}: %{{y:.3f}} {unit} {at}<extra></extra>",
        }
        for role, values in ((role, timeline["roles"][role]) for role in _stacked(timeline))
    ]
    peak_label = f"peak {fmt_bytes(timeline['peak_bytes'])} in {_peak_phase(timeline)}"
    data.append(
        {
            "type": "scatter",
            "x": [timeline["peak_ms"]],
            "y": [timeline["peak_bytes"] / scale],
            "mode": "markers+text",
            "text": [peak_label],
            "textposition": "top left"
            if timeline["peak_ms"] > timeline["ms"][len(timeline["ms"]) // 2]
            else "top right",
            "marker": {"color": "#222222", "size": 8},
            "name": "peak",
            "showlegend": False,
            "xaxis": "x",
            "yaxis": "y",
            "hovertemplate": f"{peak_label} {at}<extra></extra>",
        }
    )
    if biggest:
        data.append(
            {
                # each bar named on the chart by what made it (operator and source line) and its size, not by a number
                "type": "bar",
                "x": [_bar_label(i, a) for i, a in enumerate(biggest)],
                "y": [a["bytes"] / scale for a in biggest],
                "text": [fmt_bytes(a["bytes"]) for a in biggest],
                "textposition": "outside",
                "cliponaxis": False,
                "name": "alive at the peak",
                "showlegend": False,
                "xaxis": "x2",
                "yaxis": "y2",
                "marker": {"color": [ROLE_COLOURS.get(a["role"], "#999999") for a in biggest]},
                "customdata": [[fmt_bytes(a["bytes"]), a["role"], a["op"], a["source"]] for a in biggest],
                "hovertemplate": (
                    "%{customdata[0]} %{customdata[1]}<br>%{customdata[2]}<br>%{customdata[3]}<extra></extra>"
                ),
            }
        )
    shapes = [
        {
            "type": "rect",
            "xref": "x",
            "yref": "y domain",
            "x0": a,
            "x1": b,
            "y0": 0,
            "y1": 1,
            "layer": "below",
            "fillcolor": _PHASE_COLOURS.get(name, "#999999"),
            "opacity": 0.08,
            "line": {"width": 0},
        }
        for a, b, name in timeline["phases"]
    ]
    span = max(timeline["ms"][-1] - timeline["ms"][0], 1e-9)
    annotations = [
        {
            "x": a,
            "y": 1,
            "yshift": -16 * row,  # rows in pixels: the plot's height follows the window's
            "xref": "x",
            "yref": "y domain",
            "text": name,
            "showarrow": False,
            "xanchor": "left",
            "yanchor": "top",
            "font": {"size": 10},
        }
        for (a, b, name), row in zip(timeline["phases"], _rows(timeline["phases"], 7.0 * span / 600))
    ]
    annotations += [
        {"x": x, "y": 1.06, "xref": "paper", "yref": "paper", "text": text, "showarrow": False, "xanchor": "center"}
        for x, text in ((0.32, "memory over the step, by role"), (0.86, "biggest allocations alive at the peak"))
    ]
    grid = {"gridcolor": "#ebebeb", "zerolinecolor": "#ebebeb"}
    layout = {
        "title": {"text": f"{title}: peak {fmt_bytes(timeline['peak_bytes'])} in {_peak_phase(timeline)}"},
        "xaxis": {"domain": [0, 0.64], "anchor": "y", **grid, "title": {"text": x_label}},
        "yaxis": {"anchor": "x", "title": {"text": f"allocated ({unit})"}, **grid},
        "xaxis2": {
            "domain": [0.72, 1.0],
            "anchor": "y2",
            "type": "category",
            "automargin": True,  # room below for the rotated labels, not clipped
            "tickangle": -35,
            "tickfont": {"size": 9},
            **grid,
        },
        "yaxis2": {"anchor": "x2", "title": {"text": f"size ({unit})"}, **grid},
        "shapes": shapes,
        "annotations": annotations,
        "hovermode": "closest",
        "plot_bgcolor": "white",
        "paper_bgcolor": "white",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # the figure fills the window's width and most of its height, with the tables below it
    figure = _offline_figure(data, layout, height="75vh")
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_PAGE_STYLE}</style></head><body>{figure}{_tables(list(operators), list(allocations))}</body></html>"
    )
    write_text_whole(out, page)
    return out


def _offline_figure(data: list[dict], layout: dict, height: str) -> str:
    """A plotly figure as an HTML fragment with plotly's JavaScript inside it (include_plotlyjs=True), so the page
    opens offline; the figure's JSON handed over unvalidated (``write_page`` says why).

    plotly's JavaScript is 4.6 MB of the page's 5 MB. Every page carries it, a run's and an estimate's alike, so that
    each opens alone wherever it is copied (off a cluster, into a report); an estimate's page loading a copy shared
    beside its dir did not."""
    import plotly.io

    return plotly.io.to_html(
        {"data": data, "layout": layout},
        include_plotlyjs=True,
        full_html=False,
        validate=False,
        default_width="100%",
        default_height=height,
        config={"responsive": True},
    )


def draw_comparison(
    curves: dict[str, dict], title: str, out: Path, axes_labels: tuple[str, str], figsize: tuple[float, float] = (11, 5)
) -> Path:
    """Two runs' tensor memory allocated over their recorded step (the profiler's running total: what was alive
    before the step, which the ledgers' peaks count, is under both curves), one curve each (``curves``: label ->
    ``{"ms", "bytes", "phases"}``), each phase of the first shaded; a PNG, ``figsize`` in inches at 100 pixels each."""
    peak = max(max(curve["bytes"]) for curve in curves.values())
    unit, scale = _scale(peak)
    figure, axes = plt.subplots(figsize=figsize, dpi=100)
    first = next(iter(curves.values()))
    for a, b, name in first["phases"]:
        axes.axvspan(a, b, color=_PHASE_COLOURS.get(name, "#999999"), alpha=0.08)
    for (label, curve), colour in zip(curves.items(), ("#4c72b0", "#c44e52"), strict=False):
        values = [v / scale for v in curve["bytes"]]
        axes.step(curve["ms"], values, where="post", color=colour, label=f"{label}: at most {max(values):.2f} {unit}")
    axes.set_xlabel(axes_labels[0])
    axes.set_ylabel(axes_labels[1].format(unit=unit))
    axes.set_title(title, fontsize=9)
    axes.legend(loc="upper right", fontsize=8)
    return _save_png(figure, out)


def write_comparison_page(
    curves: dict[str, dict], title: str, table: str, out: Path, axes_labels: tuple[str, str]
) -> Path:
    """The same two curves as one self-contained HTML page (plotly's JavaScript inlined: opens offline), the
    comparison's table below them."""

    peak = max(max(curve["bytes"]) for curve in curves.values())
    unit, scale = _scale(peak)
    data = [
        {
            "type": "scatter",
            "x": curve["ms"],
            "y": [v / scale for v in curve["bytes"]],
            "name": label,
            "line": {"shape": "hv"},
            "hovertemplate": f"{html.escape(label)}: %{{y:.2f}} {unit}<extra></extra>",
        }
        for label, curve in curves.items()
    ]
    layout = {
        "title": {"text": html.escape(title), "font": {"size": 12}},
        "xaxis": {"title": {"text": axes_labels[0]}},
        "yaxis": {"title": {"text": axes_labels[1].format(unit=unit)}},
    }
    figure = _offline_figure(data, layout, height="70vh")
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head><body>'
        f"{figure}<pre>{html.escape(table)}</pre></body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out


_CURVE_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def _what_fits_scale(curves: dict[str, list[tuple[int, int]]], budget: int) -> tuple[str, int]:
    """The unit of a what-fits picture: the budget's or the highest peak drawn, whichever is larger."""
    return _scale(max([budget] + [peak for points in curves.values() for _, peak in points]))


def draw_what_fits(
    curves: dict[str, list[tuple[int, int]]],
    answers: dict[str, tuple[int, int] | None],
    budget: int,
    usable: int,
    title: str,
    out: Path,
    figsize: tuple[float, float] = (11, 5),
) -> Path:
    """Predicted peak against sequence length, one curve a plan (``curves``: label -> ``(tokens, peak bytes)`` points,
    as estimated), the budget and the highest peak that fits it (``usable``: the reserve kept) as lines, and each plan's
    longest sequence that fits (``answers``: label -> ``(tokens, peak)``, None where none does) marked; a PNG."""
    unit, scale = _what_fits_scale(curves, budget)
    figure, axes = plt.subplots(figsize=figsize, dpi=100)
    for (label, points), colour in zip(curves.items(), _CURVE_COLOURS, strict=False):
        tokens, peaks = zip(*sorted(points), strict=True)
        axes.plot(tokens, [peak / scale for peak in peaks], color=colour, marker=".", label=label)
        answer = answers.get(label)
        if answer is not None:
            axes.plot([answer[0]], [answer[1] / scale], marker="o", markersize=9, color=colour)
            axes.annotate(
                f"{answer[0]:,} tokens",
                (answer[0], answer[1] / scale),
                textcoords="offset points",
                xytext=(6, -14),
                fontsize=8,
                color=colour,
            )
    axes.axhline(budget / scale, color="#555555", linestyle="-", linewidth=1, label=f"budget {fmt_bytes(budget)}")
    if usable != budget:
        axes.axhline(usable / scale, color="#555555", linestyle="--", linewidth=1, label=f"fits: {fmt_bytes(usable)}")
    axes.set_xlabel("--train.max_seq_length (tokens)")
    axes.set_ylabel(f"predicted peak ({unit})")
    axes.set_ylim(bottom=0)
    axes.set_title(title, fontsize=9)
    axes.legend(loc="upper left", fontsize=8)
    return _save_png(figure, out)


def write_what_fits_page(
    curves: dict[str, list[tuple[int, int]]],
    answers: dict[str, tuple[int, int] | None],
    budget: int,
    usable: int,
    title: str,
    out: Path,
) -> Path:
    """``draw_what_fits`` as a page that opens offline, each point's peak on hover."""
    unit, scale = _what_fits_scale(curves, budget)
    data = []
    for (label, points), colour in zip(curves.items(), _CURVE_COLOURS, strict=False):
        tokens, peaks = zip(*sorted(points), strict=True)
        data.append(
            {
                "type": "scatter",
                "x": list(tokens),
                "y": [peak / scale for peak in peaks],
                "name": label,
                "line": {"color": colour},
                "hovertemplate": f"{html.escape(label)}: %{{x}} tokens, %{{y:.2f}} {unit}<extra></extra>",
            }
        )
        answer = answers.get(label)
        if answer is not None:
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers+text",
                    "x": [answer[0]],
                    "y": [answer[1] / scale],
                    "text": [f"{answer[0]:,} tokens"],
                    "textposition": "bottom right",
                    "marker": {"size": 11, "color": colour},
                    "name": f"{label}: longest that fits",
                }
            )
    xs = [tokens for points in curves.values() for tokens, _ in points]
    for value, dash, name in ((budget, "solid", "budget"), (usable, "dash", "fits (the reserve kept)")):
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": [min(xs), max(xs)],
                "y": [value / scale] * 2,
                "name": f"{name}: {fmt_bytes(value)}",
                "line": {"color": "#555555", "dash": dash, "width": 1},
            }
        )
    layout = {
        "title": {"text": html.escape(title), "font": {"size": 12}},
        "xaxis": {"title": {"text": "--train.max_seq_length (tokens)"}},
        "yaxis": {"title": {"text": f"predicted peak ({unit})"}, "rangemode": "tozero"},
        "margin": {"t": 80},
    }
    figure = _offline_figure(data, layout, height="80vh")
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head><body>'
        f"{figure}</body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(out, page)
    return out


_FAILURE_EXTRA_COLOURS = {"other_tensors": "#937860", "failing request": "#d62728"}


def _failure_bars(ledger: dict) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """The failure's two bars, each ``(label, [(segment, bytes, colour)])``: what was alive by role with the request
    that failed on top, and the activations by where backward needs them."""
    by_role = [
        (role, size, ROLE_COLOURS.get(role) or _FAILURE_EXTRA_COLOURS.get(role, "#999999"))
        for role, size in ledger["bytes_by_role"].items()
        if size > 0
    ]
    if ledger.get("failing_request_bytes"):
        by_role.append(("failing request", ledger["failing_request_bytes"], _FAILURE_EXTRA_COLOURS["failing request"]))
    shades = ("#4c72b0", "#6f8fc7", "#2f4f80", "#93acd6")
    by_place = [
        (place, size, shades[i % len(shades)])
        for i, (place, size) in enumerate(ledger.get("activations_by_place", {}).items())
        if size > 0
    ]
    return [("alive, by role", by_role), ("activations, by place", by_place)]


def _where_alive(tensor: dict) -> str:
    """Where a failure's tensor is: the block whose backward needs it, or the name that keeps it alive."""
    return tensor.get("place") or tensor.get("held_at", "")


def _failure_title(ledger: dict) -> str:
    asked = ledger.get("failing_request_at") or {}
    request = ledger.get("failing_request_bytes")
    what = f"asked for {fmt_bytes(request)}" if request else "an allocation failed"
    where = f" at {asked['source']}" if asked.get("source") else ""
    return f"Out of memory on {ledger['device']}: {what}{where}"


def draw_failure(ledger: dict, out: Path, figsize: tuple[float, float] = (11, 5)) -> Path:
    """What was alive at an out-of-memory (``memfit.failure.failure_ledger``'s ledger) as a PNG: a bar of the roles with
    the request that failed marked on top of them, a bar of the activations by block, and the largest holders listed."""
    bars = _failure_bars(ledger)
    total = max(sum(size for _, size, _ in segments) for _, segments in bars) or 1
    unit, scale = _scale(total)
    figure, axes = plt.subplots(figsize=figsize, dpi=100)
    for row, (label, segments) in enumerate(reversed(bars)):
        left = 0.0
        for name, size, colour in segments:
            hatch = "//" if name == "failing request" else None
            axes.barh(row, size / scale, left=left, color=colour, hatch=hatch, edgecolor="white", height=0.6)
            if size / total > 0.04:  # a label that fits inside its segment
                axes.text(left + size / scale / 2, row, name, ha="center", va="center", fontsize=7, color="white")
            left += size / scale
    axes.set_yticks(range(len(bars)), [label for label, _ in reversed(bars)], fontsize=8)
    axes.set_xlabel(f"bytes alive at the failure ({unit})")
    axes.set_title(_failure_title(ledger), fontsize=9)
    largest = [
        f"{fmt_bytes(t['bytes'])}  {t['held_by']}  {t['shape']} {t['dtype']}  {_where_alive(t)}"[:110]
        for t in ledger.get("largest", [])[:5]
    ]
    _corner_list(axes, "largest:", largest, top_left=False, fontsize=6.5)
    return _save_png(figure, out)


def write_failure_page(ledger: dict, out: Path) -> Path:
    """The same as one self-contained HTML page (plotly's JavaScript inlined: opens offline): the two bars, hover for
    each segment's size, and the largest holders in a table."""
    bars = _failure_bars(ledger)
    total = max(sum(size for _, size, _ in segments) for _, segments in bars) or 1
    unit, scale = _scale(total)
    data = [
        {
            "type": "bar",
            "orientation": "h",
            "y": [label],
            "x": [size / scale],
            "name": name,
            "marker": {"color": colour},
            "hovertemplate": f"{html.escape(name)}: {fmt_bytes(size)}<extra></extra>",
        }
        for label, segments in bars
        for name, size, colour in segments
    ]
    layout = {
        "barmode": "stack",
        "title": {"text": html.escape(_failure_title(ledger)), "font": {"size": 12}},
        "xaxis": {"title": {"text": f"bytes alive at the failure ({unit})"}},
    }
    rows = "".join(
        f"<tr><td>{fmt_bytes(t['bytes'])}</td><td>{html.escape(t['held_by'])}</td><td>{t['shape']}</td>"
        f"<td>{t['dtype']}</td><td>{html.escape(_where_alive(t))}</td></tr>"
        for t in ledger.get("largest", [])
    )
    asked = ledger.get("failing_request_at") or {}
    page = (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(_failure_title(ledger))}</title></head>'
        f"<body>{_offline_figure(data, layout, height='45vh')}"
        f"<p>{html.escape(ledger.get('error', ''))}</p>"
        + (
            f"<p>The line that asked: <code>{html.escape(asked['source'])}: {html.escape(asked.get('code', ''))}</code></p>"
            if asked
            else ""
        )
        + "<table><tr><th>bytes</th><th>held by</th><th>shape</th><th>dtype</th><th>where</th></tr>"
        f"{rows}</table></body></html>"
    )
    write_text_whole(out, page)
    return out
