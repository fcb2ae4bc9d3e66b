"""The one replay of a step's allocations and frees: each block's lifetime, and the role it had at a moment.

The ledger asks what was alive at each phase's peak (``alive_at``), the picture and the estimate's picture what each
allocation was when it was made (``Roles.role_at`` at its own time); both read the same lifetimes with the same rule.

A role comes from the address maps the phases took at their ends (``{data_ptr: (role, bytes)}``): at a moment ``t``,
a block has the role its address has in the map of the first phase end at or after ``t``, if the block was still
alive at that end (else the address there is another block's); failing that, the role it had at the first phase end
after it was made (FSDP's unsharded gradients of an earlier micro-batch, activations freed in backward). A block
alive since before the step has the role of its address then. What has none is unattributed, or FSDP's gathered
weights where an all-gather on its own thread made it, or activations where a checkpointed block's recomputation in
backward made it and backward kept it past the recomputation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from memfit.observatory.roles import GATHERED, LOSS, UNATTRIBUTED, WORKSPACES
from memfit.trace_events import within_any


@dataclass
class Block:
    address: int
    size: int
    made: float | None
    """When the trace made it; ``None``: alive since before the step"""
    freed: float | None = None
    """When the trace freed it; ``None``: alive at the trace's end"""
    thread: object = None
    made_index: int = -1
    freed_index: int | None = None
    """Where in the memory events it was made and freed (several events can share a timestamp)"""

    def alive_at(self, t: float) -> bool:
        return (self.made is None or self.made <= t) and (self.freed is None or self.freed > t)


def maps_at_phase_ends(addresses: dict[str, list[dict]], ends: list[tuple[float, str]]) -> list[tuple[float, dict]]:
    """``(end time, address map)`` of each phase occurrence (``ends``: its end time and phase name, in time order):
    the k-th occurrence of a phase takes the k-th map taken at that phase's end (``addresses``: phase -> maps)."""
    seen: dict[str, int] = {}
    maps = []
    for end, name in ends:
        k = seen[name] = seen.get(name, -1) + 1
        taken = addresses.get(name, [])
        maps.append((end, taken[k] if k < len(taken) else {}))
    return maps


class Roles:
    """What each address was during the step: the maps taken at the phases' ends, what was alive before the step,
    the cuBLAS workspaces and FSDP's all-gathers.

    ``ledger`` gives ``addresses`` (phase -> maps), ``baseline_addresses`` and ``cublas_workspaces``; ``ends`` is
    each phase occurrence's ``(end time, name)`` in time order; ``memory`` the step's memory events (as
    ``lifetimes`` reads them); ``gathering`` the all-gathers' ``(start, end, thread)``, ``recomputing`` the
    checkpointed blocks' recomputations', ``in_loss`` the loss's ranges (what is made there without another role is
    the loss's). A cuBLAS workspace the step
    itself made (a new thread's) counts from when it was made, not from before the step."""

    def __init__(
        self, ledger, ends: list[tuple[float, str]], memory: list[tuple], gathering=(), recomputing=(), in_loss=()
    ) -> None:
        maps = maps_at_phase_ends(ledger.addresses, ends)
        self.ends = [end for end, _ in maps]
        self.maps = [known for _, known in maps]
        self.workspaces = dict(ledger.cublas_workspaces)
        self.gathering = list(gathering)
        self.recomputing = list(recomputing)
        self.in_loss = list(in_loss)
        allocated_in_step = {address for _, _, size, address, _ in memory if size > 0}
        self.before_step: dict[int, tuple[str, int]] = dict(ledger.baseline_addresses) | {
            address: (WORKSPACES, size) for address, size in self.workspaces.items() if address not in allocated_in_step
        }
        """``{address: (role, bytes)}`` of the blocks alive when the step began"""

    def _in_map(self, i: int, block: Block) -> str:
        role, _ = self.maps[i].get(block.address, (WORKSPACES if block.address in self.workspaces else UNATTRIBUTED, 0))
        if block.freed is not None and block.freed <= self.ends[i]:
            return UNATTRIBUTED  # gone before that end: the address there is another block's
        return role

    def role_at(self, block: Block, t: float) -> str:
        """The role of ``block`` at time ``t`` (see the module doc)."""
        if block.made is None:
            return self.before_step[block.address][0]
        i = bisect.bisect_left(self.ends, t)
        role = self._in_map(i, block) if i < len(self.ends) else UNATTRIBUTED
        if role == UNATTRIBUTED:
            first = bisect.bisect_left(self.ends, block.made)
            if first < min(i, len(self.ends)):
                role = self._in_map(first, block)
        if role == UNATTRIBUTED and within_any(self.gathering, block.made, block.thread):
            role = GATHERED
        if role == UNATTRIBUTED and self._recomputed(block):
            role = "activations"
        if role == UNATTRIBUTED and within_any(self.in_loss, block.made, block.thread):
            role = LOSS
        return role

    def becomes(self, block: Block) -> tuple[float, str] | None:
        """For a block made without a role that takes one at a later phase end while alive (the buffer a trained
        head's loss sums its weight's gradient into in forward, the weight's gradient from backward on): the end of
        the phase before the one it takes its role in, and the role; else None."""
        if block.made is None:
            return None
        first = bisect.bisect_left(self.ends, block.made)
        for i in range(first + 1, len(self.ends)):
            if block.freed is not None and block.freed <= self.ends[i - 1]:
                return None
            role = self._in_map(i, block)
            if role != UNATTRIBUTED:
                return self.ends[i - 1], role
        return None

    def _recomputed(self, block: Block) -> bool:
        """Made by a checkpointed block's forward run again in backward, and kept past it for backward (what the
        recomputation frees before it ends is its scratch)."""
        return any(
            start <= block.made <= end and thread == block.thread and (block.freed is None or block.freed > end)
            for start, end, thread in self.recomputing
        )


def lifetimes(memory: list[tuple], before_step: dict[int, tuple[str, int]]) -> list[Block]:
    """Every block of a step: those alive before it (``before_step``: ``{address: (role, bytes)}``) and those the
    memory events made (``memory``: ``(time, total, +/-bytes, address, thread)`` in time order), each with when it
    was made and freed.

    A free of an address no block holds is a block from before the step that no role explains (CPU traces do not
    count it): it is left out. An allocation at an address a block still holds means the trace missed that block's
    free: it ends there."""
    holding: dict[int, Block] = {address: Block(address, size, made=None) for address, (_, size) in before_step.items()}
    blocks = list(holding.values())
    for index, (ts, _, size, address, thread) in enumerate(memory):
        previous = holding.pop(address, None)
        if previous is not None:
            previous.freed, previous.freed_index = ts, index
        if size > 0:
            holding[address] = Block(address, size, made=ts, thread=thread, made_index=index)
            blocks.append(holding[address])
    return blocks


def alive_at(blocks: list[Block], t: float, roles: Roles) -> list[tuple[Block, str]]:
    """The blocks alive at time ``t`` (frees at ``t`` done), each with its role then."""
    return [(block, roles.role_at(block, t)) for block in blocks if block.alive_at(t)]
