"""The phases of a run (load, the step's forward, backward, optimizer_step and zero_grad, and the run's own: resume,
validation, generation, save), measured as they run.

A script wraps each phase in ``with phases("backward"):``. Every phase records its peak (the probe's peak is reset
at its start) and the reading at its end, and shows as a ``memfit::<phase>`` range in the profiler trace. During
the step the ledger describes (``recording``), each phase is also entered in the ledger with the roles' sizes at its
end and, for forward, the bytes autograd saved for backward. The estimate runs the same phases over fake tensors
with a live-bytes counter as the probe.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TypeVar

import torch
import torch.utils.checkpoint
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import record_function

from memfit.errors import UserError
from memfit.memory import is_out_of_memory
from memfit.observatory.allocator_snapshot import blocks_without_role, device_segments
from memfit.observatory.block_ranges import mark_block_ranges
from memfit.observatory.ledger import Ledger
from memfit.observatory.phase_names import FIRST_OPTIMIZER_STEP, LEDGER_PHASES, RUN_PHASES
from memfit.observatory.roles import SavedActivations, role_addresses, sizes_by_role
from memfit.observatory.run_phases import RunPhaseTensors
from memfit.training.loop_parts import TrainingDiverged

PHASES = ("load", *LEDGER_PHASES, *RUN_PHASES)
"""Every phase a script measures: loading, the optimizer step's (``memfit.observatory.phase_names.LEDGER_PHASES``) and
the run's beside its steps (``RUN_PHASES``)"""
T = TypeVar("T")


def makes_optimizer_state(optimizer) -> bool:
    """Whether ``optimizer``'s next step creates its state: it holds none yet (torch's optimizers and bitsandbytes'
    make it in their first step). ``optimizer.state`` is per parameter; Fabric's wrapper shares it."""
    state = getattr(optimizer, "state", None)
    return state is not None and not any(len(per_param) for per_param in state.values())


def recorded_step(
    take_step: Callable[[], T],
    memory: PhaseMemory,
    ledger: Ledger,
    window,
    optimizer,
    warn: Callable[[str], None],
    micro_batches: int = 1,
) -> T:
    """Takes the step the ledger describes, inside the instrumentation (the profiler window is already recording).

    The instrumentation must never cost a run. If the step fails with an error that training alone does not raise
    (not out-of-memory, divergence or a user's mistake), the window is abandoned, the gradients of the failed attempt
    are dropped, and the same micro-batches are taken again without it; if the step fails again, that error was
    not the instrumentation's and ends the run. On an H100, runs whose recorded step recomputed checkpointed regions
    failed this way (``profiles/gpu/pytest_cuda.json``).
    """
    stepped = []  # whether any optimizer has updated the weights in this attempt (in backward too, for
    # --optimizer_in_backward): after that the step cannot be taken again without applying the update twice
    hook = register_optimizer_step_post_hook(lambda *args: stepped.append(True))
    try:
        with memory.recording(ledger, window, micro_batches):
            result = take_step()
        ledger.update_skipped = not stepped
        return result
    except (TrainingDiverged, UserError):
        raise
    except Exception as error:  # noqa: BLE001  (any other failure here is the instrumentation's until shown otherwise)
        if is_out_of_memory(error):
            raise
        first_line = (str(error).splitlines() or [""])[0][:200]
        failed = f"the recorded step failed under the memory instrumentation ({type(error).__name__}: {first_line})"
        window.abandon()
        optimizer.zero_grad(set_to_none=True)
        if stepped:
            warn(
                f"warning: {failed} after the weights were updated: the step counts, its loss and gradient norm are"
                " not known, and this run has no trace, ledger or memory picture"
            )
            unknown = torch.tensor(float("nan"))
            return unknown, unknown
        warn(f"warning: {failed}; it is taken again without it, and this run has no trace, ledger or memory picture")
        return take_step()
    finally:
        hook.remove()


