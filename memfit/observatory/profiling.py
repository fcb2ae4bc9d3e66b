"""A ``torch.profiler`` window counted in optimizer steps, written where TensorBoard's PyTorch Profiler tab reads it.

The window skips the first optimizer steps (the first one allocates the optimizer state, and allocator caches
settle after it), then records ``active`` whole steps — every micro-batch's forward and backward plus the
optimizer step — with memory (Python stacks with ``--profile.with_stack true``, input shapes with
``--profile.record_shapes true``). On CUDA it
also records the allocator's history over the same steps and dumps a snapshot that pytorch.org/memory_viz opens.
"""

from __future__ import annotations

import gc
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from memfit.args import ProfileArgs
from memfit.memory import is_out_of_memory, release_freed_heap
from memfit.progress import quiet_bars, waiting
from memfit.trace_events import trace_files, write_gzipped_trace


@contextmanager
def profiler_starting():
    """Around a call that may start a profiler recording memory: the bars cleared (its start prints a ``USDT`` line on
    stderr), and PyTorch's CPU allocator's line "Memory block of unknown size was allocated before the profiling
    started" said here. The allocator prints it once a process, at the first free under such a profiler of a block made
    before it started, which otherwise falls wherever the run frees one (a batch, between two steps) and runs on from
    the training bar; a block made before the call and freed inside it, with the bars cleared, takes that once."""
    made_before = torch.empty(16)
    with quiet_bars():
        yield
        del made_before


def _optional_trace_writer(run_dir: Path, worker: str):
    """The trace (``memfit.trace_events.write_gzipped_trace``) is optional: failing to write it (a full disk) warns
    and training goes on. torch writes the plain trace through ``<name>.pt.trace.json.tmp`` and may fail without a
    word, leaving that part behind: it is removed, and named."""

    def on_trace_ready(prof) -> None:
        try:
            write_gzipped_trace(prof, run_dir, worker)
        except Exception as error:  # noqa: BLE001
            print(f"warning: could not write the profiler trace ({type(error).__name__}: {error}); training goes on")
        finally:  # a Ctrl-C while it writes (not an Exception) ends the run: its partial file goes all the same
            removed = list(Path(run_dir).glob(f"{worker}.*.pt.trace.json.tmp"))
            for partial in removed:
                partial.unlink(missing_ok=True)
        for partial in removed:
            print(
                f"warning: could not write the profiler trace {partial.with_suffix('')} (the disk may be full): its"
                " partial file is removed; training goes on"
            )

    return on_trace_ready


TRACED_WHOLE_UP_TO_MICRO_BATCHES = 4
"""A recorded step of at most this many micro-batches is traced whole; a longer one from its last micro-batch on (that
one, the optimizer step and zero_grad), the others taken in the profiler's warm-up, which keeps nothing. Traced whole,
the window's host memory grows with the micro-batches: with Python stacks about 35 MiB a micro-batch on the embedded
model (the process's peak RSS 2.77 GB at 64 against 571 MiB at 4), and still about 1 KiB for each allocation event
with operator collection paused (torch's ``toggle_collection_dynamic`` stops operators, not memory events). From the
last micro-batch on, it is one micro-batch's whatever the accumulation (tests/test_profiling.py). The last
micro-batch holds the step's longest samples (the scripts put them there) and the gradients accumulated so far, so
its phases are the step's peaks the ledger explains; the earlier micro-batches' peaks are measured all the same."""


WINDOW_HOST_BYTES = 30 * 2**20
HOST_BYTES_PER_TRACED_ALLOCATION = {False: int(2.4 * 1024), True: 54 * 1024}
WARMUP_HOST_BYTES_PER_ALLOCATION = 10 * 1024
"""The profiler window's host memory: a fixed part (the profiler started), a part for each allocation or free of the
traced micro-batches and optimizer step with the operators recorded around it (``HOST_BYTES_PER_TRACED_ALLOCATION``:
without Python stacks, the default, and with ``--profile.with_stack``, whose recorded Python calls take 20 times more),
and, where the step is traced from its last micro-batch, one micro-batch's records in the profiler's warm-up, dropped
when recording starts. Measured with benchmarks/profiler_window_host.py (the embedded LoRA, micro-batches of 2 x 64
tokens, 32-true: the process's peak RSS with the window on less with it off; profiles/cpu/profiler_window_host.json):
without stacks +35, +40 and +42 MiB at 1, 4 and 8 micro-batches, with stacks +96, +248 and +92 MiB (64 micro-batches,
measured apart: +40 and +90). The
two rates come from the 4-micro-batch step (4,163 allocations and frees in the fake trace), the warm-up's from the
steps traced from their last micro-batch (8 and 64 alike: the warm-up's records do not pile up). These are the
profiler's own data structures, not the model's: figures of this torch (2.13) on this project's CPU machine, which
tests/test_profiling.py measures again."""


