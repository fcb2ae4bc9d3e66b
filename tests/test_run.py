"""memfit.run.Run: the one resolved run a script's setup() hands to main(), and the estimate's Plan derived from it."""

import dataclasses
from pathlib import Path

import pytest
from litgpt import Config

from memfit.args import EvalArgs, FSDPArgs, LogArgs, TrainArgs
from memfit.profiling import ProfileArgs
from memfit.run import Run


def _locals(tmp_path: Path, **changes) -> dict:
    """What a setup()'s locals() hold once it has resolved its flags (and names that are not the run's)."""
    return {
        "checkpoint_dir": tmp_path / "checkpoint",
        "out_dir": tmp_path / "out",
        "profile_dir": tmp_path / "profiles",
        "config": Config(block_size=64, n_layer=2, n_embd=32, n_head=4, vocab_size=100, padded_vocab_size=128),
        "data": None,
        "train": TrainArgs(micro_batch_size=2, global_batch_size=8, max_seq_length=None, max_norm=1.0),
        "eval": EvalArgs(),
        "optimizer": "AdamW8bit",
        "optimizer_args": {"eps": 1e-6},
        "optimizer_in_backward": False,
        "precision": "bf16-true",
        "quantize": "bnb.nf4",
        "accelerator": "cuda",
        "devices": 2,
        "num_nodes": 1,
        "strategy": "fsdp",
        "fsdp": FSDPArgs(cpu_offload=True),
        "activation_checkpointing": True,
        "accumulation": 2,
        "profile": ProfileArgs(),
        "resume_from": None,
        "resume_with_changed_data": False,
        "overwrite": False,
        "seed": 7,
        "hparams": {},
        "memory_budget": None,
        "logger_name": "csv",
        "log": LogArgs(),
        "model_name": None,
        "lora_r": 8,  # the method's own flag: in the config, not the run
        "flags": {},
        "estimate": False,
        **changes,
    }


def test_the_run_is_the_resolved_locals(tmp_path):
    run = Run.of(_locals(tmp_path), method="lora", embedded=False)
    assert (run.method, run.seed, run.optimizer_args, run.world_size) == ("lora", 7, {"eps": 1e-6}, 2)
    assert not hasattr(run, "lora_r")
    assert run.run_dir.parent == tmp_path / "profiles" and run.run_dir.name.startswith("lora-checkpoint-")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 8  # main() and fit() read it; nothing changes it after setup()


def test_what_setup_passes_wins_over_its_locals(tmp_path):
    run = Run.of(_locals(tmp_path), method="lora", embedded=True, seed=9, run_dir=tmp_path / "here")
    assert (run.seed, run.embedded, run.run_dir) == (9, True, tmp_path / "here")


def test_an_estimate_names_its_dir_apart_from_runs(tmp_path):
    run = Run.of(_locals(tmp_path, estimate=True, model_name="Llama-2-7b-hf"), method="full", embedded=False)
    assert run.run_dir.name.startswith("full-estimate-Llama-2-7b-hf-")
    labelled = Run.of(_locals(tmp_path, label="stories15M"), method="pretrain", embedded=False)
    assert labelled.run_dir.name.startswith("pretrain-stories15M-")


def test_the_plan_is_the_runs_settings(tmp_path):
    """The estimate and the out-of-memory explanation plan with what runs: nothing restated by hand."""
    run = Run.of(_locals(tmp_path), method="lora", embedded=False)
    plan = run.plan()
    assert (plan.micro_batch_size, plan.accumulation, plan.sequence_length) == (2, 2, 64)  # the context: no flag
    assert (plan.precision, plan.quantize, plan.optimizer) == ("bf16-true", "bnb.nf4", "AdamW8bit")
    assert (plan.strategy, plan.world_size, plan.cpu_offload, plan.max_norm) == ("fsdp", 2, True, 1.0)
    assert plan.activation_checkpointing and plan.accelerator == "cuda" and plan.cublas_workspaces > 0
    shorter = Run.of(_locals(tmp_path, train=TrainArgs(max_seq_length=16)), method="lora", embedded=False)
    assert shorter.plan().sequence_length == shorter.max_seq_length == 16
    longer = Run.of(_locals(tmp_path, train=TrainArgs(max_seq_length=4096)), method="lora", embedded=False)
    assert longer.max_seq_length == 64  # never past the model's context
    on_cpu = Run.of(_locals(tmp_path, accelerator="cpu"), method="lora", embedded=False)
    assert on_cpu.plan().cublas_workspaces == 0
