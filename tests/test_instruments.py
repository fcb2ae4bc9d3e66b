"""memfit.settings.instruments.Instruments: the run's measuring as one object. With profiling off the step is the step,
with nothing recorded; where the window records, the same step is taken under the profiler and the ledger explains
it."""

import lightning as L
import torch

from conftest import run_settings
from memfit.args import ProfileArgs, StepSettings
from memfit.settings.instruments import Instruments
from memfit.settings.run import Run


def _train_step(fabric, model, optimizer, micro_batches, shares, settings, phases, step):
    """A script's train_step, cut to what the instruments see: its phases."""
    with phases("forward"):
        loss = sum(model(batch["input_ids"]).square().mean() * share for batch, share in zip(micro_batches, shares))
    with phases("backward"):
        loss.backward()
    with phases("optimizer_step"):
        optimizer.step()
    with phases("zero_grad"):
        optimizer.zero_grad(set_to_none=True)
    return loss.detach(), torch.zeros(())


def _steps(tmp_path, profile: ProfileArgs, steps: int = 4) -> tuple[Instruments, list[float]]:
    run = Run.of(**run_settings(tmp_path, profile=profile, accelerator="cpu"), method="lora", embedded=True)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    instruments = Instruments(fabric, run, run_dir=tmp_path / "run")
    instruments.watch(model, optimizer)
    batch = {"input_ids": torch.randn(8, 64)}
    losses = []
    with instruments.steps(0, steps):
        for step in range(steps):
            loss, _ = instruments.step(
                _train_step,
                optimizer,
                [batch],
                fabric=fabric,
                model=model,
                shares=[1.0],
                settings=StepSettings(),
                step=step + 1,
            )
            losses.append(loss.item())
    return instruments, losses


def test_profiling_off_takes_the_step_and_records_nothing(tmp_path):
    instruments, losses = _steps(tmp_path, ProfileArgs(enabled=False))
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert not instruments.record.ledger.phases and instruments.record.trace_files == []
    # still measured, the first step's optimizer step (which made the state) apart too
    assert set(instruments.memory.last) == {
        "forward",
        "backward",
        "optimizer_step",
        "zero_grad",
        "first_optimizer_step",
    }
    assert instruments.scalars()["memory/step_peak_gib"] > 0


def test_the_recorded_step_is_the_same_step_explained(tmp_path):
    """The default window records one step: the ledger has its phases, the trace is written, and the losses are the
    ones the unprofiled run takes (the instruments change nothing of the training)."""
    instruments, losses = _steps(tmp_path, ProfileArgs())
    _, unprofiled = _steps(tmp_path / "off", ProfileArgs(enabled=False))
    assert losses == unprofiled  # exactly: the recorded step is the same step
    ledger = instruments.record.ledger
    assert list(ledger.phases) == ["forward", "backward", "optimizer_step", "zero_grad"]
    assert instruments.record.trace_files and all(path.is_file() for path in instruments.record.trace_files)
    weights = 64 * 64 * 4
    assert ledger.phases["optimizer_step"].peak >= 3 * weights  # weights, gradients, two AdamW moments at least
