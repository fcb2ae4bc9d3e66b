"""What the ledger and the picture read from a ``torch.profiler`` trace: the allocations and frees of a device in time
order, the ``memfit::<phase>`` ranges, FSDP's all-gathers, and the operator and source line that made an
allocation; and the trace file itself (written gzipped, made valid JSON where torch wrote it broken; parsed once)."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import sys
import time
from functools import lru_cache
from pathlib import Path

_MEMORY_ARGS = ("Total Allocated", "Bytes", "Addr", "Device Type")
TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
"""A finished trace: torch's own name, gzipped (as Memfit writes it, and TensorBoard's PyTorch Profiler tab reads it)
or not (torch's ``tensorboard_trace_handler`` without ``use_gzip``)"""
GZIP_LEVEL = 6
"""torch's ``use_gzip=True`` compresses at gzip's level 9: 0.35 s for a 5 MB trace of the embedded model against
0.06 s at level 6, for 15x smaller against 14x (measured on this project's 2-core machine)"""


def trace_files(run_dir: Path, worker: str = "*") -> list[Path]:
    """The finished traces in ``run_dir`` (of ``worker``, e.g. ``rank0``): not a partial ``*.tmp`` a full disk or a
    crash left behind."""
    return sorted(p for p in Path(run_dir).glob(f"{worker}.*.pt.trace.json*") if p.name.endswith(TRACE_SUFFIXES))


def trace_text(trace: Path) -> str:
    with gzip.open(trace, "rt") if trace.name.endswith(".gz") else open(trace) as file:
        return file.read()


def write_gzipped_trace(prof, run_dir: Path, worker: str) -> Path:
    """The profiler's trace as ``<worker>.<ns>.pt.trace.json.gz``, made valid JSON first where torch wrote it broken
    (``escape_trace_strings``), whole or not at all: torch writes the plain trace, which is compressed beside it
    (through ``.tmp``) and removed, at ``GZIP_LEVEL`` rather than torch's own handler's level 9 (a 5.3 MB trace
    of the embedded model became 387 kB)."""
    plain = Path(run_dir) / f"{worker}.{time.time_ns()}.pt.trace.json"
    packed = plain.with_name(plain.name + ".gz")
    partial = packed.with_name(packed.name + ".tmp")
    try:
        prof.export_chrome_trace(str(plain))
        escape_trace_strings(plain)
        with open(plain, "rb") as source, gzip.open(partial, "wb", compresslevel=GZIP_LEVEL) as target:
            shutil.copyfileobj(source, target, 2**20)
        os.replace(partial, packed)
    finally:  # a full disk or a signal mid-way leaves neither the plain trace nor a part of the compressed one
        plain.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return packed


@lru_cache(maxsize=1)
def read_trace_events(trace: Path) -> list[dict]:
    """The trace's events that the ledger and the picture read, parsed once and kept small: memory events, operators,
    Python frames and the ``memfit::`` phase ranges.

    The events are decoded one at a time (``raw_decode``) and trimmed to the fields used, instead of ``json.loads``
    of the whole file: the parsed trace is what raises a run's peak host memory after its last step (about 100 MiB
    for a 23 MB trace with ``json.loads``, about 40 MiB this way).
    """
    text = trace_text(Path(trace))
    decoder = json.JSONDecoder()
    i, end = text.index("[", text.index('"traceEvents"')) + 1, len(text)
    events, threads = [], {}  # one int object per thread id, shared by its events
    while True:
        while i < end and text[i] in " \t\r\n,":
            i += 1
        if i >= end:  # cut short exactly between two events: still not the whole trace
            raise json.JSONDecodeError("the trace ends before its list of events does", text, i)
        if text[i] == "]":
            return events
        event, i = decoder.raw_decode(text, i)
        if event.get("name") == "[memory]":
            args = event.get("args", {})
            events.append(
                {
                    "name": "[memory]",
                    "ts": event["ts"],
                    "tid": threads.setdefault(event.get("tid"), event.get("tid")),
                    "args": {key: args.get(key) for key in _MEMORY_ARGS},
                }
            )
        elif event.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            # interned: a step repeats a few hundred names tens of thousands of times
            events.append(
                {
                    "name": sys.intern(event["name"]),
                    "ph": sys.intern(event.get("ph", "")),
                    "cat": sys.intern(event["cat"]),
                    "ts": event["ts"],
                    "dur": event.get("dur", 0),
                    "tid": threads.setdefault(event.get("tid"), event.get("tid")),
                }
            )


_NAME = '"name": "'
# an event's name on its own line, as torch's trace writer lays events out, with nothing that JSON must escape
_PLAIN_NAME = r'"name": "[^"\\\x00-\x1f]*",?\n'
_PLAIN_NAME_BYTES = re.compile(_PLAIN_NAME.encode())
_PLAIN_NAME_LINE = re.compile(_PLAIN_NAME)
_NAME_LINE = re.compile(r'^([ \t]*"name": )"(.*)"(,?)[ \t]*$', re.S)
_ONE_FIELD_A_LINE = re.compile(rb'^[ \t]*"ph": "[A-Za-z]",?[ \t]*$', re.M)


def escape_trace_strings(trace: Path, block_bytes: int = 16 * 2**20) -> int:
    """Makes a trace torch wrote valid JSON again, in place; returns how many event names it escaped.

    torch (2.13 included) writes event names into the trace without JSON escaping (pytorch/pytorch#146900, kineto
    pull request 1459; backslashes: #98432): one Python frame whose file or function name holds a quote, a
    backslash or a newline (protobuf's ``text_format`` has one, imported by TensorBoard's logger on its first write)
    makes the whole file unreadable, to the ledger and to TensorBoard's PyTorch Profiler tab alike. The file is
    scanned a block at a time (about 0.2 s for 60 MB; it can be hundreds of MB) and rewritten only if a name needs
    escaping, each such name re-encoded with ``json.dumps``. A layout other than one field a line (another torch's)
    is left as it is.
    """
    with open(trace, "rb") as file:
        first = True
        while True:
            block = file.read(block_bytes) + file.readline()  # whole lines
            if not block or (first and not _ONE_FIELD_A_LINE.search(block)):
                return 0
            first = False
            if block.count(_NAME.encode()) != len(_PLAIN_NAME_BYTES.findall(block)):
                break
    escaped = 0
    rewritten = trace.with_name(trace.name + ".escaping")
    try:
        with (
            open(trace, encoding="utf-8", errors="surrogateescape") as source,
            open(rewritten, "w", encoding="utf-8", errors="surrogateescape") as target,
        ):
            pending = ""  # a name that goes on over newlines, up to the line that closes it
            for line in source:
                if pending or (_NAME in line and not _PLAIN_NAME_LINE.search(line)):
                    match = _NAME_LINE.match(pending + line)
                    if match is None:  # not closed on this line
                        pending += line
                        continue
                    key, value, comma = match.groups()
                    try:
                        json.loads(f'"{value}"')  # escaped already (a torch with the fix)
                        line = pending + line
                    except ValueError:
                        line = f"{key}{json.dumps(value)}{comma}\n"
                        escaped += 1
                    pending = ""
                target.write(line)
            target.write(pending)
        os.replace(rewritten, trace)
    finally:
        rewritten.unlink(missing_ok=True)
    return escaped


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
_PLUMBING = (
    "torch/",
    "lightning/",
    "threading.py",
    "contextlib.py",
    "<built-in",
    "tqdm/",
    "memfit/observatory/phases.py",
)


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
    return with_unrecorded_frees(kept, events)


def with_unrecorded_frees(memory: list[tuple], events: list[dict]) -> list[tuple]:
    """``memory`` (CPU) with the frees the profiler did not see, and the running total they leave out taken out of
    every later event's. PyTorch's CPU count records a free only on a thread a profiler watches; a block whose last
    reference is dropped on another (gloo's worker threads) stays in the total for the rest of the run.

    - A block whose address is handed out again was freed before that, whatever thread made it: an allocator hands
      out no live address. Its free is put at the new block's allocation. (Measured: FSDP's rank 0, starved of CPU
      beside other processes, made a 512.5 KiB block in backward that gloo's thread freed; the total kept it through
      the step's end while the trace handed its address out again.)
    - gloo's reduce-scatter (FSDP's, every backward) allreduces a clone of its input made inside the ``c10d::``
      operator, often freed in gloo's worker thread (measured: 40 and 200 reduce-scatters of 8 MiB raised the total by
      120 and 432 MiB while the process's anonymous memory after ``malloc_trim`` rose by 52 and 56 MiB, the profiler's
      own records among it). A block made inside a collective that the trace never frees was freed when the
      collective returned: at the operator's end (where its address is handed out again, if that is earlier)."""
    collectives = by_thread(e for e in events if e.get("ph") == "X" and e["name"].startswith("c10d::"))
    live, unreported = {}, []  # address -> (time, size, thread); (made, handed out again or None, size, address)
    for ts, _, size, addr, thread in memory:
        if size > 0:
            if addr in live:
                made, old_size, old_thread = live[addr]
                unreported.append((made, ts, old_size, addr, old_thread))
            live[addr] = (ts, size, thread)
        else:
            live.pop(addr, None)
    unreported += [(made, None, size, addr, thread) for addr, (made, size, thread) in live.items()]
    frees = []
    for made, again, size, addr, thread in unreported:
        ends = [e["ts"] + e["dur"] for e in collectives.get(thread, []) if e["ts"] <= made <= e["ts"] + e["dur"]]
        if ends:
            frees.append((min(max(ends), again) if again is not None else max(ends), size, addr, thread))
        elif again is not None:
            frees.append((again, size, addr, thread))
    if not frees:
        return memory
    frees.sort()
    corrected, taken, next_free = [], 0, 0
    total_before = memory[0][1] - memory[0][2]  # the count just before the first event
    for ts, total, size, addr, thread in memory:
        while next_free < len(frees) and frees[next_free][0] <= ts:
            free_ts, free_size, free_addr, free_thread = frees[next_free]
            taken += free_size
            corrected.append((free_ts, total_before - free_size, -free_size, free_addr, free_thread))
            total_before -= free_size
            next_free += 1
        corrected.append((ts, total - taken, size, addr, thread))
        total_before = total - taken
    for free_ts, free_size, free_addr, free_thread in frees[next_free:]:
        total_before -= free_size
        corrected.append((free_ts, total_before, -free_size, free_addr, free_thread))
    return corrected


def _annotation_ranges(events: list[dict], keep) -> list[tuple[float, float, object]]:
    """``(start, end, thread)`` of the profiler ranges (``record_function``) whose name ``keep`` accepts, in time
    order."""
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("tid"))
        for e in events
        if e.get("cat") == "user_annotation" and keep(str(e.get("name", "")))
    )