class PhaseMemory:
    """Peak memory reached inside each phase over the run, and the reading at each phase's end.

    The probe is a ``memfit.memory.MemoryProbe`` (a real run) or ``memfit.prediction.fake_step.LiveBytes`` (fake
    tensors).
    """

    def __init__(self, probe) -> None:
        self.probe = probe
        self.peaks: dict[str, int] = {}
        self.at_end: dict[str, int] = {}
        self.last: dict[str, int] = {}
        """Peak of each phase the last time it ran (the current step's)"""
        self.current = "load"
        """The phase running now: what an out-of-memory error is reported against"""
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.ledger: Ledger | None = None
        self.activations = 0
        """Bytes the latest forward saved for backward (counted while recording)"""
        self.activation_addresses: dict[int, int] = {}
        """Where they are: ``{data_ptr: bytes}``"""
        self.ranges: list[tuple[int, int, str]] = []
        """``(start, end, phase)`` on the probe's clock, while recording (a probe with a clock: the estimate's)"""
        self.window = None
        """The profiler window while recording (``recording``)"""
        self.micro_batches = 1
        self.forwards = 0
        self.micro_batch = 0
        """The step's current micro-batch, from 1 (its forwards counted; zero_grad ends a step): an out-of-memory's
        ledger names the graph it was building"""
        self.paused = False
        self.run_dir: Path | None = None
        """Where an out-of-memory writes what was alive at it (``memfit.failure.failure_ledger``), and this process's
        rank"""
        self.rank = 0
        self.saved_storage_refs: dict = {}
        """Weak references to the storages the latest forward saved (while recording), by the reference's ``id``"""
        self.run_phase_tensors: RunPhaseTensors | None = None
        """CPU: the tensor peaks of the run's phases beside its steps, which RSS cannot tell (``Instruments`` sets it
        where the run profiles)"""

    def watch(self, model: torch.nn.Module, optimizer) -> None:
        """What the ledger and an out-of-memory explanation attribute memory to (parameters, gradients, state), and
        the model's blocks marked as ranges of the profiler's trace (``memfit.observatory.block_ranges``), where there
        is one: a fake step's counter has none."""
        self.model, self.optimizer = model, optimizer
        if getattr(self.probe, "kind", None) != "predicted":
            mark_block_ranges(model)

    @contextmanager
    def recording(self, ledger: Ledger, window=None, micro_batches: int = 1):
        """Enters every phase of the step inside it in ``ledger``. With the profiler ``window`` and a step it traces
        from its last micro-batch (``ProfilerWindow.from_last_micro_batch``: the window's host memory is then one
        micro-batch's whatever the accumulation), the earlier micro-batches' peaks are measured but have no range in
        the trace, so their address maps are not kept; at the last micro-batch the ledger's baseline (what each role
        holds, gradients accumulated so far included) is taken again, where the trace begins."""
        self.window, self.micro_batches, self.forwards = window, micro_batches, 0
        self._take_baseline(ledger)
        if getattr(self.probe, "cuda", False):
            try:  # what the allocator holds that no role explains: the ledger's "not found" has a measured side
                segments = device_segments(self.probe.device)
                ledger.roleless_before_step = blocks_without_role(segments, ledger.baseline_addresses)
            except Exception:  # noqa: BLE001  (optional: the ledger stands without it)
                ledger.roleless_before_step = {}
        self.ledger = ledger
        try:
            # Checkpointed regions recompute in backward, stopped early by an exception raised in the autograd
            # engine's device thread; with CUDA memory history recorded, torch 2.11 turns that into "SystemError:
            # run_backward returned NULL" (PyTorch issue 179536). Without the early stop the recorded step recomputes
            # whole regions: a little more compute, the same tensors kept. recorded_step still guards the step.
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                yield ledger
        finally:
            if self.paused:  # the step ended before its last micro-batch: the window's schedule stays in step
                self.window.record_from_here()
                self.paused = False
            self.ledger, self.window = None, None

    def _take_baseline(self, ledger: Ledger) -> None:
        """What was alive before the trace begins: what each role holds now, by address. Nothing allocated before the
        trace is in a CPU run's profiler events: what is not found here is not counted at all (DDP's buckets are, as
        the gradients they hold: zero_grad keeps those views, ``memfit.training.strategy.keeps_gradient_buckets``)."""
        ledger.baseline_addresses = role_addresses(self.model, self.optimizer)
        ledger.baseline_total = sum(size for _, size in ledger.baseline_addresses.values())

    def _held(self) -> int:
        """Bytes the roles' tensors (parameters, buffers, gradients, optimizer state) hold now: what the ledger's
        baseline counts when a recorded step begins."""
        if self.model is None:
            return 0
        return sum(size for _, size in role_addresses(self.model, self.optimizer).values())

    def _trace_from_the_last_micro_batch(self, name: str) -> None:
        if self.window is None or not self.window.from_last_micro_batch or name != "forward":
            return
        self.forwards += 1
        if self.forwards == 1:
            self.paused = True  # these phases have no range in the trace to match a map against
        if self.forwards == self.micro_batches:
            self.window.record_from_here()
            self.paused = False
            self._take_baseline(self.ledger)  # the trace's replay starts here

    @contextmanager
    def phase(self, name: str):
        if name not in PHASES:  # the ledger, the estimate and the pictures read these names: a typo would drop a phase
            raise ValueError(f"phase {name!r} is not one of {', '.join(PHASES)}")
        self.current = name
        self.micro_batch = 0 if name == "zero_grad" else self.micro_batch + (name == "forward")
        if self.ledger is not None:
            self._trace_from_the_last_micro_batch(name)
        self.probe.reset_peak()
        recording = self.ledger is not None
        start = self.probe.allocated() if recording else 0
        started = getattr(self.probe, "clock", None)
        counting = recording and name == "forward"
        # the step that creates the optimizer's state is also a phase of its own
        first_step = (
            name == "optimizer_step"
            and FIRST_OPTIMIZER_STEP not in self.peaks
            and self.optimizer is not None
            and makes_optimizer_state(self.optimizer)
        )
        measured_as = FIRST_OPTIMIZER_STEP if first_step else name
        measuring = self.run_phase_tensors is not None and measured_as in RUN_PHASES
        try:
            # the phase's range in the trace, for the ledger and the picture
            with (
                record_function(f"memfit::{name}"),
                SavedActivations(self.model) if counting else nullcontext() as saved,
                self.run_phase_tensors.measured(measured_as, self._held) if measuring else nullcontext(),
            ):
                yield
            if counting:
                self.activations, self.activation_addresses = saved.bytes, saved.addresses
                self.saved_storage_refs = saved.storage_refs
                self.ledger.activations = torch.sym_max(self.ledger.activations, saved.bytes)
        finally:
            self.last[name], self.at_end[name] = self.probe.peak_and_current()
            if recording and started is not None:
                self.ranges.append((started, self.probe.clock, name))
            self.peaks[name] = torch.sym_max(self.peaks.get(name, 0), self.last[name])
            if first_step:
                self.last[FIRST_OPTIMIZER_STEP], self.at_end[FIRST_OPTIMIZER_STEP] = self.last[name], self.at_end[name]
                self.peaks[FIRST_OPTIMIZER_STEP] = self.last[name]
            if recording:
                cuda = getattr(self.probe, "cuda", False)
                reserved = torch.cuda.memory_reserved(self.probe.device) if cuda else 0
                # where each role's tensors are now, so the ledger can attribute the allocations alive at the peak
                roles = role_addresses(self.model, self.optimizer)
                # what forward saved is in forward's map only: by a later phase's end some of those addresses are other
                # blocks' (the replay finds a saved block by the map at the first phase end after it was made)
                saved = {ptr: ("activations", size) for ptr, size in self.activation_addresses.items()}
                saved = saved if name == "forward" else {}
                self.ledger.record_phase(
                    name,
                    start,
                    self.probe.allocated(),
                    self.last[name],
                    reserved,
                    sizes_by_role(roles),
                    self.activations,
                    None if self.paused else saved | roles,  # an untraced phase has no range in the trace to match
                )

    def as_dict(self) -> dict:
        return {"measures": self.probe.kind, "peak_bytes": dict(self.peaks), "end_bytes": dict(self.at_end)}
