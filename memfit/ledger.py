"""The memory ledger: where the memory of one optimizer step went, by role and by phase, from real allocations.

The ledger describes the profiled optimizer step (see ``memfit.profiling``). At each phase's peak (forward, backward,
optimizer_step, zero_grad; with accumulation, the micro-batch whose phase peaked highest) it takes the allocations
alive at that moment, replaying the profiler's memory events (each carries its address and size) up to the peak's
timestamp, and attributes each one by its address:

- parameters (trainable / frozen / quantized), gradients and optimizer state: the storages of the real tensors
  (``parameters()``, ``.grad``, ``optimizer.state``), whose addresses are taken at the end of each phase;
- activations: the storages autograd saved for backward in the micro-batch's forward (``saved_tensors_hooks``);
- tensors alive before the step began (weights, optimizer state) are not in the trace: they are counted by their
  addresses, taken when the step started, unless the trace shows them freed before the peak;
- CUDA: PyTorch's cuBLAS workspaces (``cublas_workspaces``), measured after training by freeing them
  (``measure_cublas_workspaces``), by their addresses.

What matches no role is ``unattributed`` (logits chunks, dequantized weights, optimizer scratch, anything else) and
its biggest allocations are listed with the operator and source line that made each. The role totals are what was
found; the peak is measured (the profiler's running total); ``not found`` is their difference, so an allocation the
ledger misses or counts twice shows instead of being absorbed. On CPU the running total is counted from the window's
start, and the bytes alive when the step began are added to it; on CUDA it is the allocator's own total.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from memfit.memory import fmt_bytes
from memfit.nf4 import inner_tensors, is_nf4
from memfit.profiling import read_trace_events
from memfit.quantize import is_quantized_parameter

ROLES = ("params_trainable", "params_frozen", "params_quantized", "gradients", "optimizer_state", "activations")
LEDGER_PHASES = ("forward", "backward", "optimizer_step", "zero_grad")


def _quant_state_tensors(param) -> list[torch.Tensor]:
    state = getattr(param, "quant_state", None)
    if state is None:
        return []
    tensors = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return tensors


def local(tensor):
    """This rank's shard of a ``DTensor`` (FSDP's parameters, gradients and optimizer state), where its memory is;
    any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors_by_role(model: torch.nn.Module, optimizer) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    # Under FSDP a module's parameters are its shards (DTensors), except while it is gathered: then they are the
    # gathered copies (the root stays gathered from its forward to its backward), new memory beside the shards.
    sharded = any(isinstance(p, DTensor) for p in params)
    gathered = [p for p in params if sharded and not isinstance(p, DTensor)]
    params = [p for p in params if not sharded or isinstance(p, DTensor)]
    quantized = [p for p in params if is_quantized_parameter(local(p))]
    state = getattr(optimizer, "state", {}) or {}
    by_role = {
        "params_quantized": quantized + [t for p in quantized for t in _quant_state_tensors(p)],
        "params_trainable": [p for p in params if p.requires_grad],
        "params_frozen": [p for p in params if not p.requires_grad and not is_quantized_parameter(local(p))]
        + list(model.buffers()),
        "gradients": [p.grad for p in params if p.grad is not None] + _unsharded_gradients(model),
        "optimizer_state": [
            t for per_param in state.values() for t in per_param.values() if isinstance(t, torch.Tensor)
        ],
        GATHERED: gathered,
    }
    # an NF4 weight is a wrapper: its memory is in its inner tensors
    return {
        role: [inner for t in tensors for inner in (inner_tensors(local(t)) if is_nf4(local(t)) else [local(t)])]
        for role, tensors in by_role.items()
    }


def _unsharded_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP keeps unsharded between micro-batches (``no_backward_sync``): they are on its unsharded
    parameters, which ``model.parameters()`` does not return (it returns the shards, whose ``.grad`` is None until the
    reduce-scatter). torch has no public accessor for them, so FSDP's parameter group is read."""
    gradients = []
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for grad in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)):
                if grad is not None:
                    gradients.append(grad)
    return gradients


def _address(tensor: torch.Tensor, storage) -> int:
    """Where a storage is: its data pointer; a fake tensor has none, so the storage object's id (as the estimate's
    live-bytes counter keys it)."""
    return id(storage) if is_fake(tensor) else storage.data_ptr()


