"""The memory ledger: where the memory of one optimizer step went, by role and by phase.

The ledger describes the profiled optimizer step (see ``memfit.profiling``). For each phase (forward, backward,
optimizer_step, zero_grad; with accumulation, the micro-batch whose phase peaked) it gives the allocated memory
at the phase's start and end, the peak inside it, the operator running when that peak was reached, and the peak
split by role:

- parameters (trainable / frozen / quantized), gradients and optimizer state: sizes of the real tensors
  (``parameters()``, ``.grad``, ``optimizer.state``), deduplicated by storage;
- activations: what autograd saved for backward during the step's forward (``saved_tensors_hooks``);
- temporaries: the rest of the peak (transient buffers: logits chunks, dequantized weights, foreach scratch).

Role sizes are attributed in that order and capped by the peak, so the roles always add up to the measured peak.
The peak is the CUDA allocator's ``max_memory_allocated`` with the peak reset per phase, or on CPU the profiler's
memory events (allocations since the window started, plus the tensors alive when it started). The allocator's
reserve (reserved - allocated) is reported beside it on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.memory import fmt_bytes
from memfit.profiling import read_trace_events
from memfit.quantize import is_quantized_parameter

ROLES = ("params_trainable", "params_frozen", "params_quantized", "gradients", "optimizer_state", "activations",
         "temporaries")
LEDGER_PHASES = ("forward", "backward", "optimizer_step", "zero_grad")


def _storage_bytes(tensors, seen: set) -> int:
    # Keyed by the storage object, not its address: the estimator runs this on fake tensors, which have none.
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += storage.nbytes()
    return total


def _quant_state_tensors(param) -> list[torch.Tensor]:
    state = getattr(param, "quant_state", None)
    if state is None:
        return []
    tensors = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return tensors


def role_sizes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes held by each role now, from the real tensors."""
    seen: set = set()
    params = list(model.parameters())
    quantized = [p for p in params if is_quantized_parameter(p)]
    sizes = {
        "params_quantized": _storage_bytes(quantized, seen)
        + _storage_bytes([t for p in quantized for t in _quant_state_tensors(p)], seen),
        "params_trainable": _storage_bytes([p for p in params if p.requires_grad], seen),
        "params_frozen": _storage_bytes([p for p in params if not p.requires_grad], seen)
        + _storage_bytes(model.buffers(), seen),
        "gradients": _storage_bytes([p.grad for p in params if p.grad is not None], seen),
    }
    state = getattr(optimizer, "state", {}) or {}
    sizes["optimizer_state"] = _storage_bytes(
        [t for per_param in state.values() for t in per_param.values() if isinstance(t, torch.Tensor)], seen
    )
    return sizes


class SavedActivations:
    """Counts the bytes autograd saves for backward (parameters excluded), while active."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.bytes = 0
        self._seen: set = set()
        self._alive: list = []

    def __enter__(self) -> "SavedActivations":
        self._params = {id(p.untyped_storage()) for p in self.model.parameters() if not p.is_meta}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in self._params and id(storage) not in self._seen:
            self._seen.add(id(storage))
            self._alive.append(storage)  # keeps ids unique while counting
            self.bytes += storage.nbytes()
        return tensor

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._alive.clear()


@dataclass
class PhaseRecord:
    start: int = 0
    end: int = 0
    peak: int = 0
    reserved: int = 0
    made_by: str = ""
    roles_at_end: dict = field(default_factory=dict)
    activations: int = 0
    """Saved for backward by this phase's micro-batch (forward and backward only)"""


