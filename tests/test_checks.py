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
