"""What a run reports once its final checkpoint is saved: the memory ledger, the memory picture, the summary.

All of it is optional work: ``optional`` turns a failure into one warning line, so it never costs a finished run.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.files import write_text_whole
from memfit.memory import release_freed_heap
from memfit.observatory.allocator_snapshot import measure_cublas_workspaces
from memfit.observatory.ledger import Ledger, complete_from_trace
from memfit.observatory.phase_names import RUN_PHASES, TABLE_PHASES
from memfit.observatory.picture import draw_step, tensorboard_card, write_page
from memfit.observatory.timeline import role_timeline
from memfit.progress import waiting
from memfit.trace_events import operator_memory, read_trace_events
from memfit.training.loggers import tensorboards
from memfit.units import fmt_bytes


@dataclass
class RunRecord:
    """What a run's loop records for its report (summary.json and the lines printed at the end)."""

    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    train_seconds: float = 0.0
    tokens_trained: int = 0
    first_step: int = 1
    """The first step this process trained (a resumed run's is past 1): its losses are of this part of the run"""
    settings: dict = field(default_factory=dict)
    """The run's settings as its checkpoints' hyperparameters.yaml has them: what two runs compared differ in"""
    stopped_by: str | None = None
    """What ended the run before its last step (a preemption, Ctrl-C), when it published what it had recorded"""
    window_steps: int = 0
    """The steps the profiler window ran over (its warm-up and recorded steps), their seconds and tokens: the
    summary's tokens/s is given with them and without them"""
    window_seconds: float = 0.0
    window_tokens: int = 0
    compile_seconds: float = 0.0
    """With --compile true: the first step's seconds, torch.compile's compilation included"""
    ledger: Ledger | None = None
    trace_files: list[Path] = field(default_factory=list)
    snapshot: Path | None = None
    picture: dict | None = None
    """What the memory picture of the profiled step states (its PNG, peak and phase), once drawn"""
    last_checkpoint: Path | None = None
    host_per_rank: list[list[int]] = field(default_factory=list)
    """Each rank's host memory after training, in bytes: [peak RSS, anonymous (RssAnon)]"""


def optional(fabric, what: str, function: Callable, *args) -> None:
    """Runs work that must not cost a finished run: an error in it is reported in one line and swallowed.

    What was alive before it (the model, torch, Lightning) is set aside from the garbage collector meanwhile
    (``gc.freeze``): this work creates many objects (the parsed trace, matplotlib's and plotly's), and each full
    collection they trigger would otherwise walk the whole process (about 0.3 s of the 0.8 s after a tiny run).
    Older objects this work drops are collected after it, at the next full collection.

    The heap training freed (the last step's activations) is returned to the OS first, so the trace and the
    pictures are built in it rather than on top of it: the run's peak RSS stays the training's.
    """
    release_freed_heap()
    gc.freeze()
    try:
        with waiting(what, enabled=fabric.is_global_zero):
            function(*args)
    except Exception as error:  # noqa: BLE001  (any failure here is optional work failing)
        first_line = (str(error).splitlines() or [""])[0][:200]
        fabric.print(f"warning: could not {what} ({type(error).__name__}: {first_line}); the checkpoint is saved")
    finally:
        gc.unfreeze()


def _own_trace(record: RunRecord, rank: int) -> Path | None:
    own = [t for t in record.trace_files if t.name.startswith(f"rank{rank}.")]
    return own[-1] if own else None


def complete_ledger(record: RunRecord, rank: int) -> None:
    """Adds what only the profiler trace knows to the ledger (the operator behind each peak; on CPU the peaks).
    (The trace writer made it valid JSON where torch wrote it broken: ``memfit.trace_events.write_gzipped_trace``.)"""
    trace = _own_trace(record, rank)
    if trace is not None and record.ledger is not None and record.ledger.phases:
        if record.ledger.device == "cuda":
            # after training, outside the profiler window and the memory history: freeing the workspaces to find
            # them changes no step the ledger or the picture describe
            try:
                device = torch.device("cuda", torch.cuda.current_device())
                # only those alive when the step began: one made later (another stream's) was not in the step
                record.ledger.cublas_workspaces = {
                    address: size
                    for address, size in measure_cublas_workspaces(device).items()
                    if address in record.ledger.roleless_before_step
                }
            except Exception:  # noqa: BLE001  (without it the workspaces stay in the ledger's "not found")
                record.ledger.cublas_workspaces = {}
        complete_from_trace(record.ledger, trace)


def _write_view(warn, path: Path, text: str) -> None:
    """One view of the run, whole or not at all (``memfit.files``): failing to write it is one warning naming it,
    and what follows (the other views, the run's closing lines) goes on."""
    try:
        write_text_whole(path, text)
    except OSError as error:
        warn(f"warning: could not write {path} ({error.strerror or error}); the checkpoint is saved")


