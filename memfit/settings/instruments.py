"""Everything that measures a run, as one object the script calls a few times: each phase's memory, the profiler
window and its recorded step, the ledger, the per-step memory scalars and the report written after the run.

With profiling off the window never records, so ``Instruments.step`` is the step itself: the loop has no profiling
branch and no profiling arithmetic (torchtune's ``DummyProfiler`` idea, kept in one place).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from memfit.memory import MemoryProbe, proc_status
from memfit.observatory.ledger import Ledger
from memfit.observatory.phase_names import LEDGER_PHASES
from memfit.observatory.phases import PhaseMemory, recorded_step
from memfit.observatory.profiling import ProfilerWindow
from memfit.observatory.report import (
    RunRecord,
    complete_ledger,
    optional,
    publish_ledger,
    publish_picture,
    write_summary,
)
from memfit.observatory.run_phases import RunPhaseTensors
from memfit.settings.run import Run
from memfit.training.checkpoint import plain_hparams
from memfit.training.signals import Preempted
from memfit.training.strategy import note_bucket_copies


class Instruments:
    def __init__(self, fabric, run: Run, run_dir: Path) -> None:
        self.fabric, self.run, self.run_dir = fabric, run, run_dir
        self.memory = PhaseMemory(MemoryProbe(fabric.device))
        """Peak memory of each phase (load, forward, backward, ...): what the out-of-memory explanation reads too"""
        self.memory.run_dir, self.memory.rank = run_dir, fabric.global_rank
        if fabric.device.type == "cpu" and run.profile.enabled:  # CUDA's allocator measures them as it does a step
            self.memory.run_phase_tensors = RunPhaseTensors(run_dir, fabric.global_rank)
        self.record = RunRecord(settings=plain_hparams(run.hparams))
        """What the run reports at its end (summary.json, the closing lines); ``setup()`` returns it"""
        self.window: ProfilerWindow | None = None

    def phase(self, name: str):
        """``with instruments.phase("load"):`` measures the phase's memory: a step's phases go through ``step``, the
        run's others (load, resume, validation, generation, save; the first optimizer step is its step's) through this
        (``memfit.observatory.phases.PhaseMemory.phase``)."""
        return self.memory.phase(name)

    def watch(self, model, optimizer) -> None:
        """The model and optimizer whose tensors the ledger names by role (DDP's buckets too, where they are a copy of
        the gradients: ``memfit.training.strategy.note_bucket_copies``)."""
        note_bucket_copies(model)
        self.memory.watch(model, optimizer)

    @contextmanager
    def steps(self, first_step: int, max_steps: int):
        """Around the training loop: the profiler window, counted in optimizer steps from ``first_step`` (a resumed
        run's); its first recorded step is the one the ledger explains. The loop's seconds are counted here, so a
        run stopped part-way reports its speed as a finished one does."""
        fabric = self.fabric
        started = time.perf_counter()
        self.record.first_step = first_step + 1
        self.window = ProfilerWindow(
            self.run.profile,
            self.run_dir,
            fabric.device,
            max_steps - first_step,
            fabric.global_rank,
            micro_batches=self.run.accumulation,
        )
        if self.memory.run_phase_tensors is not None:
            self.memory.run_phase_tensors.window_open = lambda: self.window.open
        measures = "CUDA allocated" if fabric.device.type == "cuda" else "CPU tensor memory from profiler events"
        self.record.ledger = Ledger(
            device=fabric.device.type, measures=measures, load_peak=self.memory.peaks.get("load", 0)
        )
        try:
            with self.window:
                yield
        except Preempted as stop:
            # a preempted (or once Ctrl-C'd) run keeps the views of the step it recorded: they are why it was
            # profiled. The stop reaches every rank at the same step (``memfit.training.signals``), so the collectives
            # of ``publish`` meet. A second Ctrl-C (KeyboardInterrupt) means at once: nothing more is written
            self.record.train_seconds = time.perf_counter() - started
            if self.record.ledger is not None and self.record.ledger.phases:
                self.record.trace_files, self.record.snapshot = self.window.trace_files(), self.window.snapshot_path
                self.record.stopped_by = str(stop)
                self.publish(self.record.first_step - 1 + len(self.record.losses))
            raise
        self.record.train_seconds = time.perf_counter() - started
        self.record.trace_files, self.record.snapshot = self.window.trace_files(), self.window.snapshot_path

    def step(self, train_step, optimizer, micro_batches: list[dict], **kwargs):
        """``train_step(micro_batches=..., phases=..., **kwargs)``, recorded for the ledger where the window records
        this step. Returns what the step returns (its loss and gradient norm)."""
        take_step = partial(
            train_step, optimizer=optimizer, micro_batches=micro_batches, phases=self.memory.phase, **kwargs
        )
        in_window, started = self.window.open, time.perf_counter()
        compiles = self.run.compile and not self.record.compile_seconds  # torch.compile runs in the first step
        if compiles:
            self._say(
                "Compiling: this first step compiles the model's blocks with torch.compile (a new sequence length"
                " or validation may compile again)"
            )
        result = self._taken(take_step, optimizer, micro_batches, kwargs.get("step", 0))
        self.window.step()  # the window's last step writes its trace: counted in the window's seconds
        if compiles:
            self.record.compile_seconds = time.perf_counter() - started
            self._say(f"Compiled in {self.record.compile_seconds:.1f} s (the first step, compilation included)")
        tokens = sum(b["input_ids"].numel() for b in micro_batches) * self.fabric.world_size
        self.record.tokens_trained += tokens
        if in_window:
            self.record.window_steps += 1
            self.record.window_seconds += time.perf_counter() - started
            self.record.window_tokens += tokens
        return result

    def _taken(self, take_step, optimizer, micro_batches: list[dict], step: int):
        """The step taken, recorded for the ledger where the window records it."""
        if not self.window.recording:
            return take_step()
        self.record.ledger.sequence_length = max(batch["input_ids"].shape[1] for batch in micro_batches)
        self.record.ledger.step = step
        # taken again without the instrumentation if it fails under it: the run never pays for the ledger; a long
        # step traced from its last micro-batch on, so the window's host memory stays bounded
        result = recorded_step(
            take_step=take_step,
            memory=self.memory,
            ledger=self.record.ledger,
            window=self.window,
            optimizer=optimizer,
            warn=self.fabric.print,
            micro_batches=len(micro_batches),
        )
        if self.window.abandoned:
            self.record.ledger = None
        return result

    def _say(self, line: str) -> None:
        # above the loop's progress bar, which tqdm redraws below it (a plain print would end up inside the bar)
        if self.fabric.is_global_zero:
            tqdm.write(line)

    def step_peak(self) -> int:
        """The last step's highest phase peak (bytes): of its own phases, not a validation's or a save's."""
        return max((self.memory.last[name] for name in LEDGER_PHASES if name in self.memory.last), default=0)

    def scalars(self) -> dict[str, float]:
        """The memory scalars logged with each step's loss."""
        return {"memory/step_peak_gib": self.step_peak() / 2**30, **self.memory.probe.scalars()}

    def publish(self, steps: int) -> RunRecord:
        """After the run is saved: the ledger completed from the trace and written, the picture drawn, the loggers
        flushed, the summary written. Each is optional: a failure in it is a warning, never a lost run."""
        fabric, record, run_dir = self.fabric, self.record, self.run_dir
        # every rank's host memory, which rank 0 reports: on a node the ranks share its RAM, and one rank's reading
        # says nothing of the others' (each loads and gathers its own)
        status = proc_status()
        mine = [self.memory.probe.host_peak(), status.get("RssAnon", 0)]
        gathered = fabric.all_gather(torch.tensor(mine, dtype=torch.int64, device=fabric.device))
        record.host_per_rank = gathered.reshape(-1, 2).cpu().tolist()  # (ranks, 2): peak RSS, anonymous now
        optional(fabric, "complete the ledger from the profiler trace", complete_ledger, record, fabric.global_rank)
        optional(fabric, "publish the memory ledger", publish_ledger, fabric, record, run_dir, steps)
        optional(fabric, "draw the memory picture", publish_picture, fabric, record, run_dir, steps)
        for logger in fabric.loggers:  # Fabric leaves flushing to us; the CSV logger would otherwise lose its rows
            optional(fabric, "flush the logger", logger.finalize, "success")
        if fabric.global_rank == 0:
            optional(
                fabric,
                "write the run summary",
                write_summary,
                record,
                self.memory,
                self.run.method,
                run_dir,
                run_dir.parent,
                steps,
                fabric.world_size,
            )
        return record
