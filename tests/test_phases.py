"""memfit.observatory.phases: the recorded step under the memory instrumentation, which must never cost a run."""

import pytest
import torch

from conftest import (
    instrumentation_fails_in,
    run_in_process,
    run_summary,
)


@pytest.mark.slow
def test_a_recorded_step_that_fails_under_the_instrumentation_is_taken_again_without_it(
    tmp_path, embedded, monkeypatch
):
    """The recorded step fails half-way through its backward, inside autograd's engine (some of the failed attempt's
    gradients accumulated), as the instrumentation failing would: the run warns in one line, takes
    the step again without the instrumentation, and ends with the same weights as a run whose recorded step did not
    fail (the same batches in the same order: the window's plan puts the longest one in the recorded step), and with
    no trace or ledger."""
    common = [
        "--train.max_steps",
        "4",
        "--train.micro_batch_size",
        "2",
        "--train.global_batch_size",
        "4",
        "--logger_name",
        "csv",
        "--eval.interval",
        "100",
    ]
    (tmp_path / "failed").mkdir(), (tmp_path / "recorded").mkdir()
    recorded = run_in_process("finetune/full.py", *common, cwd=tmp_path / "recorded")
    instrumentation_fails_in(monkeypatch, "backward")
    failed = run_in_process("finetune/full.py", *common, cwd=tmp_path / "failed")
    assert failed.returncode == 0 and recorded.returncode == 0, failed.stderr[-2000:] + recorded.stderr[-2000:]
    warnings = [line for line in failed.stdout.splitlines() if line.startswith("warning:")]
    assert (
        len(warnings) == 1
        and "the recorded step failed under the memory instrumentation (RuntimeError:"
        " simulated failure of the recorded step in backward"
        in warnings[0]
    ), failed.stdout[-2000:]
    a = torch.load(tmp_path / "failed/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "recorded/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:  # the failed attempt's gradients were dropped: the step counts its batches once
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    summary = run_summary(tmp_path / "failed/out/profiles")
    assert summary["steps"] == 4 and summary["ledger_peak_bytes"] is None and summary["profile_traces"] == []
    assert not list((tmp_path / "failed/out/profiles").glob("*/ledger.json"))


@pytest.mark.slow
def test_a_recorded_step_that_fails_after_its_update_is_not_taken_again(tmp_path, embedded, monkeypatch):
    """The instrumentation fails after optimizer.step() (at the end of zero_grad): taking the step again would apply
    the update twice. The run warns, keeps the one update, and ends with the weights of a run that did not fail."""
    common = [
        "--train.max_steps",
        "4",
        "--train.micro_batch_size",
        "2",
        "--train.global_batch_size",
        "4",
        "--logger_name",
        "csv",
        "--eval.interval",
        "100",
    ]
    (tmp_path / "failed").mkdir(), (tmp_path / "recorded").mkdir()
    recorded = run_in_process("finetune/full.py", *common, cwd=tmp_path / "recorded")
    instrumentation_fails_in(monkeypatch, "zero_grad")
    failed = run_in_process("finetune/full.py", *common, cwd=tmp_path / "failed")
    assert failed.returncode == 0 and recorded.returncode == 0, failed.stderr[-2000:] + recorded.stderr[-2000:]
    warnings = [line for line in failed.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "in zero_grad" in warnings[0] and "after the weights were updated" in warnings[0], (
        failed.stdout[-2000:]
    )
    a = torch.load(tmp_path / "failed/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "recorded/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_the_ledger_says_when_a_gradient_scaler_skipped_the_recorded_update():
    """16-mixed's gradient scaler skips the optimizer's update when the scaled gradients overflow (often a run's
    first steps): the recorded step's optimizer_step then holds none of the update's memory, and the ledger says so.
    A real GradScaler (its CPU form) on a real step, once with overflowed gradients and once without."""
    from memfit.memory import MemoryProbe
    from memfit.observatory.ledger import Ledger
    from memfit.observatory.phases import PhaseMemory, recorded_step

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    memory = PhaseMemory(MemoryProbe(torch.device("cpu")))
    memory.model, memory.optimizer = model, optimizer

    def take_step(overflow: bool):
        with memory.phase("forward"):
            loss = model(torch.randn(4, 8)).pow(2).mean() * (float("inf") if overflow else 1.0)
        with memory.phase("backward"):
            scaler.scale(loss).backward()
        with memory.phase("optimizer_step"):
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss, loss

    outcomes = {}
    for overflow in (True, False):
        ledger = Ledger(device="cpu", measures="test")
        before = model.weight.detach().clone()
        recorded_step(lambda: take_step(overflow), memory, ledger, None, optimizer, warn=print)
        outcomes[overflow] = (ledger.update_skipped, torch.equal(before, model.weight))
        assert ledger.as_dict()["update_skipped"] == ledger.update_skipped
    assert outcomes == {True: (True, True), False: (False, False)}
