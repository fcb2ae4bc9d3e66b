"""A litgpt user's data, resume forms, loggers and tokens carry over to Memfit's scripts."""

import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT, loss_fell, run_script, step_losses


def _text_dir(embedded, tmp_path: Path, files: int) -> Path:
    """The embedded corpus cut into ``files`` .txt files, as litgpt's TextFiles reads a directory."""
    _, json_path = embedded
    text = json_path.with_name("corpus.txt").read_text()
    texts = tmp_path / "texts"
    texts.mkdir()
    size = len(text) // files
    for i in range(files):
        (texts / f"part{i}.txt").write_text(text[i * size:(i + 1) * size])
    return texts


def test_pretrain_trains_on_litgpt_textfiles(tmp_path, embedded):
    pytest.importorskip("litdata", reason="litdata is not installed (.ci/run installs it; see the README)")
    texts = _text_dir(embedded, tmp_path, files=3)
    # one worker: litdata switches multiprocessing to spawn, so the dataset is pickled into the worker
    result = run_script("pretrain/pretrain.py", "--data", "TextFiles", "--data.train_data_path", str(texts),
                        "--data.num_workers", "1", "--train.max_seq_length", "64", "--train.max_steps", "16",
                        "--train.save_interval", "8", "--eval.interval", "8", "--eval.max_iters", "2",
                        "--logger_name", "csv", "--profile.enabled", "false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (texts / "train/index.json").is_file() and (texts / "val/index.json").is_file()  # litdata's optimize ran
    losses = step_losses(tmp_path / "profiles")
    assert len(losses) == 16 and loss_fell(losses, by=0.5), losses
    state = torch.load(tmp_path / "out/pretrain/final/training_state.pth", weights_only=False)
    # 16 steps of 8 blocks of 65 tokens, read by index through Memfit's sampler (its position is in the checkpoint)
    assert state["data"]["batches_in_epoch"] + state["data"]["epoch"] > 0
    assert "val" in result.stdout


@pytest.mark.parametrize("files, extra, says", [
    (1, [], "holds one .txt file; TextFiles keeps the first file for validation"),
    (0, [], "holds no .txt files; give a directory of them"),
    (2, ["--data.val_data_path", "nowhere"], "--data.val_data_path 'nowhere' holds no .txt files"),
])
def test_textfiles_directory_mistakes_are_one_line(tmp_path, embedded, files, extra, says):
    pytest.importorskip("litdata", reason="litdata is not installed (.ci/run installs it; see the README)")
    texts = _text_dir(embedded, tmp_path, files=files) if files else tmp_path / "texts"
    texts.mkdir(exist_ok=True)
    result = run_script("pretrain/pretrain.py", "--data", "TextFiles", "--data.train_data_path", "texts", *extra,
                        cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1 and says in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]


def test_textfiles_without_litdata_says_how_to_install_it(tmp_path, embedded):
    texts = _text_dir(embedded, tmp_path, files=2)
    result = run_script("pretrain/pretrain.py", "--data", "TextFiles", "--data.train_data_path", str(texts),
                        cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests/without_litdata")})
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1, errors
    assert "--data TextFiles reads litdata's streaming format, and litdata is not installed: pip install" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]