def gathering_ranges(events: list[dict]) -> list[tuple[float, float, object]]:
    """``(start, end, thread)`` of FSDP's all-gathers (``FSDP::all_gather`` and its copy-out), in time order."""
    return _annotation_ranges(events, lambda name: name.startswith("FSDP::all_gather"))


RECOMPUTE_RANGE = "memfit.recompute"
"""The profiler range around a checkpointed block's forward run again in backward (``memfit.training.loading``)"""


def recompute_ranges(events: list[dict]) -> list[tuple[float, float, object]]:
    """``(start, end, thread)`` of each checkpointed block's recomputation in backward, in time order."""
    return _annotation_ranges(events, lambda name: name == RECOMPUTE_RANGE)


BLOCK_RANGE = "memfit.block "
"""The start of the profiler range around a transformer block's forward (``memfit.block transformer.h.3``) and its
backward (``... backward``), ``memfit.observatory.block_ranges``"""


def block_at(ts: float, thread, ops: dict) -> str:
    """The block (``transformer.h.3``, ``transformer.h.3 backward``) whose range on ``thread`` holds the moment ``ts``,
    the innermost (a checkpointed block's recomputation is inside its backward); "" outside every block."""
    name = _innermost(ops.get(thread, []), ts, lambda name: name.startswith(BLOCK_RANGE))
    return name[len(BLOCK_RANGE) :]


