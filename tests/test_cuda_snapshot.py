"""Memfit's reading of the CUDA allocator's snapshot, on a snapshot torch wrote on a real GPU (an H200:
``benchmarks/cuda_snapshot_fixture.py``), checked against what was measured apart from it on the same GPU at the same
moment: the tensors' own data pointers and sizes, and the allocator's counters. Runs on any machine."""

import json
import pickle
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "data" / "cuda_snapshot"


@pytest.fixture(scope="module")
def snapshot():
    if not (FIXTURE / "segments.pickle").is_file():
        pytest.skip(f"{FIXTURE} is absent: python benchmarks/cuda_snapshot_fixture.py writes it on a GPU machine")
    with open(FIXTURE / "segments.pickle", "rb") as f:
        segments = pickle.load(f)
    return segments, json.loads((FIXTURE / "expected.json").read_text())


def test_every_live_tensor_is_a_block_at_its_address_with_its_size(snapshot):
    from memfit.observatory.allocator_snapshot import active_blocks

    segments, expected = snapshot
    blocks = active_blocks(segments)
    for name, tensor in expected["tensors"].items():
        assert blocks.get(tensor["address"]) == tensor["bytes"], name


def test_block_addresses_laid_out_from_the_segment_are_torchs_own(snapshot):
    """The reader places each block after the previous one from its segment's address (as PyTorch's memory_viz
    does); torch's own snapshot also records each block's address: they agree, and the live blocks' rounded sizes add
    up to the allocator's memory_allocated() at the same moment."""
    from memfit.observatory.allocator_snapshot import active_blocks

    segments, expected = snapshot
    recorded = {b["address"]: b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"}
    assert set(active_blocks(segments)) == set(recorded)
    assert sum(b["size"] for b in recorded.values()) == expected["memory_allocated"]
    assert sum(s["total_size"] for s in segments) == expected["memory_reserved"]


def test_the_blocks_with_no_tensor_are_the_cublas_workspaces(snapshot):
    """What the ledger lists as alive with no role: here every tensor is known, so what is left is the two cuBLAS
    workspaces (one per thread that ran a matmul), as many bytes as freeing them gave back to the allocator."""
    from memfit.observatory.allocator_snapshot import blocks_without_role

    segments, expected = snapshot
    known = {t["address"]: (name, t["bytes"]) for name, t in expected["tensors"].items()}
    without_role = blocks_without_role(segments, known)
    assert len(without_role) == 2
    assert sum(without_role.values()) == expected["cublas_workspaces_bytes"]
