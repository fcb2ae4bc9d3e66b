"""The tensor memory of the run's phases beside its steps (``memfit.observatory.phase_names.RUN_PHASES``: resume, the
first optimizer step, validation, generation, save), measured on CPU.

On CUDA every phase's peak is the allocator's (``max_memory_allocated``), so a validation's or a save's is measured
as a step's is. A CPU process has no allocator to ask: its probe reads RSS, which counts Python, the libraries and
the heap's free pages beside the tensors. So the first time each run phase runs on CPU it runs under a profiler with
memory events, and its tensor peak is:

- the bytes the roles' tensors hold when it begins (parameters, buffers, gradients, optimizer state, by storage:
  ``memfit.observatory.roles.role_addresses``), which a trace started there does not see being made, plus
- how far the trace's running total of allocations less frees (the CPU allocator's count:
  ``memfit.trace_events.memory_events``) rose above where it stood at the trace's start, or above a lower point
  the phase reached first (a tensor made before the phase and freed in it is not part of the phase's rise).

The trace is kept (``run_phases/rank<N>.<phase>.<ns>.trace.json.gz`` in the run dir: Perfetto and chrome://tracing
open it; named without TensorBoard's ``.pt`` so that its profiler tab keeps to the step's window), so where a save or
a validation peaked can be looked up operator by operator. Later runs of the same phase are not traced again, as each
trace costs its time: what they make is what the first made (a validation's batches, the sample's cache, a
checkpoint's state dict), on top of what the roles hold then (after the first step, the optimizer's state too), so
their peak is that rise on their own start. A phase run while the profiler window records (a validation between two
recorded steps) is left to the next time: two profilers cannot run at once.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.memory import release_freed_heap
from memfit.observatory.profiling import profiler_starting
from memfit.progress import quiet_bars
from memfit.trace_events import memory_events, read_trace_events, write_gzipped_trace

RUN_PHASES_DIR = "run_phases"
CPU_DEVICE_TYPE = 0
"""The profiler's device type of CPU memory events"""


class RunPhaseTensors:
    """Measures each run phase's CPU tensor peak the first time it runs (``measured``); ``peaks`` holds them."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir = Path(run_dir) / RUN_PHASES_DIR
        self.rank = rank
        self.peaks: dict[str, int] = {}
        """phase -> bytes of tensor memory at its highest peak over the run"""
        self.rise: dict[str, int | None] = {}
        """phase -> how far its traced run rose above what the roles' tensors held when it began (None: its trace
        could not be written)"""
        self.traces: dict[str, Path] = {}
        self.window_open: Callable[[], bool] = lambda: False
        """Whether the profiler window runs now, warming up or recording (``Instruments`` sets it): a phase run then
        (the first step's optimizer step in a short run's window) is left to the next time. A warming-up profiler
        is not yet enabled, and a second one started beside it ended the process (SIGSEGV)"""

    @contextmanager
    def measured(self, name: str, held: Callable[[], int]):
        """Around a run of phase ``name``; ``held()``: the bytes the roles' tensors hold now."""
        start = held()
        if name in self.rise or torch._C._autograd._profiler_enabled() or self.window_open():
            yield
            if self.rise.get(name) is not None:
                self.peaks[name] = max(self.peaks[name], start + self.rise[name])
            return
        # The profiler's objects are in reference cycles, which only a collection frees: the objects alive now are
        # set aside (frozen) so that the collection after the trace is of its own objects, in milliseconds (as the
        # profiler window does, memfit.observatory.profiling). Without it the process kept about 60 MiB more RSS.
        gc.freeze()
        try:
            # no Python frames, no shapes: the memory events and the operators that made them are what is read
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            # its start and stop print lines on stderr; the bars are cleared around them only (a bar made inside the
            # phase would wait for the lock that clearing holds)
            with profiler_starting():
                prof.start()
            try:
                yield
            finally:
                with quiet_bars():
                    prof.stop()
            rise, trace = self._rise_from(prof, name)
            del prof
        finally:
            gc.collect()
            gc.unfreeze()
            release_freed_heap()
        self.rise[name] = rise  # None: not measured, nor tried again
        if rise is not None:
            self.peaks[name] = max(self.peaks.get(name, 0), start + rise)
            self.traces[name] = trace

    def _rise_from(self, prof, name: str) -> tuple[int | None, Path | None]:
        """The phase's rise, from its trace written to the run dir; a trace that cannot be written or read (a full
        disk) is one warning and no figure: the measuring never costs the run."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            written = write_gzipped_trace(prof, self.run_dir, f"rank{self.rank}.{name}")
            # named without ".pt": TensorBoard's profiler tab would list each as a run of its own beside the step's
            trace = written.rename(written.with_name(written.name.replace(".pt.trace.json", ".trace.json")))
            memory = memory_events(read_trace_events(trace), CPU_DEVICE_TYPE)
        except Exception as error:  # noqa: BLE001  (optional: the run goes on without this figure)
            print(
                f"warning: could not write the {name} phase's trace ({type(error).__name__}: {error}); its tensor"
                " memory is not measured, and training goes on"
            )
            return None, None
        finally:  # torch writes through a .tmp of its own and may leave it behind when it fails
            for partial in self.run_dir.glob(f"rank{self.rank}.{name}.*.pt.trace.json.tmp"):
                partial.unlink(missing_ok=True)
        # the count goes on from where an earlier trace left it (what was made under it and freed outside): the rise
        # is from the count just before this trace's first event, or from a lower count the phase reached before it
        # made its peak. A tensor made before the phase and freed in it (the last step's loss; a block another thread
        # lets go) is not the phase's making: measured from the start, its free hid that much of the phase's peak.
        lowest = memory[0][1] - memory[0][2] if memory else 0
        rise = 0
        for _, total, _, _, _ in memory:
            lowest = min(lowest, total)
            rise = max(rise, total - lowest)
        return rise, trace
