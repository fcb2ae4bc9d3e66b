"""Two runs side by side: what one setting changed in memory, from the two runs' own ledgers.

    python -m memfit.compare out/profiles/<run A> out/profiles/<run B>

Prints each role's difference (B - A) at each phase's peak, both peaks, and a line for each setting that differs
between them (from each run's ``summary.json``); writes ``compare.png`` (both runs' tensor memory over their recorded
step, from their profiler traces) and ``compare.html`` (the same, offline, the table below it) into ``--out``. Every
figure is read from what the two runs measured; nothing is estimated here.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

from memfit.errors import UserError
from memfit.files import write_text_whole
from memfit.observatory.phase_names import LEDGER_PHASES
from memfit.observatory.picture import draw_comparison, tensorboard_card, write_comparison_page
from memfit.trace_events import memory_events, phase_ranges, read_trace_events, trace_files
from memfit.units import fmt_bytes

RUN_AXES = (
    "time in the recorded optimizer step (ms)",
    "allocated in the step ({unit}), above what was alive before it",
)
"""The comparison's axes for two runs: each run's clock"""
PHASE_AXES = (
    "the last micro-batch's phases, each at the same width (an estimate has no clock)",
    "allocated since its forward began ({unit})",
)
"""The comparison's axes where one side is an estimate (``last_micro_batch_by_phase``)"""

SETTINGS_LEFT_OUT = ("out_dir", "profile_dir", "resume", "overwrite")
"""Settings that say where a run wrote, not what it ran: two runs always differ in them"""


def read_run(run_dir: Path) -> dict:
    """A run's ``ledger.json`` and ``summary.json`` (a run dir under ``--profile_dir``), or an estimate's
    ``estimate.json`` (its dir, ``<script>-estimate-...``: the prediction by phase in the ledger's terms, and its
    settings)."""
    run_dir = run_dir_of(Path(run_dir))
    ledger, summary, predicted = run_dir / "ledger.json", run_dir / "summary.json", run_dir / "estimate.json"
    if predicted.is_file() and not ledger.is_file():
        document = _phases_document(predicted)
        summary = {"settings": document.get("settings", {})}
        return {"dir": run_dir, "ledger": document, "summary": summary, "predicted": True}
    if not ledger.is_file():
        raise UserError(
            f"{run_dir} has no ledger.json: give the run dirs of two runs that recorded a step (out/profiles/<run>, with"
            " the profiler window on), or an --estimate's dir"
        )
    return {
        "dir": run_dir,
        "ledger": _phases_document(ledger),
        "summary": _json_object(summary) if summary.is_file() else {},
        "predicted": False,
    }


def run_dir_of(path: Path) -> Path:
    """``path`` itself where it is a run dir; where it is a training ``--out_dir`` (its checkpoints, which a user
    knows), the run dir of the run that wrote its latest checkpoint: the one in that run's ``--profile_dir`` whose
    ``summary.json`` names a checkpoint in the out_dir (the latest such run)."""
    if (path / "ledger.json").is_file() or (path / "estimate.json").is_file() or not path.is_dir():
        return path
    settings = sorted(path.glob("*/hyperparameters.yaml"), key=lambda file: file.stat().st_mtime)
    if not settings:
        return path
    import yaml

    try:
        profile_dir = Path((yaml.safe_load(settings[-1].read_text()) or {}).get("profile_dir") or "")
    except (OSError, yaml.YAMLError):
        return path
    if not profile_dir.is_absolute():
        profile_dir = Path.cwd() / profile_dir  # as the run resolved it: from where it was started, usually here
    written = []
    for summary in profile_dir.glob("*/summary.json") if profile_dir.is_dir() else ():
        try:
            checkpoint = json.loads(summary.read_text()).get("checkpoint")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if checkpoint and Path(checkpoint).resolve().parent == path.resolve():
            written.append(summary.parent)
    if not written:
        raise UserError(
            f"{path} is a training --out_dir, and no run dir in its --profile_dir ({profile_dir}) wrote its"
            " checkpoints; give the run dir (out/profiles/<run>) itself"
        )
    return max(written, key=lambda run: (run / "summary.json").stat().st_mtime)


def _json_object(path: Path) -> dict:
    """A JSON object from ``path``, or one line saying why it is not one."""
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
        raise UserError(
            f"{path} cannot be read as JSON ({reason}): a run stopped while writing it, or the file is damaged; give"
            " another run's dir"
        ) from None
    if not isinstance(document, dict):
        raise UserError(f"{path} holds a JSON {type(document).__name__}, not the object a Memfit run writes")
    return document


