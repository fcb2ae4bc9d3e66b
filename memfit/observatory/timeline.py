"""The step's memory over time by role, for the picture and the page: each allocation takes the role it had when it
was made (``memfit.observatory.block_lifetimes``), for its whole life, or, made without one, the role a later phase end
gives it from that phase on."""

from __future__ import annotations

import bisect
from pathlib import Path

from memfit.observatory.block_lifetimes import Roles, lifetimes
from memfit.observatory.ledger import Ledger
from memfit.observatory.roles import LOSS, UNATTRIBUTED, counted
from memfit.trace_events import (
    gathering_ranges,
    loss_ranges,
    memory_events,
    phase_ranges,
    read_trace_events,
    recompute_ranges,
)


def role_timeline(ledger: Ledger, trace: Path) -> dict:
    """The profiled step's memory over time, by role (see ``stack_by_role``), from its profiler trace."""
    events = read_trace_events(trace)
    memory = memory_events(events, 1 if ledger.device == "cuda" else 0)
    ranges = [(r["ts"], r["ts"] + r["dur"], r["name"].split("::", 1)[1]) for r in phase_ranges(events)]
    if not memory or not ranges:
        raise ValueError(f"{trace} has no memory events or no memfit phases to draw")
    return stack_by_role(
        ledger,
        memory,
        ranges,
        per_ms=1e3,
        gathering=gathering_ranges(events),
        recomputing=recompute_ranges(events),
        in_loss=loss_ranges(events),
    )


def stack_by_role(
    ledger: Ledger,
    memory: list[tuple],
    ranges: list[tuple],
    per_ms: float,
    gathering: list[tuple] = (),
    recomputing: list[tuple] = (),
    in_loss: list[tuple] = (),
) -> dict:
    """Memory over time, by role: ``ms`` (from the step's start), ``roles`` (role -> bytes at each time), ``phases``
    (start ms, end ms, name), ``peak_ms`` and ``peak_bytes``. ``memory`` is ``(time, total, +/-bytes, address,
    thread)`` for each allocation and free, ``ranges`` each phase's ``(start, end, name)``, in time units of which
    ``per_ms`` make a ms; ``gathering`` FSDP's all-gathers' ``(start, end, thread)``, ``recomputing`` the checkpointed
    blocks' recomputations', ``in_loss`` the loss's ranges.

    Each block takes its role at the moment it was made (``memfit.observatory.block_lifetimes.Roles.role_at``), or, made
    without one, the role it takes at a later phase end from that phase's first event on (``Roles.becomes``); tensors
    alive since before the step count from the start, until they are freed.
    """
    roles = Roles(
        ledger,
        [(end, name) for _, end, name in ranges],
        memory,
        gathering,
        recomputing,
        in_loss,
    )
    level = dict.fromkeys(
        counted(gathered=bool(gathering), workspaces=bool(ledger.cublas_workspaces), loss=bool(in_loss)), 0
    )
    changes: dict[int, list[tuple[str, int]]] = {}  # memory event index -> (role, +/-bytes)
    times = [event[0] for event in memory]
    for block in lifetimes(memory, roles.before_step):
        role = roles.role_at(block, block.made)
        if block.made is None:
            level[role] += block.size
        else:
            changes.setdefault(block.made_index, []).append((role, block.size))
        # the loss's too: the buffer a trained head's loss sums its weight's gradient into is that gradient later
        later = roles.becomes(block) if role in (UNATTRIBUTED, LOSS) else None
        if later is not None:  # from the first event of the phase whose end gives it its role
            after, role_then = later
            at = bisect.bisect_right(times, after)
            if at < len(memory) and (block.freed_index is None or at < block.freed_index):
                changes.setdefault(at, []).extend([(role, -block.size), (role_then, block.size)])
                role = role_then
        if block.freed_index is not None:
            changes.setdefault(block.freed_index, []).append((role, -block.size))
    start = ranges[0][0]
    out = {"ms": [], "roles": {role: [] for role in level}}
    for index in sorted(changes):  # a free of a block no role explains, made before the step, changes nothing
        for role, size in changes[index]:
            level[role] += size
        out["ms"].append((memory[index][0] - start) / per_ms)
        for role, value in level.items():
            out["roles"][role].append(value)
    out["phases"] = [((a - start) / per_ms, (b - start) / per_ms, name) for a, b, name in ranges]
    return with_peak(out)


def with_peak(timeline: dict) -> dict:
    """``timeline`` with ``peak_ms`` and ``peak_bytes``: where its roles' sum is highest."""
    totals = [sum(values) for values in zip(*timeline["roles"].values())]
    peak_index = max(range(len(totals)), key=totals.__getitem__)
    timeline["peak_ms"], timeline["peak_bytes"] = timeline["ms"][peak_index], totals[peak_index]
    return timeline
