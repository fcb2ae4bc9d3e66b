"""The CUDA ledger path on a real GPU run's output, on any machine: ``tests/data/cuda_run/`` holds the ledger,
summary and allocator snapshot of the README's signature command as the GPU check ran it
(``benchmarks/gpu_check.py``'s ``signature_command``; copied from its ``results.tgz``). Skipped until a lent GPU has
produced them."""

import json
import pickle
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "data" / "cuda_run"


@pytest.fixture(scope="module")
def run():
    if not (FIXTURE / "ledger.json").is_file():
        pytest.skip(f"{FIXTURE} is absent: bash benchmarks/gpu_session.sh on a GPU machine brings it back")
    return json.loads((FIXTURE / "ledger.json").read_text()), json.loads((FIXTURE / "summary.json").read_text())


def test_the_gpu_ledger_finds_what_was_alive_at_each_peak(run):
    """Every phase's peak broken down from the allocator's own events, with under 5% not found."""
    ledger, _ = run
    assert ledger["device"] == "cuda" and ledger["complete"]
    for name, phase in ledger["phases"].items():
        assert phase["not_found_bytes"] is not None, name
        assert abs(phase["not_found_bytes"]) <= 0.05 * phase["peak_bytes"], (name, phase)


def test_the_gpu_runs_peak_is_the_ledgers(run):
    """The summary's per-phase peaks (the allocator's, reset per phase, over every step) and the ledger's step agree
    within 3%: the step the ledger describes is the run's peak one."""
    ledger, summary = run
    assert summary["memory"]["measures"] == "cuda_allocated"
    run_peak = max(summary["memory"]["peak_bytes"].values())
    ledger_peak = max(phase["peak_bytes"] for phase in ledger["phases"].values())
    assert abs(run_peak - ledger_peak) <= 0.03 * run_peak, (run_peak, ledger_peak)


def test_the_allocator_snapshot_reads_as_blocks_within_the_steps_peak(run):
    """The snapshot (dumped when the ledger's step ended) read by memfit's one snapshot reader: live blocks whose
    total is what the step ended holding, no more than its peak, no less than the weights."""
    from memfit.observatory.allocator_snapshot import active_blocks

    ledger, _ = run
    path = FIXTURE / "memory_snapshot.pickle"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    alive = sum(active_blocks(snapshot["segments"]).values())
    peak = max(phase["peak_bytes"] for phase in ledger["phases"].values())
    weights = sum(
        ledger["phases"]["zero_grad"]["found_at_peak_bytes"].get(role, 0)
        for role in ("params_trainable", "params_frozen", "params_quantized")
    )
    assert weights <= alive <= peak, (weights, alive, peak)