def active_blocks(segments: list[dict]) -> dict[int, int]:
    """``{address: bytes requested}`` of the CUDA allocator's live blocks.

    ``segments`` is ``torch.cuda.memory_snapshot()``: each segment's blocks lie one after another from its address,
    as PyTorch's own memory_viz reads them."""
    blocks = {}
    for segment in segments:
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                blocks[address] = block.get("requested_size") or block["size"]
            address += block["size"]
    return blocks


def blocks_without_role(segments: list[dict], known: dict[int, object]) -> dict[int, int]:
    """``{address: bytes}`` of the CUDA allocator's live blocks that start at no known address (``known`` is keyed by
    the addresses of the role tensors' storages). What such a block holds is not known here, only that it is alive
    and no parameter, gradient or optimizer state."""
    return {address: size for address, size in active_blocks(segments).items() if address not in known}


def freed_between(before: list[dict], after: list[dict]) -> dict[int, int]:
    """``{address: bytes}`` of the blocks live in snapshot ``before`` and not in ``after``."""
    still = active_blocks(after)
    return {address: size for address, size in active_blocks(before).items() if address not in still}


def measure_cublas_workspaces(device: torch.device) -> dict[int, int]:
    """``{address: bytes}`` of PyTorch's cuBLAS workspaces on ``device``, measured by freeing them.

    PyTorch gives every (cuBLAS handle, stream) pair a workspace from the caching allocator, and handles are per
    thread: forward's matmuls run on the main thread, backward's on autograd's device thread, so a training process
    holds two (32 MiB each on sm90 by default, 8 MiB + 128 KiB on other GPUs; ``CUBLAS_WORKSPACE_CONFIG`` sets it).
    They are allocated at a process's first matmuls and never freed, so they are alive at every peak and belong to no
    tensor, at the same addresses for the life of the process. ``torch._C._cuda_clearCublasWorkspaces`` (what CUDA
    graph capture calls) releases them to the allocator's cache; the blocks it frees are the workspaces. The next
    matmul takes a workspace again, from the cache. Called after training (``memfit.report.complete_ledger``), so no
    step, trace or memory history the ledger reads is changed by it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()

    def snapshot() -> list[dict]:
        return [s for s in torch.cuda.memory_snapshot() if s.get("device", index) == index]

    torch.cuda.synchronize(device)
    before = snapshot()
    clear()
    return freed_between(before, snapshot())


def sizes_by_role(addresses: dict[int, tuple[str, int]]) -> dict[str, int]:
    """Bytes per role of an address map (``role_addresses``)."""
    sizes = dict.fromkeys(("params_quantized", "params_trainable", "params_frozen", "gradients", "optimizer_state"), 0)
    for role, size in addresses.values():
        sizes[role] = sizes.get(role, 0) + size
    return sizes


def role_sizes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes held by each role now, from the real tensors (each storage counted once)."""
    return sizes_by_role(role_addresses(model, optimizer))


def role_addresses(model: torch.nn.Module, optimizer) -> dict[int, tuple[str, int]]:
    """The address of every storage each role holds now: ``{address: (role, bytes)}`` (see ``_address``)."""
    addresses: dict[int, tuple[str, int]] = {}
    for role, tensors in _tensors_by_role(model, optimizer).items():
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            addresses.setdefault(_address(tensor, storage), (role, storage.nbytes()))
    return addresses


