"""memfit.settings.run.Run: the one resolved run a script's setup() hands to main(), and the estimate's Plan derived
from it."""

import dataclasses

import pytest

from conftest import run_settings
from memfit.args import StepSettings, TrainArgs
from memfit.prediction.estimate import plan_of
from memfit.settings.run import Run
from memfit.training.optim import OPTIMIZERS
from memfit.training.quantizers import QUANTIZERS


def test_the_run_holds_the_settings_setup_resolved(tmp_path):
    run = Run.of(**run_settings(tmp_path), method="lora", embedded=False)
    assert (run.method, run.seed, run.optimizer_args, run.world_size) == ("lora", 7, {"eps": 1e-6}, 2)
    with pytest.raises(TypeError, match="lora_r"):  # nothing enters the run unnamed, or by a name it does not have
        Run.of(**run_settings(tmp_path), method="lora", embedded=False, lora_r=8)
    assert run.run_dir.parent == tmp_path / "profiles" and run.run_dir.name.startswith("lora-checkpoint-")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 8  # main() and fit() read it; nothing changes it after setup()


def test_a_run_dir_given_is_kept(tmp_path):
    run = Run.of(**run_settings(tmp_path, seed=9), method="lora", embedded=True, run_dir=tmp_path / "here")
    assert (run.seed, run.embedded, run.run_dir) == (9, True, tmp_path / "here")


def test_an_estimate_names_its_dir_apart_from_runs(tmp_path):
    run = Run.of(**run_settings(tmp_path, estimate=True, model_name="Llama-2-7b-hf"), method="full", embedded=False)
    assert run.run_dir.name.startswith("full-estimate-Llama-2-7b-hf-")
    labelled = Run.of(**run_settings(tmp_path, label="stories15M"), method="pretrain", embedded=False)
    assert labelled.run_dir.name.startswith("pretrain-stories15M-")


def test_the_plan_is_the_runs_settings(tmp_path):
    """The estimate and the out-of-memory explanation plan with what runs: nothing restated by hand."""
    run = Run.of(**run_settings(tmp_path), method="lora", embedded=False)
    plan = plan_of(run)
    assert (plan.micro_batch_size, plan.accumulation, plan.sequence_length) == (2, 2, 64)  # the context: no flag
    # the registries' entries, as the run holds them: the estimate asks them, never their names
    assert (plan.precision, plan.quantize, plan.optimizer) == (
        "bf16-true",
        QUANTIZERS["bnb.nf4"],
        OPTIMIZERS["AdamW8bit"],
    )
    assert (plan.strategy, plan.world_size, plan.cpu_offload, plan.step_settings.max_norm) == ("fsdp", 2, True, 1.0)
    # the step's settings are --train's, each of the same name: what fit() gives train_step is what is traced
    assert {f.name for f in dataclasses.fields(StepSettings)} <= {f.name for f in dataclasses.fields(TrainArgs)}
    assert plan.step_settings == StepSettings.of(run.train)
    assert plan.activation_checkpointing and plan.accelerator == "cuda" and plan.cublas_workspaces > 0
    shorter = Run.of(**run_settings(tmp_path, train=TrainArgs(max_seq_length=16)), method="lora", embedded=False)
    assert plan_of(shorter).sequence_length == shorter.max_seq_length == 16
    longer = Run.of(**run_settings(tmp_path, train=TrainArgs(max_seq_length=4096)), method="lora", embedded=False)
    assert longer.max_seq_length == 64  # never past the model's context
    on_cpu = Run.of(**run_settings(tmp_path, accelerator="cpu"), method="lora", embedded=False)
    assert plan_of(on_cpu).cublas_workspaces == 0