LOSS_RANGE = "memfit.loss"
"""The profiler range around the loss's head (``memfit.training.loss``), and around each chunk recomputed in backward"""


def loss_ranges(events: list[dict]) -> list[tuple[float, float, object]]:
    """``(start, end, thread)`` of the loss's ranges, in time order."""
    return _annotation_ranges(events, lambda name: name == LOSS_RANGE)


def within_any(ranges: list[tuple[float, float, object]], ts: float, thread=None) -> bool:
    return any(start <= ts <= end and (thread is None or thread == tid) for start, end, tid in ranges)


def phase_ranges(events: list[dict]) -> list[dict]:
    """The ``memfit::<phase>`` ranges, in time order."""
    return sorted(
        (e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("memfit::")),
        key=lambda e: e["ts"],
    )


def _innermost_at(ops: list[dict], times: list[float], keep) -> list[str]:
    """For each of ``times`` (ascending), the innermost of one thread's ``ops`` (nested ranges) around it whose name
    ``keep`` accepts, or "": one sweep over both, where ``where_made`` scans every op for one moment."""
    ranges = sorted((e for e in ops if keep(e["name"])), key=lambda e: (e["ts"], -e.get("dur", 0)))
    open_ops: list[dict] = []
    found, i = [], 0
    for t in times:
        while i < len(ranges) and ranges[i]["ts"] <= t:
            while open_ops and open_ops[-1]["ts"] + open_ops[-1].get("dur", 0) < ranges[i]["ts"]:
                open_ops.pop()
            open_ops.append(ranges[i])
            i += 1
        while open_ops and open_ops[-1]["ts"] + open_ops[-1].get("dur", 0) < t:
            open_ops.pop()
        found.append(open_ops[-1]["name"] if open_ops else "")
    return found