class SavedActivations:
    """Counts the bytes autograd saves for backward (parameters excluded) that are still saved when it exits.

    A storage saved and freed again while it is active (a loss that takes its gradients in forward,
    ``memfit.loss``) is not counted; nor is it kept alive to be counted, which would change the memory measured."""

    def __init__(self, model: torch.nn.Module, unpack=None) -> None:
        self.model = model
        self._unpack = unpack or (lambda tensor: tensor)
        self.bytes = 0
        self.addresses: dict[int, int] = {}
        """``{data_ptr: bytes}`` of what was saved (real tensors only), for the ledger's attribution"""
        self.storage_refs: dict[int, weakref.ref] = {}
        """A weak reference to every storage saved (fake tensors too), by the reference's ``id``: CPython hands out
        one reference per live object, so another ``weakref.ref`` taken of a storage matches it, even once it died"""
        self._seen: dict[int, weakref.finalize] = {}

    def __enter__(self) -> SavedActivations:
        self._params = {
            id(t.untyped_storage())
            for p in self.model.parameters()
            if not p.is_meta
            for t in (inner_tensors(local(p)) if is_nf4(local(p)) else [local(p)])
        }
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if is_nf4(tensor):  # a 4-bit weight torchao's linear keeps for backward (a wrapper: it has no storage)
            return tensor
        storage = tensor.untyped_storage()  # one Python object per live storage, for as long as it lives
        key = id(storage)
        if key not in self._params and key not in self._seen:
            size = storage.nbytes()
            self.bytes += size
            ref = weakref.ref(storage)
            self.storage_refs[id(ref)] = ref
            address = None if tensor.is_meta else _address(tensor, storage)
            if address is not None:
                self.addresses[address] = size
            self._seen[key] = weakref.finalize(storage, self._freed, key, size, id(ref), address)
        return tensor

    def _freed(self, key: int, size: int, ref_key: int, address: int | None) -> None:
        del self._seen[key]
        self.bytes -= size
        self.storage_refs.pop(ref_key, None)
        if address is not None:
            self.addresses.pop(address, None)

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for finalizer in self._seen.values():  # what is saved now stays counted while backward frees it
            finalizer.detach()
        self._seen.clear()


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
    found: dict = field(default_factory=dict)
    """Bytes alive at the peak that belong to each role, and ``unattributed`` (from the trace)"""
    biggest: list = field(default_factory=list)
    """The largest allocations alive at the peak: bytes, role, operator and source line"""

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
    load_peak: int = 0
    complete: bool = False
    roleless_before_step: dict = field(default_factory=dict)
    """CUDA: ``{address: bytes}`` of the allocator's blocks alive when the step began that hold no role's tensor, read
    from the allocator: allocations the step did not make and no role explains, such as library workspaces"""
    cublas_workspaces: dict = field(default_factory=dict)
    """CUDA: ``{address: bytes}`` of the cuBLAS workspaces alive since before the step, measured after training
    (``measure_cublas_workspaces``)"""

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
        if addresses is not None:  # None: a phase the trace did not collect (a paused micro-batch) has no map
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
            "sequence_length": self.sequence_length,
            "peak_phase": self.peak_phase(),
            "before_step_without_role_bytes": self.before_step_without_role,
            "cublas_workspaces_bytes": sorted(self.cublas_workspaces.values(), reverse=True),
            "phases": {
                name: {
                    "start_bytes": r.start,
                    "end_bytes": r.end,
                    "peak_bytes": r.peak,
                    "allocator_reserve_bytes": max(0, r.reserved - r.end) if r.reserved else None,
                    "found_at_peak_bytes": self.breakdown(name),
                    "not_found_bytes": r.not_found if r.found else None,
                    "biggest_at_peak": r.biggest,
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
            f"Memory ledger of one optimizer step ({self.measures}; the allocations alive at each phase's peak):",
            "role".ljust(width) + "".join(p.rjust(15) for p in phases),
        ]
        workspaces = (WORKSPACES,) if any(self.phases[p].found.get(WORKSPACES) for p in phases) else ()
        gathered = (GATHERED,) if any(self.phases[p].found.get(GATHERED) for p in phases) else ()
        for role in ROLES + gathered + workspaces + (UNATTRIBUTED,):
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
        peak = self.peak_phase()
        lines.append(f"Biggest allocations alive at the highest peak ({peak}, {fmt_bytes(self.phases[peak].peak)}):")
        for item in self.phases[peak].biggest:
            where = "  ".join(part for part in (item["op"], item["source"]) if part)
            lines.append(f"  {fmt_bytes(item['bytes']):>11}  {item['role']:<17} {where}")
        return "\n".join(lines)


UNATTRIBUTED = "unattributed"
GATHERED = "gathered_params"
"""FSDP's gathered copies of sharded weights (the all-gathers' outputs, new memory beside each rank's shard): found by
the ``FSDP::all_gather`` profiler range that made them"""
WORKSPACES = "cublas_workspaces"
"""The bytes of PyTorch's cuBLAS workspaces (CUDA): found by address like a role, measured by freeing them"""
_ALLOCATION_OPS = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::zeros",
    "aten::zeros_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::new_zeros",
    "aten::to",
    "aten::_to_copy",
    "aten::copy_",
    "aten::clone",
    "aten::contiguous",
    "aten::resize_",
    "aten::fill_",
    "aten::zero_",
}
# frames that say nothing about why memory was needed: the framework's own plumbing
_PLUMBING = ("torch/", "lightning/", "threading.py", "contextlib.py", "<built-in", "tqdm/", "memfit/phases.py")


