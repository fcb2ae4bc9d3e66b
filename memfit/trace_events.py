"""What the ledger and the picture read from a ``torch.profiler`` trace: the allocations and frees of a device in time
order, the ``memfit::<phase>`` ranges, FSDP's all-gathers, and the operator and source line that made an
allocation."""

from __future__ import annotations

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


def where_made(ts: float, thread, loop_thread, ops: dict, frames: dict) -> tuple[str, str]:
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


def by_thread(events) -> dict:
    threads: dict = {}
    for event in events:
        threads.setdefault(event.get("tid"), []).append(event)
    return threads


def memory_events(events: list[dict], device_type: int) -> list[tuple]:
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


def gathering_ranges(events: list[dict]) -> list[tuple[float, float, object]]:
    """``(start, end, thread)`` of FSDP's all-gathers (``FSDP::all_gather`` and its copy-out), in time order."""
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("tid"))
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("FSDP::all_gather")
    )


def within_any(ranges: list[tuple[float, float, object]], ts: float, thread=None) -> bool:
    return any(start <= ts <= end and (thread is None or thread == tid) for start, end, tid in ranges)


def phase_ranges(events: list[dict]) -> list[dict]:
    """The ``memfit::<phase>`` ranges, in time order."""
    return sorted(
        (e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("memfit::")),
        key=lambda e: e["ts"],
    )
