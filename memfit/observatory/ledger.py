"""The memory ledger: where the memory of one optimizer step went, by role and by phase, from real allocations.

The ledger describes the profiled optimizer step (see ``memfit.observatory.profiling``). At each phase's peak (forward,
backward, optimizer_step, zero_grad; with accumulation, the micro-batch whose phase peaked highest) it takes the
allocations alive at that moment from the profiler's memory events (each carries its address and size) with
``memfit.observatory.block_lifetimes`` (the same replay the pictures read), and attributes each one by its address:

- parameters (trainable / frozen / quantized), gradients and optimizer state: the storages of the real tensors
  (``parameters()``, ``.grad``, ``optimizer.state``), whose addresses are taken at the end of each phase;
- activations: the storages autograd saved for backward in the micro-batch's forward (``saved_tensors_hooks``);
- tensors alive before the step began (weights, optimizer state) are not in the trace: they are counted by their
  addresses, taken when the step started, unless the trace shows them freed before the peak;
- CUDA: PyTorch's cuBLAS workspaces (``cublas_workspaces``), measured after training by freeing them
  (``measure_cublas_workspaces``), by their addresses.

What the loss's head makes (its chunks' logits and log-softmax) is ``loss``, found by the loss's profiler range.
What matches no role is ``unattributed`` (dequantized weights, optimizer scratch, anything else) and
its biggest allocations are listed with the operator and source line that made each. The role totals are what was
found; the peak is measured (the profiler's running total); ``not found`` is their difference, so an allocation the
ledger misses or counts twice shows instead of being absorbed. On CPU the running total is counted from the window's
start, and the bytes alive when the step began are added to it; on CUDA it is the allocator's own total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from memfit.observatory.block_lifetimes import Roles, alive_at, lifetimes
from memfit.observatory.phase_names import (  # noqa: E402  (the phases' names, defined apart; read here by many)
    LEDGER_PHASES,
)
from memfit.observatory.roles import GATHERED, LOSS, WORKSPACES, counted
from memfit.trace_events import (
    BLOCK_RANGE,
    block_at,
    by_thread,
    gathering_ranges,
    loss_ranges,
    memory_events,
    phase_ranges,
    read_trace_events,
    recompute_ranges,
    where_made,
)
from memfit.units import fmt_bytes


@dataclass
class PhaseRecord:
    start: int = 0
    end: int = 0
    peak: int = 0
    reserved: int = 0
    roles_at_end: dict = field(default_factory=dict)
    """Bytes each role held when the phase ended (what the estimate's model of its trace reads)"""
    activations: int = 0
    """Saved for backward by this phase's micro-batch (forward and backward only)"""
    beside_weights: dict = field(default_factory=dict)
    """Predicted only: the most bytes alive at a product with a linear layer's weight, by ``(rows, columns, in the
    head, an input's gradient)``, where a quantized layer holds its dequantized copy beside them
    (``memfit.prediction.fake_step.LiveBytes.weight_products``)"""
    found: dict = field(default_factory=dict)
    """Bytes alive at the peak that belong to each role, and ``unattributed`` (from the trace)"""
    biggest: list = field(default_factory=list)
    """The largest allocations alive at the peak: bytes, role, operator, the block that made it and source line"""
    by_block: dict = field(default_factory=dict)
    """Bytes alive at the peak by the transformer block whose forward or backward made them
    (``memfit.observatory.block_ranges``): ``transformer.h.3``, ``transformer.h.3 backward``, ``outside the blocks``
    or ``before the step``; what a compiled block's fused kernels made is found here, not by its operator"""

    @property
    def not_found(self) -> int:
        return self.peak - sum(self.found.values())


@dataclass
class Ledger:
    """Filled during the profiled step by the phases, completed from the trace after the window."""

    device: str
    measures: str
    baseline_total: int = 0
    """Bytes of parameters, gradients and optimizer state alive when the step began (CPU traces count from there)"""
    baseline_addresses: dict = field(default_factory=dict)
    """``{data_ptr: (role, bytes)}`` of the role tensors alive when the step began"""
    phases: dict = field(default_factory=dict)
    addresses: dict = field(default_factory=dict)
    """phase -> one ``{data_ptr: (role, bytes)}`` per time the phase ran in the step, taken at its end"""
    activations: int = 0
    sequence_length: int = 0
    """The widest micro-batch of the step, in tokens (an estimate for the same shapes can be compared)"""
    step: int = 0
    """The optimizer step recorded, counted from 1 over the whole run (a resumed run's too)"""
    load_peak: int = 0
    complete: bool = False
    roleless_before_step: dict = field(default_factory=dict)
    """CUDA: ``{address: bytes}`` of the allocator's blocks alive when the step began that hold no role's tensor, read
    from the allocator: allocations the step did not make and no role explains, such as library workspaces"""
    cublas_workspaces: dict = field(default_factory=dict)
    """CUDA: ``{address: bytes}`` of the cuBLAS workspaces alive since before the step, measured after training
    (``measure_cublas_workspaces``)"""
    untraced_peaks: dict = field(default_factory=dict)
    """phase -> the highest peak of its earlier micro-batches, which a step traced from its last micro-batch measures
    but does not trace: on CUDA (where both are the allocator's) the table says when one peaked above the traced one"""
    update_skipped: bool = False
    """The step's optimizer did not update the weights: 16-mixed's gradient scaler skips the update when the scaled
    gradients overflow (often in a run's first steps), so the optimizer_step phase then holds none of its memory"""

    @property
    def before_step_without_role(self) -> list[int]:
        """The sizes of ``roleless_before_step``, largest first"""
        return sorted(self.roleless_before_step.values(), reverse=True)

    def record_phase(
        self,
        name: str,
        start: int,
        end: int,
        peak: int,
        reserved: int,
        roles: dict,
        activations: int = 0,
        addresses: dict | None = None,
    ) -> None:
        if addresses is None:  # a phase the trace did not collect (an earlier micro-batch): nothing to break down
            self.untraced_peaks[name] = max(self.untraced_peaks.get(name, 0), peak)
            return
        self.addresses.setdefault(name, []).append(addresses)
        previous = self.phases.get(name)
        if previous is None or peak >= previous.peak:
            self.phases[name] = PhaseRecord(
                start=start,
                end=end,
                peak=peak,
                reserved=reserved,
                roles_at_end=roles,
                activations=activations if name in ("forward", "backward") else 0,
            )

    def breakdown(self, name: str) -> dict[str, int]:
        """What was found alive at the phase's peak, by role, with ``unattributed`` (empty until completed)."""
        return dict(self.phases[name].found)

    def peak_phase(self) -> str | None:
        return max(self.phases, key=lambda n: self.phases[n].peak) if self.phases else None

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "measures": self.measures,
            "complete": self.complete,
            "load_peak_bytes": self.load_peak,
            "activations_saved_bytes": self.activations,
            "step": self.step,
            "sequence_length": self.sequence_length,
            "peak_phase": self.peak_phase(),
            "before_step_without_role_bytes": self.before_step_without_role,
            "cublas_workspaces_bytes": sorted(self.cublas_workspaces.values(), reverse=True),
            "untraced_micro_batches_peak_bytes": dict(self.untraced_peaks),
            "update_skipped": self.update_skipped,
            "phases": {
                name: {
                    "start_bytes": r.start,
                    "end_bytes": r.end,
                    "peak_bytes": r.peak,
                    "allocator_reserve_bytes": max(0, r.reserved - r.end) if r.reserved else None,
                    "found_at_peak_bytes": self.breakdown(name),
                    "not_found_bytes": r.not_found if r.found else None,
                    "biggest_at_peak": r.biggest,
                    "alive_at_peak_by_block_bytes": r.by_block,
                }
                for name, r in self.phases.items()
            },
        }

    def table(self) -> str:
        if not self.phases:
            return "Memory ledger: no profiled step (the profiler window was disabled or the run too short)."
        if not self.complete:
            return "Memory ledger: the profiler trace could not be read, so the allocations at the peaks are unknown."
        phases = [p for p in LEDGER_PHASES if p in self.phases]
        width = 18
        lines = [
            f"Memory ledger of one optimizer step (step {self.step}, its longest sample {self.sequence_length} tokens;"
            f" {self.measures}; the allocations alive at each phase's peak):",
            "role".ljust(width) + "".join(p.rjust(15) for p in phases),
        ]
        rows = counted(
            gathered=any(self.phases[p].found.get(GATHERED) for p in phases),
            workspaces=any(self.phases[p].found.get(WORKSPACES) for p in phases),
            loss=any(self.phases[p].found.get(LOSS) for p in phases),
        )
        for role in rows:
            lines.append(
                role.ljust(width) + "".join(fmt_bytes(self.phases[p].found.get(role, 0)).rjust(15) for p in phases)
            )
        lines.append(
            "found".ljust(width) + "".join(fmt_bytes(sum(self.phases[p].found.values())).rjust(15) for p in phases)
        )
        lines.append("peak (measured)".ljust(width) + "".join(fmt_bytes(self.phases[p].peak).rjust(15) for p in phases))
        lines.append("not found".ljust(width) + "".join(fmt_bytes(self.phases[p].not_found).rjust(15) for p in phases))
        if any(self.phases[p].reserved for p in phases):
            lines.append(
                "allocator reserve".ljust(width)
                + "".join(fmt_bytes(max(0, self.phases[p].reserved - self.phases[p].end)).rjust(15) for p in phases)
            )
        if self.before_step_without_role:
            blocks = self.before_step_without_role
            shown = ", ".join(fmt_bytes(size) for size in blocks[:4]) + (
                f" and {len(blocks) - 4} more" if len(blocks) > 4 else ""
            )
            workspaces = self.cublas_workspaces.values()
            lines.append(
                f"Alive since before the step and no parameter, gradient or optimizer state (CUDA allocator"
                f" blocks): {fmt_bytes(sum(blocks))} in {shown}"
                + (
                    f"; of these, cuBLAS workspaces (freed after training to measure them): {len(workspaces)}"
                    f" of {fmt_bytes(sum(workspaces))}"
                    if workspaces
                    else ""
                )
            )
        higher = {
            name: untraced
            for name, untraced in self.untraced_peaks.items()
            if name in self.phases and untraced > self.phases[name].peak
        }
        if higher and self.device == "cuda":  # on CPU the untraced peaks are RSS, the columns the trace's tensors
            shown = ", ".join(f"{name} {fmt_bytes(untraced)}" for name, untraced in higher.items())
            lines.append(
                f"An earlier micro-batch of the step peaked higher, untraced: {shown} (the columns are of the last"
                " micro-batch, where the trace starts; the run's peak counts them all)"
            )
        if self.update_skipped:
            lines.append(
                "This step's weight update was skipped (16-mixed's gradient scaler found overflowed gradients), so"
                " optimizer_step holds no update's memory: a step that updates adds the optimizer's own (--estimate"
                " shows it; profile a later step with --profile.wait)"
            )
        peak = self.peak_phase()
        lines.append(f"Biggest allocations alive at the highest peak ({peak}, {fmt_bytes(self.phases[peak].peak)}):")
        for item in self.phases[peak].biggest:
            where = "  ".join(part for part in (item["op"], item.get("block", ""), item["source"]) if part)
            lines.append(f"  {fmt_bytes(item['bytes']):>11}  {item['role']:<17} {where}")
        if self.phases[peak].by_block:
            lines.append(f"Alive at it by what made it: {_by_block_line(self.phases[peak].by_block)}")
        return "\n".join(lines)