def _innermost(events: list[dict], ts: float, keep) -> str:
    covering = [e for e in events if e["ts"] <= ts <= e["ts"] + e.get("dur", 0) and keep(e["name"])]
    return min(covering, key=lambda e: e.get("dur", 0))["name"] if covering else ""


def _where(ts: float, thread, loop_thread, ops: dict, frames: dict) -> tuple[str, str]:
    """The operator and the source line that made the allocation at ``ts`` on ``thread`` (``ops`` and ``frames``:
    each thread's events).

    Only that thread's events count: another thread's Python frame covering the same moment (a logger's writer
    thread waits in ``queue.get`` all step) says nothing about it. Where the allocating thread runs no Python (CUDA's
    autograd thread in backward), the source is the training loop's line (``loop_thread``) that waited on it."""
    own = ops.get(thread, [])
    op = _innermost(own, ts, lambda name: name not in _ALLOCATION_OPS) or _innermost(own, ts, lambda name: True)
    ours = lambda name: not name.startswith(_PLUMBING) and "site-packages/torch/" not in name  # noqa: E731
    source = _innermost(frames.get(thread, []), ts, ours) or _innermost(frames.get(loop_thread, []), ts, ours)
    return op, source


def _by_thread(events) -> dict:
    threads: dict = {}
    for event in events:
        threads.setdefault(event.get("tid"), []).append(event)
    return threads


def _memory_events(events: list[dict], device_type: int) -> list[tuple]:
    """``(time, total allocated, +/-bytes, address, thread)`` of the device's allocations and frees, in time order.

    On CPU, the blocks of PyTorch's ``MapAllocator`` are left out: the shared memory in which DataLoader workers hand
    over their batches, and memory-mapped files. They are not the CPU allocator's, whose running total is the measured
    peak, and ``MapAllocator`` reports each with a total of 0; a batch that arrived during the step (the next one,
    prefetched) would otherwise be found alive at the peak and not be in the peak."""
    memory = sorted(
        (
            (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"], e["args"].get("Addr"), e.get("tid"))
            for e in events
            if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type
        ),
        key=lambda event: event[:4],
    )  # the thread only names what made an allocation
    if device_type != 0:
        return memory
    kept, mapped = [], set()
    for event in memory:
        _, total, size, addr, _ = event
        if size > 0 and total == 0:  # the CPU allocator's total includes the block it reports: only a mapping's is 0
            mapped.add(addr)
        elif size < 0 and addr in mapped:
            mapped.discard(addr)
        else:
            kept.append(event)
    return kept


def _gathering_ranges(events: list[dict]) -> list[tuple[float, float, object]]:
    """``(start, end, thread)`` of FSDP's all-gathers (``FSDP::all_gather`` and its copy-out), in time order."""
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("tid"))
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("FSDP::all_gather")
    )


def _inside(ranges: list[tuple[float, float, object]], ts: float, thread=None) -> bool:
    return any(start <= ts <= end and (thread is None or thread == tid) for start, end, tid in ranges)


def _phase_ranges(events: list[dict]) -> list[dict]:
    """The ``memfit::<phase>`` ranges, in time order."""
    return sorted(
        (e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("memfit::")),
        key=lambda e: e["ts"],
    )


def _maps_at_phase_ends(ledger: Ledger, ends: list[tuple[float, str]]) -> list[tuple[float, dict]]:
    """``(end time, address map)`` of each phase occurrence (``ends``: its end time and phase name, in time order):
    the k-th occurrence of a phase takes the k-th map the ledger took at that phase's end."""
    seen: dict[str, int] = {}
    maps = []
    for end, name in ends:
        k = seen[name] = seen.get(name, -1) + 1
        taken = ledger.addresses.get(name, [])
        maps.append((end, taken[k] if k < len(taken) else {}))
    return maps


