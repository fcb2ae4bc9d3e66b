"""The step's memory over time by role, for the picture and the page: each allocation takes the role its address has
in the ledger's map at the end of the phase it was made in."""

from __future__ import annotations

import bisect
from pathlib import Path

from memfit.ledger import Ledger, maps_at_phase_ends
from memfit.profiling import read_trace_events
from memfit.roles import GATHERED, ROLES, UNATTRIBUTED, WORKSPACES
from memfit.trace_events import gathering_ranges, memory_events, phase_ranges, within_any


def role_timeline(ledger: Ledger, trace: Path) -> dict:
    """The profiled step's memory over time, by role (see ``stack_by_role``), from its profiler trace."""
    events = read_trace_events(trace)
    memory = [(ts, size, addr) for ts, _, size, addr, _ in memory_events(events, 1 if ledger.device == "cuda" else 0)]
    ranges = [(r["ts"], r["ts"] + r["dur"], r["name"].split("::", 1)[1]) for r in phase_ranges(events)]
    if not memory or not ranges:
        raise ValueError(f"{trace} has no memory events or no memfit phases to draw")
    return stack_by_role(ledger, memory, ranges, per_ms=1e3, gathering=gathering_ranges(events))


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
    snapshots = maps_at_phase_ends(ledger, [(end, name) for _, end, name in ranges])
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
        return GATHERED if role == UNATTRIBUTED and within_any(gathering, ts) else role

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