@dataclass
class Ledger:
    """Filled during the profiled step by the loop, completed from the trace after the window."""

    device: str
    measures: str
    baseline_total: int = 0
    """Bytes of parameters, gradients and optimizer state alive when the step began (CPU traces count from there)"""
    phases: dict = field(default_factory=dict)
    activations: int = 0
    sequence_length: int = 0
    """The widest micro-batch of the step, in tokens (an estimate for the same shapes can be compared)"""
    load_peak: int = 0
    complete: bool = False

    def record_phase(self, name: str, start: int, end: int, peak: int, reserved: int, roles: dict,
                     activations: int = 0) -> None:
        previous = self.phases.get(name)
        if previous is None or peak >= previous.peak:
            self.phases[name] = PhaseRecord(start=start, end=end, peak=peak, reserved=reserved, roles_at_end=roles,
                                            activations=activations if name in ("forward", "backward") else 0)

    def breakdown(self, name: str) -> dict[str, int]:
        """The phase's peak split by role; sums exactly to the peak."""
        record = self.phases[name]
        remaining = record.peak
        split = {}
        for role in ROLES[:5]:
            split[role] = min(record.roles_at_end.get(role, 0), remaining)
            remaining -= split[role]
        split["activations"] = min(record.activations, remaining)
        split["temporaries"] = remaining - split["activations"]
        return split

    def peak_phase(self) -> str | None:
        return max(self.phases, key=lambda n: self.phases[n].peak) if self.phases else None

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "measures": self.measures,
            "complete": self.complete,
            "load_peak_bytes": self.load_peak,
            "activations_saved_bytes": self.activations,
            "sequence_length": self.sequence_length,
            "peak_phase": self.peak_phase(),
            "phases": {
                name: {
                    "start_bytes": r.start, "end_bytes": r.end, "peak_bytes": r.peak, "made_by": r.made_by,
                    "allocator_reserve_bytes": max(0, r.reserved - r.end) if r.reserved else None,
                    "peak_by_role_bytes": self.breakdown(name),
                }
                for name, r in self.phases.items()
            },
        }

    def table(self) -> str:
        if not self.phases:
            return "Memory ledger: no profiled step (the profiler window was disabled or the run too short)."
        phases = [p for p in LEDGER_PHASES if p in self.phases]
        width = 18
        lines = [
            f"Memory ledger of one optimizer step ({self.measures}; peaks by role):",
            "role".ljust(width) + "".join(p.rjust(15) for p in phases),
        ]
        splits = {p: self.breakdown(p) for p in phases}
        for role in ROLES:
            lines.append(role.ljust(width) + "".join(fmt_bytes(splits[p][role]).rjust(15) for p in phases))
        lines.append("peak".ljust(width) + "".join(fmt_bytes(self.phases[p].peak).rjust(15) for p in phases))
        lines.append("end of phase".ljust(width) + "".join(fmt_bytes(self.phases[p].end).rjust(15) for p in phases))
        if any(self.phases[p].reserved for p in phases):
            lines.append("allocator reserve".ljust(width) + "".join(
                fmt_bytes(max(0, self.phases[p].reserved - self.phases[p].end)).rjust(15) for p in phases))
        peak = self.peak_phase()
        lines.append(f"Highest: {peak}, {fmt_bytes(self.phases[peak].peak)}, made by {self.phases[peak].made_by or '?'}")
        return "\n".join(lines)


_ALLOCATION_OPS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::zeros", "aten::zeros_like",
                   "aten::new_empty", "aten::new_empty_strided", "aten::new_zeros", "aten::to", "aten::_to_copy",
                   "aten::copy_", "aten::clone", "aten::contiguous", "aten::resize_", "aten::fill_", "aten::zero_"}


def complete_from_trace(ledger: Ledger, trace: Path) -> None:
    """Fills in what the profiler knows: on CPU the peaks themselves, on both the operator behind each peak."""
    events = read_trace_events(trace)
    device_type = 1 if ledger.device == "cuda" else 0
    memory = sorted(
        (e["ts"], e["args"]["Total Allocated"]) for e in events
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type
    )
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("memfit::")]
    for name in list(ledger.phases):
        best = None
        for r in (r for r in ranges if r["name"] == f"memfit::{name}"):
            inside = [(ts, total) for ts, total in memory if r["ts"] <= ts <= r["ts"] + r["dur"]]
            if inside:
                ts, total = max(inside, key=lambda item: item[1])
                if best is None or total > best[1]:
                    best = (ts, total, r)
        record = ledger.phases[name]
        if best is None:
            # nothing allocated inside the phase (e.g. the optimizer step when it ran inside backward)
            if device_type == 0:
                r = next((r for r in ranges if r["name"] == f"memfit::{name}"), None)
                level = [t for s, t in memory if r is not None and s < r["ts"]]
                record.start = record.end = record.peak = ledger.baseline_total + (level[-1] if level else 0)
            continue
        ts, total, r = best
        covering = sorted((o for o in ops if o["ts"] <= ts <= o["ts"] + o.get("dur", 0)), key=lambda o: o.get("dur", 0))
        # the innermost operator that does work: allocation helpers say nothing about why memory was needed
        meaningful = [o["name"] for o in covering if o["name"] not in _ALLOCATION_OPS]
        record.made_by = (meaningful or [o["name"] for o in covering]
                          or ["no operator: nothing new was allocated, the peak is the phase's start"])[0]
        if device_type == 0:  # CPU: the profiler counts from the window's start; add what was alive then
            before = [t for s, t in memory if s < r["ts"]]
            after = [t for s, t in memory if s <= r["ts"] + r["dur"]]
            record.start = ledger.baseline_total + (before[-1] if before else 0)
            record.end = ledger.baseline_total + (after[-1] if after else 0)
            record.peak = ledger.baseline_total + total
    ledger.complete = True