def operator_memory(events: list[dict], device_type: int) -> tuple[list[dict], list[dict]]:
    """What TensorBoard's PyTorch Profiler tab shows of a step's memory, without it (its page fetches its charts from
    the web): per operator, the allocations made inside it (``count``, ``allocated`` bytes, the ``largest``) and its
    ``increase`` (bytes it allocated minus bytes freed inside it), most allocated first; and each allocation with its
    operator, size and when it was made and freed (``made_ms``, ``freed_ms``: from the first memory event; ``None``:
    still alive at the trace's end), largest first. An allocation belongs to the innermost operator around it that is
    not an allocation primitive (``aten::linear``, not the ``aten::empty`` inside it), as in the ledger."""
    memory = memory_events(events, device_type)
    if not memory:
        return [], []
    ops = by_thread(e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    names: list[str] = [""] * len(memory)
    for thread, own in ops.items():
        indices = [i for i, event in enumerate(memory) if event[4] == thread]
        times = [memory[i][0] for i in indices]
        meaningful = _innermost_at(own, times, lambda name: name not in _ALLOCATION_OPS)
        anything = _innermost_at(own, times, lambda name: True)
        for i, first, second in zip(indices, meaningful, anything):
            names[i] = first or second
    start = memory[0][0]
    operators: dict[str, dict] = {}
    made: dict = {}
    allocations = []
    for (ts, _, size, address, _), name in zip(memory, names):
        name = name or "(outside any operator)"
        row = operators.setdefault(name, {"operator": name, "count": 0, "allocated": 0, "largest": 0, "increase": 0})
        row["increase"] += size
        if size > 0:
            row["count"] += 1
            row["allocated"] += size
            row["largest"] = max(row["largest"], size)
            made[address] = {"operator": name, "bytes": size, "made_ms": (ts - start) / 1000, "freed_ms": None}
            allocations.append(made[address])
        elif address in made:
            made.pop(address)["freed_ms"] = (ts - start) / 1000
    by_allocated = sorted(operators.values(), key=lambda row: -row["allocated"])
    return by_allocated, sorted(allocations, key=lambda allocation: -allocation["bytes"])
