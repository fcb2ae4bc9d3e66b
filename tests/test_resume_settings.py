"""memfit.settings.resume_settings: the settings a resumed run must keep."""

from pathlib import Path

import pytest

from memfit.errors import UserError
from memfit.settings.resume_settings import compare_settings

STORED = {"train.lr": 0.001, "seed": 1337, "profile.enabled": True}


def test_a_changed_training_setting_is_refused_and_a_changed_view_is_not():
    compare_settings(Path("h.yaml"), STORED, {**STORED, "profile.enabled": False}, changed_data=False)
    # DDP's buckets beside the gradients or under them: the same update in other memory (a checkpoint saved before
    # the flag existed records none)
    compare_settings(Path("h.yaml"), STORED, {**STORED, "ddp.gradient_as_bucket_view": False}, changed_data=False)
    with pytest.raises(UserError, match="--seed is 7 here but 1337 in the run being resumed"):
        compare_settings(Path("h.yaml"), STORED, {**STORED, "seed": 7}, changed_data=False)


def test_a_flag_newer_than_the_checkpoint_resumes_at_the_value_the_run_had():
    """A checkpoint saved before --sample_order existed trained in the longest-early order: resuming it with the
    default goes on; asking for litgpt's order would change the rest of the epoch, and is refused."""
    compare_settings(Path("h.yaml"), STORED, {**STORED, "sample_order": "longest_early"}, changed_data=False)
    with pytest.raises(UserError, match="--sample_order is 'litgpt' here but None"):
        compare_settings(Path("h.yaml"), STORED, {**STORED, "sample_order": "litgpt"}, changed_data=False)


@pytest.mark.parametrize("key", ["train.loss_weighting", "train.max_norm"])
def test_a_train_flag_newer_than_the_checkpoint_needs_no_list_its_declared_default_is_the_old_behaviour(key):
    """``--train.*`` flags are checked against ``TrainArgs``' declared default: a checkpoint that does not record one
    resumes with that default (what it trained with) and is refused with any other value; no hand-kept list."""
    from dataclasses import fields

    from memfit.args import TrainArgs

    default = {field.name: field.default for field in fields(TrainArgs)}[key.removeprefix("train.")]
    compare_settings(Path("h.yaml"), STORED, {**STORED, key: default}, changed_data=False)
    other = "micro_batches" if key == "train.loss_weighting" else 1.0
    with pytest.raises(UserError, match=f"--{key} is {other!r} here but None in the run being resumed"):
        compare_settings(Path("h.yaml"), STORED, {**STORED, key: other}, changed_data=False)


def test_the_step_settings_are_the_train_fields_marked_as_such():
    """``StepSettings`` is derived from ``TrainArgs``: a field marked ``STEP_SETTING`` is in it with its type and
    default, and ``StepSettings.of`` copies a run's values."""
    from dataclasses import fields

    from memfit.args import STEP_SETTING, StepSettings, TrainArgs

    marked = [field.name for field in fields(TrainArgs) if field.metadata == STEP_SETTING]
    assert [field.name for field in fields(StepSettings)] == marked == ["max_norm"]
    assert StepSettings() == StepSettings(max_norm=None)
    assert StepSettings.of(TrainArgs(max_norm=0.5, lr=1.0)) == StepSettings(max_norm=0.5)


@pytest.mark.parametrize(
    "stored, given, same",
    [
        ("AdamW", "AdamW-foreach", True),  # PyTorch's kernels: the same update and state
        ("AdamW-for-loop", "AdamW", True),
        ("AdamW", "AdamW8bit", False),  # 8-bit state trains otherwise
        ("AdamW", "SGD", False),
        ("AdamW", {"class_path": "torch.optim.AdamW"}, False),  # not a registry name: compared as given
    ],
)
def test_a_resume_may_change_the_adamw_kernel_and_nothing_else_of_the_optimizer(stored, given, same):
    settings = {**STORED, "optimizer": stored}
    if same:
        compare_settings(Path("h.yaml"), settings, {**settings, "optimizer": given}, changed_data=False)
    else:
        with pytest.raises(UserError, match="--optimizer is"):
            compare_settings(Path("h.yaml"), settings, {**settings, "optimizer": given}, changed_data=False)


def test_a_resume_may_switch_compile_on_or_off():
    """--compile runs the same training in compiled kernels: a run may continue compiled (or eager), and a checkpoint
    saved before the flag existed resumes with it either way."""
    for given in (True, False):
        compare_settings(Path("h.yaml"), STORED, {**STORED, "compile": given}, changed_data=False)
        compare_settings(Path("h.yaml"), {**STORED, "compile": not given}, {**STORED, "compile": given}, False)