def _by_block_line(by_block: dict[str, int]) -> str:
    """``by_block`` in one line: the blocks' forwards and backwards each as one figure (a 32-block model's would be 64
    entries), then what was made outside them and before the step."""
    parts = []
    for kind in ("forward", "backward"):
        sizes = [
            size
            for name, size in by_block.items()
            if name.startswith("transformer.h.") and name.endswith(" backward") == (kind == "backward")
        ]
        if not sizes:
            continue
        each = (
            fmt_bytes(sizes[0]) if min(sizes) == max(sizes) else f"{fmt_bytes(min(sizes))} to {fmt_bytes(max(sizes))}"
        )
        parts.append(f"{len(sizes)} block(s)' {kind} {each} each ({fmt_bytes(sum(sizes))})")
    for name in ("outside the blocks", "before the step"):
        if by_block.get(name):
            parts.append(f"{name} {fmt_bytes(by_block[name])}")
    return ", ".join(parts)


def _earlier_profilers_frees_undone(memory: list[tuple], baseline: set) -> list[tuple]:
    """CPU ``memory`` with the running total kept up where the window frees a block an earlier profiler in the
    process saw made (a run phase's trace, ``memfit.observatory.run_phases``): the CPU allocator remembers the size
    of every block made while a profiler watched, so the free shows in the window's count, whose start already left
    that block out (``cpu_offset``). A block the step began with by address (``baseline``) is in the measured peak:
    its free counts. Measured: a 2-byte block made in the first optimizer step's trace and freed in the recorded
    step put the signature run's ledger 2 bytes under what it found, in every phase."""
    made, undone, counted = set(), 0, []
    for ts, total, size, addr, thread in memory:
        if size > 0:
            made.add(addr)
        elif addr not in made and addr not in baseline:
            undone -= size
        counted.append((ts, total + undone, size, addr, thread))
    return counted