def _phases_document(path: Path) -> dict:
    """A ledger (or an estimate's prediction): what the comparison reads, each phase's peak and its roles there."""
    document = _json_object(path)
    phases = document.get("phases")
    missing = [key for key in ("measures", "phases") if key not in document]
    if not missing and isinstance(phases, dict):
        missing = [
            f"phases.{name}.{key}"
            for name, phase in phases.items()
            for key in ("peak_bytes", "found_at_peak_bytes")
            if not isinstance(phase, dict) or key not in phase
        ]
    if missing or not isinstance(phases, dict):
        raise UserError(
            f"{path} is not a ledger Memfit wrote (no {(missing or ['phases'])[0]!r}); give the dir of a run that"
            " recorded a step, or an --estimate's dir"
        )
    return document


def measures(a: dict, b: dict) -> str:
    """What the two columns' figures are: one phrase where both measured the same way, else each's."""
    said = {
        label: run["ledger"]["measures"] + ("" if run["predicted"] else "; the allocations alive at it")
        for label, run in (("A", a), ("B", b))
    }
    return said["A"] if said["A"] == said["B"] else f"A: {said['A']}; B: {said['B']}"


def _flat(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for name, value in settings.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{name}.")
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def differing_settings(a: dict, b: dict) -> list[str]:
    """``--name: A's -> B's`` for each setting (dotted, as its flag) the two runs' summaries differ in."""
    flat_a, flat_b = _flat(a["summary"].get("settings", {})), _flat(b["summary"].get("settings", {}))
    lines = []
    for name in sorted(set(flat_a) | set(flat_b)):
        if name.split(".")[0] in SETTINGS_LEFT_OUT:
            continue
        if flat_a.get(name) != flat_b.get(name):
            lines.append(f"--{name}: {json.dumps(flat_a.get(name))} -> {json.dumps(flat_b.get(name))}")
    return lines


def difference_table(a: dict, b: dict) -> str:
    """Each role's bytes at each phase's peak, B - A, with both runs' peaks under them."""
    phases_a, phases_b = a["ledger"]["phases"], b["ledger"]["phases"]
    phases = [p for p in LEDGER_PHASES if p in phases_a and p in phases_b]
    roles = []
    for phase in phases:
        for role in [*phases_a[phase]["found_at_peak_bytes"], *phases_b[phase]["found_at_peak_bytes"]]:
            if role not in roles:
                roles.append(role)
    width = 18

    def row(name: str, values) -> str:
        return name.ljust(width) + "".join(v.rjust(15) for v in values)

    def found(phases_of, phase, role) -> int:
        return phases_of[phase]["found_at_peak_bytes"].get(role, 0)

    lines = [row("B - A", phases)]
    for role in roles:
        differences = [found(phases_b, p, role) - found(phases_a, p, role) for p in phases]
        if any(differences) or any(found(phases_a, p, role) for p in phases):
            lines.append(row(role, [_signed(d) for d in differences]))
    lines.append(row("peak A", [fmt_bytes(phases_a[p]["peak_bytes"]) for p in phases]))
    lines.append(row("peak B", [fmt_bytes(phases_b[p]["peak_bytes"]) for p in phases]))
    lines.append(row("peak B - A", [_signed(phases_b[p]["peak_bytes"] - phases_a[p]["peak_bytes"]) for p in phases]))
    return "\n".join(lines)


def _signed(size: int) -> str:
    return ("-" if size < 0 else "+" if size > 0 else "") + fmt_bytes(abs(size))


def step_curve(run: dict) -> dict | None:
    """The tensor memory over the recorded step: ``{"ms", "bytes", "phases"}``; None without a trace. A run's is the
    profiler's running total at each allocation and free, from the step's first phase to its last (it starts near
    zero: what was alive before the step is not in it); an estimate's the predicted step's, on its axis of
    allocations (``estimate.json``'s ``step_curve``: it has no clock)."""
    if run["predicted"]:
        curve = run["ledger"].get("step_curve")
        return {"ms": curve["x"], "bytes": curve["bytes"], "phases": curve["phases"]} if curve else None
    traces = trace_files(run["dir"], "rank0")
    if not traces:
        return None
    try:
        events = read_trace_events(traces[-1])
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as error:  # ValueError: JSON's, and no event list
        reason = getattr(error, "strerror", None) or (str(error).splitlines() or [type(error).__name__])[0][:160]
        raise UserError(
            f"{traces[-1]} cannot be read as a profiler trace ({reason}): it may be cut short; compare runs whose"
            " trace is whole, or move it aside to compare the ledgers alone"
        ) from None
    finally:
        read_trace_events.cache_clear()  # the second run's trace is read next
    ranges = [(r["ts"], r["ts"] + r["dur"], r["name"].split("::", 1)[1]) for r in phase_ranges(events)]
    device = 1 if run["ledger"]["device"] == "cuda" else 0
    memory = memory_events(events, device)
    if not ranges or not memory:
        return None
    start, end = ranges[0][0], ranges[-1][1]
    inside = [(t, total) for t, total, *_ in memory if start <= t <= end]
    return {
        "ms": [(t - start) / 1e3 for t, _ in inside],
        "bytes": [total for _, total in inside],
        "phases": [((a - start) / 1e3, (b - start) / 1e3, name) for a, b, name in ranges],
    }


def last_micro_batch_by_phase(curve: dict) -> dict:
    """``curve`` from its last forward on (the estimate traces a step's last micro-batch; a run may record all of
    them), above its level there, with each phase stretched to one unit of the axis (phase i from i to i + 1): an
    estimate's axis counts allocations and a run's milliseconds, so phase by phase is how the two line up."""
    phases = [tuple(phase) for phase in curve["phases"]]
    first = max((i for i, (_, _, name) in enumerate(phases) if name == "forward"), default=0)
    phases = phases[first:]
    starts = [a for a, _, _ in phases]
    entering = max(0, bisect.bisect_right(curve["ms"], starts[0]) - 1)  # the level the last forward starts from
    base = curve["bytes"][entering]
    xs, values = [], []
    for t, size in zip(curve["ms"][entering:], curve["bytes"][entering:], strict=True):
        i = max(0, bisect.bisect_right(starts, t) - 1)
        a, b, _ = phases[i]
        xs.append(i + min(1.0, max(0.0, (t - a) / (b - a))) if b > a else i + 1.0)
        values.append(size - base)
    return {"ms": xs, "bytes": values, "phases": [(i, i + 1, name) for i, (_, _, name) in enumerate(phases)]}


def compare(a_dir: Path, b_dir: Path, out: Path) -> str:
    """The comparison's text (printed), its picture and page written into ``out``."""
    a, b = read_run(a_dir), read_run(b_dir)
    lines = [
        f"A: {a['dir']}",
        f"B: {b['dir']}",
        "Settings that differ:" + ("" if (settings := differing_settings(a, b)) else " none"),
        *(f"  {line}" for line in settings),
        f"Memory of B against A at each phase's peak ({measures(a, b)}):",
        difference_table(a, b),
    ]
    text = "\n".join(lines)
    curves = {label: curve for label, run in (("A", a), ("B", b)) if (curve := step_curve(run)) is not None}
    axes = RUN_AXES
    if a["predicted"] or b["predicted"]:
        curves = {label: last_micro_batch_by_phase(curve) for label, curve in curves.items()}
        axes = PHASE_AXES
    out.mkdir(parents=True, exist_ok=True)
    write_text_whole(out / "compare.txt", text + "\n")
    if curves:
        title = f"A: {a['dir'].name}   B: {b['dir'].name}"
        draw_comparison(curves, title, out / "compare.png", axes)
        write_comparison_page(curves, title, text, out / "compare.html", axes)
        to_tensorboard(out, text, curves, title, axes)
        text += (
            f"\nPicture: {out / 'compare.png'}  Page: {out / 'compare.html'}  (offline; also in TensorBoard's Images and"
            f" Text tabs: tensorboard --logdir {out.parent})"
        )
    return text


def to_tensorboard(out: Path, table: str, curves: dict[str, dict], title: str, axes: tuple[str, str]) -> None:
    """The comparison in TensorBoard beside the runs it compares (``--logdir`` of their profile dir): the picture in
    the Images tab, the table in the Text tab, as a run's own picture and ledger are. The picture is drawn again at
    640 pixels, as a run's is (``memfit.observatory.report.publish_picture``): the tab shrinks the 1100-pixel PNG to its
    card, and its text with it."""
    from torch.utils.tensorboard import SummaryWriter

    image = tensorboard_card(lambda path, figsize: draw_comparison(curves, title, path, axes, figsize=figsize))
    board = SummaryWriter(str(out))
    try:
        board.add_image("comparison", image, dataformats="HWC")
        board.add_text("comparison", f"<pre>{table}</pre>")
    finally:
        board.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memfit.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "a", type=Path, help="the first run's dir (out/profiles/<run>), or the --out_dir holding its checkpoints"
    )
    parser.add_argument("b", type=Path, help="the second run's dir, or its --out_dir")
    parser.add_argument("--out", type=Path, help="where compare.png, .html and .txt go (default: compare-A-B beside A)")
    args = parser.parse_args(argv)
    out = args.out or args.a.parent / f"compare-{args.a.name}-{args.b.name}"
    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {str(out)!r} is a file; give a directory (compare.png, .html and .txt go in it)")
        print(compare(args.a, args.b, out))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the out dir read-only, or its disk full
        why = f"cannot write the comparison into {str(out)!r} ({error.strerror}); give --out a writable directory"
        print(f"error: {why}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