def window_host_bytes(phase_events: list[tuple[str, int]], micro_batches: int, with_stack: bool = False) -> int:
    """The host memory the profiler window takes while it records a step of ``micro_batches``, from the fake trace's
    allocations and frees in each phase (``phase_events``, in order; its last forward and backward are one
    micro-batch's): the micro-batches it traces (all, up to ``TRACED_WHOLE_UP_TO_MICRO_BATCHES``; else the last, and
    one more in the warm-up) and the step's other phases; ``with_stack``: the window records Python calls too."""
    last = {name: events for name, events in phase_events}
    per_micro_batch = last.get("forward", 0) + last.get("backward", 0)
    rest = sum(events for name, events in last.items() if name not in ("forward", "backward"))
    traced = micro_batches if micro_batches <= TRACED_WHOLE_UP_TO_MICRO_BATCHES else 1
    warmup = per_micro_batch if micro_batches > TRACED_WHOLE_UP_TO_MICRO_BATCHES else 0
    recorded = (traced * per_micro_batch + rest) * HOST_BYTES_PER_TRACED_ALLOCATION[with_stack]
    return WINDOW_HOST_BYTES + recorded + warmup * WARMUP_HOST_BYTES_PER_ALLOCATION


class ProfilerWindow:
    """Call ``step()`` after each optimizer step; use as a context manager around the training loop."""

    def __init__(
        self,
        args: ProfileArgs,
        run_dir: Path,
        device: torch.device,
        total_steps: int,
        rank: int = 0,
        micro_batches: int = 1,
    ):
        self.run_dir = run_dir
        self.micro_batches = micro_batches
        self.from_last_micro_batch = micro_batches > TRACED_WHOLE_UP_TO_MICRO_BATCHES
        """The recorded step is traced from its last micro-batch on (``record_from_here``), not whole"""
        self.cuda = device.type == "cuda"
        self.snapshot_path: Path | None = None
        self.abandoned = False
        """True once ``abandon`` ended the window: the run has no trace, ledger or picture"""
        self.enabled = args.enabled and total_steps > 0
        self.record_shapes = args.record_shapes
        self.with_stack = args.with_stack
        self.window = args.window(total_steps)
        self.warmup_dropped = self.window[1] < args.warmup
        """A run too short for the asked warm-up: ``schedule`` dropped it (the memory recorded is the same)"""
        self.rank = rank
        self._steps_seen = 0
        self._profiler = None

    def __enter__(self) -> ProfilerWindow:
        if self.enabled:
            # The profiler's objects are in reference cycles (its action map holds its own bound methods), so only
            # a collection of the generation they are in frees them, and by the window's end they have aged into
            # the oldest, whose collection walks every object (0.3 s with torch and lightning loaded). The objects
            # alive now are set aside (frozen) until the window ends, so that full collection is of the window's
            # objects alone. Without it ~90 MiB stayed for the rest of the run.
            gc.freeze()
            wait, warmup, active = self.window
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            with warnings.catch_warnings():
                if self.warmup_dropped:  # torch's warning would blame a choice the user did not make
                    warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
                # traced from the last micro-batch: the recorded step's earlier ones are one more warm-up step of
                # torch's schedule, ended by record_from_here
                steps = schedule(wait=wait, warmup=warmup + self.from_last_micro_batch, active=active, repeat=1)
            self._profiler = profile(
                activities=activities,
                schedule=steps,
                on_trace_ready=_optional_trace_writer(self.run_dir, f"rank{self.rank}"),
                profile_memory=True,
                record_shapes=self.record_shapes,
                with_stack=self.with_stack,
            )
            if self.from_last_micro_batch and self.rank == 0:
                print(
                    f"note: the profiled step has {self.micro_batches} micro-batches: its trace starts at the last"
                    " (the step's longest samples, on the gradients accumulated so far), so the window's host memory"
                    " is one micro-batch's; the earlier ones' peaks are measured without a trace"
                )
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with profiler_starting():
                self._profiler.__enter__()
            self._maybe_record_history()
        return self

    def _maybe_record_history(self) -> None:
        wait, warmup, _ = self.window
        if self.cuda and self._steps_seen == wait + warmup:
            # Python frames only: torch's default (stacks="all") symbolizes C++ frames of every allocation when the
            # snapshot is dumped, inside the recorded step (torchtitan measured ~461 s against ~4 s, its PR #3628);
            # memory_viz still shows each block's Python source, and Memfit's views read no frame of it
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")

    def step(self) -> None:
        if self._profiler is None:
            return
        # the step that ends the window processes its events and writes the trace: seconds on a large model
        ends = self._steps_seen + 1 == sum(self.window)
        with (
            profiler_starting(),
            waiting("profiler: writing the recorded step's trace", enabled=ends and self.rank == 0),
        ):
            self._profiler.step()
        self._steps_seen += 1
        self._maybe_record_history()
        wait, warmup, _ = self.window
        if self.cuda and self._steps_seen == wait + warmup + 1 and self.snapshot_path is None:
            # The allocator's history covers the ledger's step only, the one step that runs with checkpointing's
            # early stop off and the retry guard (``memfit.observatory.phases``): torch 2.11 failed in backward
            # ("run_backward returned NULL") when checkpointed regions recomputed while history was recorded, and a
            # later step of a longer window (--profile.active 2 or more) would have neither.
            self.snapshot_path = self.run_dir / "memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._steps_seen == sum(self.window):  # the window is over and its trace is written
            self._release()

    def _release(self) -> None:
        """Ends the profiler as soon as its window is written: it keeps the window's events (tens of MB of host
        memory on a tiny model, far more on a real one) for as long as it lives, which would otherwise be the rest
        of the run."""
        try:
            with quiet_bars():
                self._profiler.__exit__(None, None, None)
        finally:
            self._profiler = None
            gc.collect()  # of what was created since __enter__ (the rest is frozen): milliseconds
            gc.unfreeze()
            release_freed_heap()

    def abandon(self) -> None:
        """Ends the window early, keeping nothing of it: the recorded step failed under it (``recorded_step``)."""
        if self._profiler is None:
            return
        self.abandoned = True
        # instrumentation that failed once may fail to stop too: the run goes on (_release resets the window's state
        # even then)
        if self.cuda:
            with suppress(Exception):
                torch.cuda.memory._record_memory_history(enabled=None)
        with suppress(Exception):
            self._release()
        # a trace of a step that failed half-way explains nothing and would be read as the ledger's step (this rank's:
        # the other ranks' traces are in the same run dir)
        for trace in self.trace_files():
            if trace.name.startswith(f"rank{self.rank}."):
                trace.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        if self._profiler is not None and is_out_of_memory(exc[1]):
            # Stopping the profiler allocates host memory for the window's events while the failed step's tensors are
            # still alive (its traceback holds them): a CPU run that ran out of memory has none left, and the
            # MemoryError raised here would replace the out-of-memory the run explains. A failed step's trace is
            # abandoned anyway.
            self.abandon()
        if self._profiler is not None:  # the run ended inside the window
            with quiet_bars():
                self._profiler.__exit__(*exc)
            self._profiler = None
            gc.unfreeze()
            if self.cuda and self.snapshot_path is None:
                torch.cuda.memory._record_memory_history(enabled=None)

    def record_from_here(self) -> bool:
        """Starts tracing the recorded step at its last micro-batch (a step of more than
        ``TRACED_WHOLE_UP_TO_MICRO_BATCHES``), and says whether it did: the profiler leaves the warm-up it took the
        earlier micro-batches in. Called once, from ``PhaseMemory.recording``."""
        if self._profiler is None or not self.from_last_micro_batch:
            return False
        with quiet_bars():
            self._profiler.step()
        return True

    @property
    def open(self) -> bool:
        """True while the profiler runs: the window's warm-up and recorded steps."""
        return self._profiler is not None and self._steps_seen >= self.window[0]

    @property
    def recording(self) -> bool:
        """True during the first recorded optimizer step (the one the memory ledger describes)."""
        wait, warmup, _ = self.window
        return self._profiler is not None and self._steps_seen == wait + warmup

    def trace_files(self) -> list[Path]:
        return trace_files(self.run_dir)