def complete_from_trace(ledger: Ledger, trace: Path, listed: int = 6) -> None:
    """Finds the allocations alive at each phase's peak in the trace and attributes them (see the module doc)."""
    events = read_trace_events(trace)
    device_type = 1 if ledger.device == "cuda" else 0
    memory = memory_events(events, device_type)
    ops = by_thread(e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    frames = by_thread(e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function")
    ranges = phase_ranges(events)
    gathering, in_loss = gathering_ranges(events), loss_ranges(events)
    roles = Roles(
        ledger,
        [(r["ts"] + r["dur"], r["name"].split("::", 1)[1]) for r in ranges],
        memory,
        gathering,
        recompute_ranges(events),
        in_loss,
    )
    blocks = lifetimes(memory, roles.before_step)
    # each thread's block ranges alone: every allocation alive at a peak is looked up in them
    block_ops = by_thread(
        e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(BLOCK_RANGE)
    )
    cpu_offset, counted_memory = 0, memory
    if device_type == 0 and memory:
        counted_memory = _earlier_profilers_frees_undone(memory, set(ledger.baseline_addresses))
        # The CPU total is PyTorch's count of the blocks it recorded while a profiler watched memory and that are
        # still alive: from this window's start, plus any an earlier profiler in the process left alive. The measured
        # peak is the bytes alive when the step began (by address) and what the window added to the count.
        _, total, size, *_ = memory[0]
        cpu_offset = ledger.baseline_total - (total - size)
    for name, record in ledger.phases.items():
        occurrences = [r for r in ranges if r["name"] == f"memfit::{name}"]
        best = None
        for r in occurrences:
            inside = [(ts, total) for ts, total, *_ in counted_memory if r["ts"] <= ts <= r["ts"] + r["dur"]]
            if inside:
                ts, total = max(inside, key=lambda item: item[1])
                if best is None or total > best[1]:
                    best = (ts, total, r)
        if best is None:  # nothing allocated inside the phase (e.g. the optimizer step ran inside backward)
            r = occurrences[0] if occurrences else None
            before = [t for ts, t, *_ in counted_memory if r is not None and ts < r["ts"]]
            best = (r["ts"] if r else 0, before[-1] if before else 0, r)
        peak_ts, total, r = best
        if device_type == 0:
            before = [t for ts, t, *_ in counted_memory if r is not None and ts < r["ts"]]
            after = [t for ts, t, *_ in counted_memory if r is not None and ts <= r["ts"] + r["dur"]]
            record.start = cpu_offset + (before[-1] if before else 0)
            record.end = cpu_offset + (after[-1] if after else 0)
            record.peak = cpu_offset + total
        alive = alive_at(blocks, peak_ts, roles)
        record.found = dict.fromkeys(
            counted(gathered=bool(gathering), workspaces=bool(ledger.cublas_workspaces), loss=bool(in_loss)), 0
        )
        for block, role in alive:
            record.found[role] += block.size
        # which transformer block made each (a compiled block's kernels have no operator or line of their own); ""
        # outside every block, None before the step
        made_in = {
            id(block): block_at(block.made, block.thread, block_ops) if block.made is not None else None
            for block, _ in alive
        }
        record.by_block = {}
        for block, _ in alive:
            where = made_in[id(block)]
            where = "before the step" if where is None else where or "outside the blocks"
            record.by_block[where] = record.by_block.get(where, 0) + block.size
        record.biggest = []
        for block, role in sorted(alive, key=lambda item: -item[0].size)[:listed]:
            op, source = (
                where_made(block.made, block.thread, r["tid"] if r else None, ops, frames)
                if block.made is not None
                else ("allocated before the step", "")
            )
            made = made_in[id(block)] or ""
            record.biggest.append({"bytes": block.size, "role": role, "op": op, "block": made, "source": source})
    ledger.complete = True