def complete_from_trace(ledger: Ledger, trace: Path, listed: int = 6) -> None:
    """Finds the allocations alive at each phase's peak in the trace and attributes them (see the module doc)."""
    events = read_trace_events(trace)
    device_type = 1 if ledger.device == "cuda" else 0
    memory = _memory_events(events, device_type)
    ops = _by_thread(e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    frames = _by_thread(e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function")
    ranges = _phase_ranges(events)
    gathering = _gathering_ranges(events)
    # a block made in an earlier phase (FSDP's unsharded gradients of an earlier micro-batch) takes the role it had at
    # the first phase end after it was made
    ends = _maps_at_phase_ends(ledger, [(r["ts"] + r["dur"], r["name"].split("::", 1)[1]) for r in ranges])
    cpu_offset = 0
    if device_type == 0 and memory:
        # The CPU total is PyTorch's count of the blocks it recorded while a profiler watched memory and that are
        # still alive: from this window's start, plus any an earlier profiler in the process left alive. The measured
        # peak is the bytes alive when the step began (by address) and what the window added to the count.
        _, total, size, *_ = memory[0]
        cpu_offset = ledger.baseline_total - (total - size)
    allocated_in_step = {addr for _, _, size, addr, _ in memory if size > 0}
    for name, record in ledger.phases.items():
        occurrences = [r for r in ranges if r["name"] == f"memfit::{name}"]
        best = None
        for k, r in enumerate(occurrences):
            inside = [(ts, total) for ts, total, *_ in memory if r["ts"] <= ts <= r["ts"] + r["dur"]]
            if inside:
                ts, total = max(inside, key=lambda item: item[1])
                if best is None or total > best[1]:
                    best = (ts, total, r, k)
        if best is None:  # nothing allocated inside the phase (e.g. the optimizer step ran inside backward)
            r = occurrences[0] if occurrences else None
            before = [t for ts, t, *_ in memory if r is not None and ts < r["ts"]]
            best = (r["ts"] if r else 0, before[-1] if before else 0, r, 0)
        peak_ts, total, r, k = best
        if device_type == 0:
            before = [t for ts, t, *_ in memory if r is not None and ts < r["ts"]]
            after = [t for ts, t, *_ in memory if r is not None and ts <= r["ts"] + r["dur"]]
            record.start = cpu_offset + (before[-1] if before else 0)
            record.end = cpu_offset + (after[-1] if after else 0)
            record.peak = cpu_offset + total
        # replay the allocations up to the peak: what is alive then, and which earlier blocks were freed
        live: dict[int, tuple[int, float, int | None]] = {}
        freed_earlier: set[int] = set()
        for ts, _, size, addr, thread in memory:
            if ts > peak_ts:
                break
            if size > 0:
                live[addr] = (size, ts, thread)
            elif live.pop(addr, None) is None:
                freed_earlier.add(addr)
        snapshot_end = r["ts"] + r["dur"] if r is not None else peak_ts
        freed_after = {addr for ts, _, size, addr, _ in memory if peak_ts < ts <= snapshot_end and size < 0}
        known = ledger.addresses.get(name, [{}])[min(k, len(ledger.addresses.get(name, [{}])) - 1)]
        in_forward = name == "forward"
        found = dict.fromkeys(ROLES + (UNATTRIBUTED,), 0) | ({WORKSPACES: 0} if ledger.cublas_workspaces else {})
        found |= {GATHERED: 0} if gathering else {}
        alive: list[tuple[int, str, float | None, int | None]] = []
        for addr, (size, ts, thread) in live.items():
            role, _ = known.get(addr, (WORKSPACES if addr in ledger.cublas_workspaces else UNATTRIBUTED, 0))
            # the address was the role's at the phase's end: the same block only if it was not freed in between
            # (activations were taken at the forward's end, before a later phase's peak)
            if role != UNATTRIBUTED and addr in freed_after and (role != "activations" or in_forward):
                role = UNATTRIBUTED
            if role == UNATTRIBUTED and r is not None and ts < r["ts"]:  # alive since an earlier phase's end
                first_end = bisect.bisect_left(ends, (ts,))
                if first_end < len(ends) and ends[first_end][0] < r["ts"]:
                    role, _ = ends[first_end][1].get(addr, (UNATTRIBUTED, 0))
            if role == UNATTRIBUTED and _inside(gathering, ts, thread):
                role = GATHERED
            found[role] += size
            alive.append((size, role, ts, thread))
        since_before = list(ledger.baseline_addresses.items())
        since_before += [
            (addr, (WORKSPACES, size))
            for addr, size in ledger.cublas_workspaces.items()
            if addr not in allocated_in_step
        ]
        for addr, (role, size) in since_before:
            if addr not in freed_earlier and addr not in live:  # alive since before the step
                found[role] += size
                alive.append((size, role, None, None))
        record.found = found
        record.biggest = []
        for size, role, ts, thread in sorted(alive, key=lambda item: -item[0])[:listed]:
            op, source = (
                _where(ts, thread, r["tid"] if r else None, ops, frames)
                if ts is not None
                else ("allocated before the step", "")
            )
            record.biggest.append({"bytes": size, "role": role, "op": op, "source": source})
    ledger.complete = True


def role_timeline(ledger: Ledger, trace: Path) -> dict:
    """The profiled step's memory over time, by role (see ``stack_by_role``), from its profiler trace."""
    events = read_trace_events(trace)
    memory = [(ts, size, addr) for ts, _, size, addr, _ in _memory_events(events, 1 if ledger.device == "cuda" else 0)]
    ranges = [(r["ts"], r["ts"] + r["dur"], r["name"].split("::", 1)[1]) for r in _phase_ranges(events)]
    if not memory or not ranges:
        raise ValueError(f"{trace} has no memory events or no memfit phases to draw")
    return stack_by_role(ledger, memory, ranges, per_ms=1e3, gathering=_gathering_ranges(events))


def stack_by_role(
    ledger: Ledger, memory: list[tuple], ranges: list[tuple], per_ms: float, gathering: list[tuple] = ()
) -> dict:
    """Memory over time, by role: ``ms`` (from the step's start), ``roles`` (role -> bytes at each time), ``phases``
    (start ms, end ms, name), ``peak_ms`` and ``peak_bytes``. ``memory`` is ``(time, +/-bytes, address)`` for each
    allocation and free, ``ranges`` each phase's ``(start, end, name)``, in time units of which ``per_ms`` make a ms.

    Each allocation made in the step takes the role its address has in the map taken at the end of the first phase
    that ends after it was made, if it was still alive then (activations: at the forward's end); otherwise it is
    unattributed, or FSDP's gathered weights where an all-gather (``gathering``: its ``(start, end, thread)``)
    made it. Tensors alive since before the step are counted by their addresses, until they are freed.
    """
    snapshots = _maps_at_phase_ends(ledger, [(end, name) for _, end, name in ranges])
    ends = [end for end, _ in snapshots]
    freed_at: dict[tuple[int, float], float] = {}
    open_blocks: dict[int, float] = {}
    for ts, size, addr in memory:
        if size > 0:
            open_blocks[addr] = ts
        elif addr in open_blocks:
            freed_at[(addr, open_blocks.pop(addr))] = ts

    def role_of(addr: int, ts: float) -> str:
        i = bisect.bisect_left(ends, ts)
        if i == len(snapshots):
            return UNATTRIBUTED
        end, known = snapshots[i]
        role, _ = known.get(addr, (WORKSPACES if addr in ledger.cublas_workspaces else UNATTRIBUTED, 0))
        if freed_at.get((addr, ts), float("inf")) <= end:
            role = UNATTRIBUTED  # gone before the phase's end: the address there is another block's
        return GATHERED if role == UNATTRIBUTED and _inside(gathering, ts) else role

    level = dict.fromkeys(ROLES + (UNATTRIBUTED,), 0) | ({WORKSPACES: 0} if ledger.cublas_workspaces else {})
    level |= {GATHERED: 0} if gathering else {}
    allocated_in_step = {addr for _, size, addr in memory if size > 0}
    baseline = dict(ledger.baseline_addresses) | {
        addr: (WORKSPACES, size) for addr, size in ledger.cublas_workspaces.items() if addr not in allocated_in_step
    }
    for role, size in baseline.values():
        level[role] += size
    live: dict[int, tuple[str, int]] = {}
    start = ranges[0][0]
    out = {"ms": [], "roles": {role: [] for role in level}}
    for ts, size, addr in memory:
        if size > 0:
            live[addr] = (role_of(addr, ts), size)
            level[live[addr][0]] += size
        elif addr in live:
            role, allocated = live.pop(addr)
            level[role] -= allocated
        elif addr in baseline:
            role, allocated = baseline.pop(addr)
            level[role] -= allocated
        else:  # made before the step by no role (CPU totals do not count it): nothing to take away
            continue
        out["ms"].append((ts - start) / per_ms)
        for role, value in level.items():
            out["roles"][role].append(value)
    totals = [sum(values) for values in zip(*out["roles"].values())]
    peak_index = max(range(len(totals)), key=totals.__getitem__)
    out["phases"] = [((a - start) / per_ms, (b - start) / per_ms, name) for a, b, name in ranges]
    out["peak_ms"], out["peak_bytes"] = out["ms"][peak_index], totals[peak_index]
    return out
