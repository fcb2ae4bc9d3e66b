"""memfit.settings.resolve: what each flag becomes before the run is built, and the combinations it refuses (in one
line, before anything is written). The scripts' end-to-end refusals are in tests/test_bad_input.py."""

import pytest

from memfit.args import EvalArgs, FSDPArgs, ProfileArgs, TrainArgs
from memfit.errors import UserError
from memfit.settings.resolve import resolve_hardware, resolve_training, run_name


def _train_args(**fields) -> TrainArgs:
    return TrainArgs(max_steps=10, **fields)


def _hardware(**changes):
    settings = {
        "accelerator": "cpu",
        "precision": None,
        "quantize": None,
        "devices": 1,
        "num_nodes": 1,
        "strategy": "auto",
        "fsdp": FSDPArgs(),
        "estimate": False,
    } | changes
    return resolve_hardware(**settings)


def test_precision_defaults_and_litgpt_aliases():
    assert _hardware() == ("cpu", "32-true", 1)
    assert _hardware(precision="bf16") == ("cpu", "bf16-mixed", 1)  # Lightning's older name, which litgpt passes on
    assert _hardware(precision="32")[1] == "32-true"
    # the one precision bitsandbytes' int8 training computes in, not left to be refused
    assert _hardware(quantize="bnb.int8-training")[1] == "16-true"
    # an estimate plans a GPU run unless --accelerator cpu says otherwise, whatever this machine has
    assert _hardware(accelerator="auto", estimate=True)[0] == "cuda"
    assert _hardware(accelerator="cpu", estimate=True)[0] == "cpu"


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"precision": "16-mixed"}, "--precision 16-mixed needs a GPU"),
        ({"quantize": "bnb.nf4", "devices": 2}, "use --quantize torchao.nf4 --strategy fsdp"),
        ({"quantize": "bnb.nf4", "precision": "bf16-mixed"}, "cannot be combined with --precision bf16-mixed"),
        ({"quantize": "bnb.int8-training", "precision": "bf16-true"}, "needs --precision 16-true"),
        ({"devices": 0}, "--devices 0 / --num_nodes 1: both must be at least 1"),
    ],
)
def test_impossible_hardware_is_refused_in_one_line(changes, says):
    with pytest.raises(UserError, match=says) as refused:
        _hardware(**changes)
    assert "\n" not in str(refused.value)


def _training(train: TrainArgs, **changes):
    settings = {
        "train": train,
        "eval": EvalArgs(),
        "profile": ProfileArgs(),
        "optimizer": "AdamW",
        "optimizer_in_backward": False,
        "strategy": "auto",
        "world_size": 1,
        "seed": 1337,
        "precision": "32-true",
    } | changes
    return resolve_training(**settings)


def test_accumulation_is_the_global_batch_over_micro_batches_and_processes():
    train = _train_args(global_batch_size=16, micro_batch_size=2)
    assert _training(train)[3] == 8
    assert _training(train, world_size=4, strategy="fsdp")[3] == 2


def test_a_litgpt_optimizer_block_sets_the_schedule():
    block = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-4, "weight_decay": 0.0, "betas": [0.9, 0.95]}}
    train, name, args, _ = _training(_train_args(global_batch_size=4, micro_batch_size=4), optimizer=block)
    assert (train.lr, train.weight_decay, name, args) == (2e-4, 0.0, "AdamW", {"betas": (0.9, 0.95)})


@pytest.mark.parametrize(
    ("train", "changes", "says"),
    [
        (_train_args(global_batch_size=8, micro_batch_size=2), {"optimizer_in_backward": True}, "4 micro-batches"),
        (
            _train_args(global_batch_size=2, micro_batch_size=2, max_norm=1.0),
            {"optimizer_in_backward": True},
            "max_norm",
        ),
        (_train_args(global_batch_size=2, micro_batch_size=2), {"seed": -1}, "--seed -1"),
        (_train_args(global_batch_size=2, micro_batch_size=2, tie_embeddings=True), {}, "for pretraining"),
        (_train_args(global_batch_size=2, micro_batch_size=2), {"optimizer": "Adam"}, "'Adam' is not one of AdamW"),
    ],
)
def test_impossible_training_is_refused_in_one_line(train, changes, says):
    with pytest.raises(UserError, match=says) as refused:
        _training(train, **changes)
    assert "\n" not in str(refused.value)


def test_runs_started_together_get_their_own_dirs(tmp_path):
    first = run_name("lora", tmp_path / "checkpoint", None, True, tmp_path)
    (tmp_path / first).mkdir()
    second = run_name("lora", tmp_path / "checkpoint", None, True, tmp_path)
    assert first.startswith("lora-embedded-") and second != first
    assert run_name("full", tmp_path, "org/model", False, tmp_path).startswith("full-org-model-")
