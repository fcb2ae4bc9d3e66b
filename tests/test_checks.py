"""memfit.checks: the settings a resumed run must keep."""

from pathlib import Path

import pytest

from memfit.checks import compare_settings
from memfit.errors import UserError

STORED = {"train.lr": 0.001, "seed": 1337, "profile.enabled": True}


def test_a_changed_training_setting_is_refused_and_a_changed_view_is_not():
    compare_settings(Path("h.yaml"), STORED, {**STORED, "profile.enabled": False}, changed_data=False)
    with pytest.raises(UserError, match="--seed is 7 here but 1337 in the run being resumed"):
        compare_settings(Path("h.yaml"), STORED, {**STORED, "seed": 7}, changed_data=False)


def test_a_flag_newer_than_the_checkpoint_resumes_at_the_value_the_run_had():
    """A checkpoint saved before --sample_order existed trained in the longest-early order: resuming it with the
    default goes on; asking for litgpt's order would change the rest of the epoch, and is refused."""
    compare_settings(Path("h.yaml"), STORED, {**STORED, "sample_order": "longest_early"}, changed_data=False)
    with pytest.raises(UserError, match="--sample_order is 'litgpt' here but None"):
        compare_settings(Path("h.yaml"), STORED, {**STORED, "sample_order": "litgpt"}, changed_data=False)


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