def publish_ledger(fabric, record: RunRecord, run_dir: Path, step: int) -> None:
    """The ledger as JSON in the run dir, as TensorBoard scalars and a text panel, and as a table on stdout."""
    ledger = record.ledger
    if ledger is None or not ledger.phases or fabric.global_rank != 0:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_view(fabric.print, run_dir / "ledger.json", json.dumps(ledger.as_dict(), indent=2))
    # in MiB: a role of a small run read 5.34e-05 in GiB; a 7B model's roles read thousands, still whole
    scalars = {
        f"ledger/{phase}/{role}_mib": size / 2**20
        for phase in ledger.phases
        for role, size in ledger.breakdown(phase).items()
    }
    recorded = ledger.step or step  # the scalars describe the recorded step: logged at it, not at the run's end
    fabric.log_dict(scalars, step=recorded)
    table = ledger.table()
    for logger in fabric.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("memory_ledger", f"<pre>{table}</pre>", global_step=recorded)
    print("\n" + table)


def publish_picture(fabric, record: RunRecord, run_dir: Path, step: int) -> None:
    """The profiled step's memory by role as a PNG (also in TensorBoard's Images tab) and a self-contained HTML page
    in the run dir: all of them work offline."""
    trace = _own_trace(record, fabric.global_rank)
    if trace is None or record.ledger is None or not record.ledger.phases or fabric.global_rank != 0:
        return
    try:
        timeline = role_timeline(record.ledger, trace)
        device_type = 1 if record.ledger.device == "cuda" else 0
        operators, allocations = operator_memory(read_trace_events(trace), device_type)
    finally:
        read_trace_events.cache_clear()  # the ledger and the pictures are done with it: it can be hundreds of MB
    title = f"{run_dir.name}: one optimizer step ({record.ledger.measures})"
    peak_phase = record.ledger.peak_phase()
    biggest = record.ledger.phases[peak_phase].biggest if peak_phase else []
    record.picture = draw_step(timeline, title, run_dir / "memory_step.png", biggest)
    page = write_page(
        timeline, title, run_dir / "memory_step.html", biggest, operators=operators, allocations=allocations
    )
    record.picture["html"] = str(page)
    boards = tensorboards(fabric.loggers)
    if boards:
        # TensorBoard's Images tab shrinks a picture to its card's width: the 1100-pixel PNG's 7-point text became
        # unreadable there, so the tab gets the same drawing at 640 pixels, its text as many points
        image = tensorboard_card(lambda path, figsize: draw_step(timeline, title, path, biggest, figsize=figsize))
        for board in boards:
            board.add_image("memory_step", image, global_step=step, dataformats="HWC")


def _outside_window(record: RunRecord) -> float | None:
    """Tokens/s over the steps the profiler window left alone (None where it ran over every step)."""
    seconds = record.train_seconds - record.window_seconds
    tokens = record.tokens_trained - record.window_tokens
    return tokens / seconds if record.window_steps and tokens > 0 and seconds > 0 else None


def _window_note(summary: dict) -> str:
    """What the Done line's tokens/s includes: every step, the profiler window's too."""
    if not summary["window_steps"]:
        return ""
    outside = summary["tokens_per_s_outside_window"]
    steps = f"{summary['window_steps']} step{'s' if summary['window_steps'] > 1 else ''}"
    if outside is None:
        return " (every step in the profiler window)"
    return f" over every step ({outside:,.0f} without the profiler window's {steps})"


def tensor_peaks(record: RunRecord, memory) -> tuple[dict[str, int], str]:
    """Each phase's peak of tensor memory over the run, and what measured it. CUDA: the allocator's, every phase. CPU:
    the ledger's for the recorded step's phases (its profiler trace) and the run phases' own traces
    (``memfit.observatory.run_phases``); the RSS probe measures neither alone. ``memory``: the run's ``PhaseMemory``."""
    if memory.probe.cuda:
        return {name: int(peak) for name, peak in memory.peaks.items()}, "CUDA allocated"
    peaks = {name: phase.peak for name, phase in record.ledger.phases.items()} if record.ledger else {}
    run_phases = memory.run_phase_tensors.peaks if memory.run_phase_tensors is not None else {}
    return peaks | run_phases, "CPU tensor memory from profiler events"


def run_peak_line(peaks: dict[str, int], measured: str) -> str:
    """The run's peak, naming its phase, with each phase's where there are several kinds (the step's and the run's)."""
    phases = [name for name in ("load", *TABLE_PHASES, *RUN_PHASES) if name in peaks]
    if not phases:
        return ""
    top = max(phases, key=peaks.__getitem__)
    return f"Run's peak ({measured}): {fmt_bytes(peaks[top])} in {top}; " + ", ".join(
        f"{name} {fmt_bytes(peaks[name])}" for name in phases
    )


