"""The CUDA caching allocator's snapshot (``torch.cuda.memory_snapshot()``) read as live blocks: which are alive,
which hold no role's tensor, which a call freed (PyTorch's cuBLAS workspaces, measured so)."""

from __future__ import annotations

import torch


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

    A training process holds two (``memfit.prediction.estimate.cublas_workspace_bytes`` says why and how big), allocated
    at its first matmuls and never freed: alive at every peak, belonging to no tensor, at the same addresses for the
    life of the process. ``torch._C._cuda_clearCublasWorkspaces`` (what CUDA
    graph capture calls) releases them to the allocator's cache; the blocks it frees are the workspaces. The next
    matmul takes a workspace again, from the cache. Called after training
    (``memfit.observatory.report.complete_ledger``), so no step, trace or memory history the ledger reads is changed by
    it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return {}
    torch.cuda.synchronize(device)
    before = device_segments(device)
    clear()
    return freed_between(before, device_segments(device))


def device_segments(device: torch.device) -> list[dict]:
    """``torch.cuda.memory_snapshot()``'s segments on ``device`` (the snapshot covers every device of the process)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [segment for segment in torch.cuda.memory_snapshot() if segment.get("device", index) == index]
