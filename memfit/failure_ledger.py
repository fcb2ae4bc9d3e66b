"""What was alive at an out-of-memory, read at the failure itself: the run's roles by address, the activations the
failed step's autograd graphs still save, the other tensors Python still holds, and (on CUDA) every live block of
the allocator, written to ``<run dir>/oom/`` so that the explanation names what filled the device, not only its
totals.

Read while the failed step's frames are still alive (before ``memfit.oom.release_failed_step``): the error's
traceback holds its tensors, and the graphs built up to the failure hold what they saved for backward.
"""

from __future__ import annotations

import gc
import json
import pickle
import re
import warnings
from pathlib import Path

import torch

from memfit.allocator_snapshot import active_blocks
from memfit.memory import fmt_bytes
from memfit.roles import role_addresses

LARGEST = 10
"""How many of the largest tensors outside the roles the ledger lists"""


def _failing_request(error: BaseException) -> int | None:
    """The bytes the failed allocation asked for, from the allocator's message (CUDA's "Tried to allocate 2.00 GiB",
    the CPU allocator's "you tried to allocate 8589934592 bytes")."""
    text = str(error)
    if found := re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", text):
        number, unit = found.groups()
        return int(float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit])
    if found := re.search(r"allocate (\d+) bytes", text):
        return int(found.group(1))
    return None


def _saved_by_graphs(tensors: list[torch.Tensor]) -> dict[int, tuple[int, str, torch.Tensor]]:
    """``{storage address: (bytes, the saving node's name, tensor)}`` of what the autograd graphs behind ``tensors``
    save for backward (their nodes' ``_saved_*`` tensors), each node visited once."""
    saved: dict[int, tuple[int, str, torch.Tensor]] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed already (backward ran through this node)
                continue
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    saved.setdefault(storage.data_ptr(), (storage.nbytes(), node.name(), tensor))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return saved


def alive_at_failure(error: BaseException, model, optimizer, device: torch.device) -> dict:
    """The failure's ledger: each role's bytes, the activations saved by the graphs still alive, the other tensors
    Python holds, and the largest of those two kinds, each with its shape, dtype and what holds it."""
    roles = role_addresses(model, optimizer) if model is not None else {}
    by_role: dict[str, int] = {}
    for role, size in roles.values():
        by_role[role] = by_role.get(role, 0) + size
    with warnings.catch_warnings():  # isinstance on some of gc's objects (torch's deprecated aliases) warns
        warnings.simplefilter("ignore")
        held = [
            obj
            for obj in gc.get_objects()
            if isinstance(obj, torch.Tensor) and obj.device.type == device.type and not obj.is_meta
        ]
    saved = _saved_by_graphs(held)
    others: dict[int, tuple[int, str, torch.Tensor]] = {}
    for tensor in held:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address and address not in roles and address not in saved:
            others.setdefault(address, (storage.nbytes(), "held by Python (not saved for backward)", tensor))
    saved = {address: entry for address, entry in saved.items() if address not in roles}
    by_role["activations"] = sum(size for size, _, _ in saved.values())
    by_role["other_tensors"] = sum(size for size, _, _ in others.values())
    largest = sorted([*saved.values(), *others.values()], key=lambda entry: -entry[0])[:LARGEST]
    ledger = {
        "device": str(device),
        "error": (str(error).splitlines() or [""])[0],
        "failing_request_bytes": _failing_request(error),
        "bytes_by_role": by_role,
        "largest": [
            {
                "bytes": size,
                "held_by": ("saved by " + holder) if not holder.startswith("held by") else holder,
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
            }
            for size, holder, tensor in largest
        ],
    }
    if device.type == "cuda":
        segments = torch.cuda.memory_snapshot(device)
        blocks = active_blocks(segments)
        known = set(roles) | set(saved) | set(others)
        ledger["cuda_live_blocks_bytes"] = sum(blocks.values())
        ledger["cuda_blocks_nothing_here_holds_bytes"] = sum(s for a, s in blocks.items() if a not in known)
    return ledger


def write_failure_ledger(run_dir: Path, ledger: dict, device: torch.device, rank: int = 0) -> Path:
    """``<run dir>/oom/ledger.json`` (``ledger-rank<N>.json`` past rank 0), and on CUDA the allocator's snapshot
    beside it, which pytorch.org/memory_viz opens (with each block's Python frames where its history was recorded)."""
    out = Path(run_dir) / "oom"
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"-rank{rank}" if rank else ""
    path = out / f"ledger{suffix}.json"
    path.write_text(json.dumps(ledger, indent=2))
    if device.type == "cuda":
        with open(out / f"memory_snapshot{suffix}.pickle", "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(device), f)
    return path


def holders_line(ledger: dict, count: int = 3) -> str:
    """The largest holders at the failure, for the explanation's lines."""
    roles = sorted(((size, role) for role, size in ledger["bytes_by_role"].items() if size), reverse=True)
    parts = [f"{role} {fmt_bytes(size)}" for size, role in roles[:count]]
    line = "Largest holders at the failure: " + ", ".join(parts)
    if ledger["largest"]:
        top = ledger["largest"][0]
        line += (
            f"; the largest tensor outside the weights, gradients and optimizer state: {fmt_bytes(top['bytes'])}"
            f" {top['dtype']}{top['shape']} {top['held_by']}"
        )
    if ledger["failing_request_bytes"]:
        line += f"; the failed request: {fmt_bytes(ledger['failing_request_bytes'])}"
    return line