def write_summary(
    record: RunRecord, memory, script: str, run_dir: Path, profile_dir: Path, steps: int, world_size: int
) -> dict:
    """``summary.json`` in the run dir, and the closing lines on stdout."""
    losses = record.losses
    peaks, measures = tensor_peaks(record, memory)
    summary = {
        "script": script,
        "run": run_dir.name,
        "world_size": world_size,
        "steps": steps,
        "tokens_per_s": record.tokens_trained / record.train_seconds if record.train_seconds else 0.0,
        "tokens_per_s_outside_window": _outside_window(record),
        "window_steps": record.window_steps,
        "compile_seconds": record.compile_seconds,
        "train_seconds": record.train_seconds,
        "tokens_trained": record.tokens_trained,
        "stopped_by": record.stopped_by,
        "first_step": record.first_step,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "val_loss": record.val_losses[-1] if record.val_losses else None,
        "memory": memory.as_dict(),
        "tensor_peak_bytes": peaks,
        "tensor_peak_measures": measures,
        "run_peak_phase": max(peaks, key=peaks.__getitem__) if peaks else None,
        "ledger_peak_bytes": max((r.peak for r in record.ledger.phases.values()), default=None)
        if record.ledger
        else None,
        "profile_traces": [str(p) for p in record.trace_files],
        "memory_snapshot": str(record.snapshot) if record.snapshot else None,
        "memory_picture": record.picture,
        "checkpoint": str(record.last_checkpoint) if record.last_checkpoint else None,
        "settings": record.settings,
        "host_per_rank": [{"peak_rss": peak, "anonymous": anonymous} for peak, anonymous in record.host_per_rank],
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_view(print, run_dir / "summary.json", json.dumps(summary, indent=2))
    measured = "CUDA allocated" if summary["memory"]["measures"] == "cuda_allocated" else "process RSS"
    if world_size > 1:  # the phases are rank 0's; the line below has every rank's
        measured = f"rank 0's {measured}"
    rss_peaks = summary["memory"]["peak_bytes"]
    phases = ("load", *TABLE_PHASES, *RUN_PHASES)
    lines = [
        "",
        (
            f"Stopped by {record.stopped_by} (not finished): {steps} steps"
            if record.stopped_by
            else f"Done: {steps} steps"
        )
        + (f", loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}" if losses else "")
        + (f" over steps {record.first_step}-{steps} (resumed)" if losses and record.first_step > 1 else "")
        + (f" (val {summary['val_loss']:.3f})" if summary["val_loss"] is not None else "")
        + f", {summary['tokens_per_s']:,.0f} tokens/s{_window_note(summary)}"
        + (f"; the first step, compiling, took {record.compile_seconds:.1f} s" if record.compile_seconds else ""),
        f"Peak memory by phase ({measured}): "
        + ", ".join(f"{phase} {fmt_bytes(rss_peaks[phase])}" for phase in phases if phase in rss_peaks),
    ]
    if peaks and not summary["memory"]["measures"] == "cuda_allocated":
        lines.append(run_peak_line(peaks, f"rank 0's {measures}" if world_size > 1 else measures))
    elif peaks:
        lines[-1] += f"; the run's peak in {summary['run_peak_phase']}"
    if record.host_per_rank and (world_size > 1 or summary["memory"]["measures"] == "cuda_allocated"):
        lines.append(
            # over the whole run, so above the phases' figures where validation or a save took more
            "Host memory per rank (peak RSS over the run, validation and saves included; anonymous at the end): "
            + ", ".join(
                f"rank {rank} {fmt_bytes(peak)} ({fmt_bytes(anonymous)})"
                for rank, (peak, anonymous) in enumerate(record.host_per_rank)
            )
        )
    lines += [
        f"Profile:    {run_dir}  "
        + (
            f"(tensorboard --logdir {profile_dir}, PyTorch Profiler tab)"
            if record.trace_files
            else "(the run's metrics and summary; no profiler trace)"
        ),
    ]
    if record.picture:
        lines.append(f"Picture:    {record.picture['png']}  (offline; also in TensorBoard's Images tab)")
        lines.append(f"Page:       {record.picture['html']}  (offline: opens in any browser, hover for details)")
    if record.snapshot:
        lines.append(f"Snapshot:   {record.snapshot}  (open at pytorch.org/memory_viz)")
    lines.append(f"Checkpoint: {record.last_checkpoint}")
    print("\n".join(lines))
    return summary


def run_overview(run, model, data, *, world_size: int, warmup: int) -> str:
    """The run's first line: what trains, the precision and optimizer, the processes and micro-batches of a step, the
    most tokens a step takes and where the longest sample falls, the steps and the warm-up. ``run``: a
    ``memfit.settings.run.Run``; ``data``: its ``memfit.training.data.RunData``."""
    batches, longest_train, max_steps, steps_per_epoch = (
        data.batches,
        data.longest_train,
        data.max_steps,
        data.steps_per_epoch,
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    longest_at = batches.where_longest(run.train.micro_batch_size * run.accumulation)
    never_reached = ", the whole run: --train.lr is never reached" if warmup >= max_steps else ""
    return (
        f"{run.method}: {trainable:,} trainable / {frozen:,} frozen parameters | precision {run.precision}"
        f"{' + ' + run.quantize.name if run.quantize else ''}"
        f" | {run.optimizer.name} | {world_size} process(es) x {run.accumulation} micro-batch(es) of"
        f" {run.train.micro_batch_size} per step | up to {run.train.global_batch_size * longest_train:,} tokens"
        f" per step (longest sample {longest_train}, {longest_at}) | {max_steps} steps ({steps_per_epoch} an"
        f" epoch, warm-up {warmup}{never_reached})"
    )
