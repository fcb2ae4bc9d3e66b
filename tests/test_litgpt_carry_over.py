"""A litgpt user's data, resume forms, loggers and tokens carry over to Memfit's scripts."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, loss_fell, offline, run_in_process, run_script, step_losses


def WITHOUT(*packages: str) -> dict:
    """The environment of a process in which these packages are not installed."""
    return {"PYTHONPATH": str(ROOT / "tests/without_packages"), "MEMFIT_TEST_WITHOUT": ",".join(packages)}


def _text_dir(embedded, tmp_path: Path, files: int) -> Path:
    """The embedded corpus cut into ``files`` .txt files, as litgpt's TextFiles reads a directory."""
    _, json_path = embedded
    text = json_path.with_name("corpus.txt").read_text()
    texts = tmp_path / "texts"
    texts.mkdir()
    size = len(text) // files
    for i in range(files):
        (texts / f"part{i}.txt").write_text(text[i * size : (i + 1) * size])
    return texts


@pytest.mark.slow
def test_pretrain_trains_on_litgpt_textfiles_and_resumes_after_ctrl_c(tmp_path, embedded):
    """litgpt's TextFiles (litdata's optimize, then its token blocks read by index through Memfit's sampler) trains;
    Ctrl-C mid-run still stops cleanly, though litdata's optimize installs its own Ctrl-C handler (exit 0); and the
    resumed run, from the data position its checkpoint keeps, finishes with the loss down. All of it offline: no
    process, litdata's workers included, tries to reach a host (litdata asks PyPI for its newest version)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("litdata", reason="litdata is not installed (.ci/run installs it; see the README)")
    texts = _text_dir(embedded, tmp_path, files=3)
    attempts = tmp_path / "network.log"
    # one worker: litdata switches multiprocessing to spawn, so the dataset is pickled into the worker
    args = [
        "--data",
        "TextFiles",
        "--data.train_data_path",
        str(texts),
        "--data.num_workers",
        "1",
        "--train.max_seq_length",
        "64",
        "--train.max_steps",
        "12",
        "--train.save_interval",
        "2",
        "--eval.interval",
        "12",
        "--eval.max_iters",
        "2",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "pretrain/pretrain.py"), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **offline(attempts, then=os.environ.get("PYTHONPATH"))},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out = tmp_path / "out/pretrain"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (out / "step-000002").is_dir() and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    # one Ctrl-C: the steps taken are saved, as a preemption's
    assert proc.returncode == 130 and "Interrupted by Ctrl-C after step" in stderr, stderr[-3000:]
    assert (texts / "train/index.json").is_file() and (texts / "val/index.json").is_file()  # litdata's optimize ran
    shutil.rmtree(tmp_path / "out" / "profiles")
    result = run_script("pretrain/pretrain.py", *args, "--resume", "true", cwd=tmp_path)  # offline too
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resumed from" in result.stdout
    losses = step_losses(tmp_path / "out" / "profiles")
    assert 4 <= len(losses) < 12 and loss_fell(losses, by=0.3), losses  # the resumed part's steps
    state = torch.load(out / "final/training_state.pth", weights_only=False)
    assert state["counters"]["step"] == 12 and "val" in result.stdout
    assert not attempts.exists(), attempts.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "files, extra, says",
    [
        (1, [], "holds one .txt file; TextFiles keeps the first file for validation"),
        (0, [], "holds no .txt files; give a directory of them"),
        (2, ["--data.val_data_path", "nowhere"], "--data.val_data_path 'nowhere' holds no .txt files"),
    ],
)
def test_textfiles_directory_mistakes_are_one_line(tmp_path, embedded, files, extra, says):
    pytest.importorskip("litdata", reason="litdata is not installed (.ci/run installs it; see the README)")
    texts = _text_dir(embedded, tmp_path, files=files) if files else tmp_path / "texts"
    texts.mkdir(exist_ok=True)
    result = run_in_process(
        "pretrain/pretrain.py", "--data", "TextFiles", "--data.train_data_path", "texts", *extra, cwd=tmp_path
    )
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1 and says in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]


@pytest.mark.slow
def test_textfiles_without_litdata_says_how_to_install_it(tmp_path, embedded):
    texts = _text_dir(embedded, tmp_path, files=2)
    result = run_script(
        "pretrain/pretrain.py",
        "--data",
        "TextFiles",
        "--data.train_data_path",
        str(texts),
        cwd=tmp_path,
        env=WITHOUT("litdata"),
    )
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1, errors
    assert "--data TextFiles reads litdata's streaming format, and litdata is not installed: pip install" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]


def _after_seed(stderr: str) -> list[str]:
    """stderr's lines after Lightning's "Seed set to N": data is prepared inside main(), after the seed is set."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[1:] if lines and lines[0].startswith("Seed set to") else lines


@pytest.mark.slow
def test_alpaca2k_without_hugging_face_datasets_is_one_line(tmp_path, embedded):
    """Alpaca2k, the data of most of litgpt's config hub, imports `datasets` while it prepares; neither litgpt nor
    Memfit requires it."""
    checkpoint_dir, _ = embedded
    result = run_script(
        "finetune/lora.py",
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--data",
        "Alpaca2k",
        cwd=tmp_path,
        env=WITHOUT("datasets"),
    )
    errors = _after_seed(result.stderr)
    assert result.returncode == 2 and len(errors) == 1, errors
    assert errors[0] == (
        "error: --data Alpaca2k prepares its data with the package 'datasets', which is not installed:"
        " pip install datasets"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_download_that_cannot_reach_its_server_is_one_line(tmp_path, embedded):
    """litgpt's Alpaca downloads with requests; on a machine without internet that was a ConnectionError traceback.
    The port-9 URL is refused on any machine, so the test does not depend on this one being offline."""
    checkpoint_dir, _ = embedded
    result = run_script(
        "finetune/lora.py",
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--data",
        "Alpaca",
        "--data.file_url",
        "http://127.0.0.1:9/alpaca.json",
        "--data.download_dir",
        "alpaca",
        cwd=tmp_path,
    )
    errors = _after_seed(result.stderr)
    assert result.returncode == 2 and len(errors) == 1, errors
    assert errors[0].startswith(
        "error: --data Alpaca downloads its data and could not (http://127.0.0.1:9/alpaca.json: ConnectionError)"
    )
    assert "--data JSON --data.json_path FILE" in errors[0]
    assert list(tmp_path.iterdir()) == []  # neither the out dir nor the download dir Alpaca created


def test_the_offline_advice_names_each_modules_own_directory_and_a_local_module_of_its_kind():
    """litgpt's instruction modules keep their files in download_dir, its pretraining ones in data_path (TinyStories'
    URL is fixed, so the download failure itself is tested with Alpaca above)."""
    from litgpt.data import Alpaca, TinyStories

    from memfit.training.data import _offline_way

    assert "give --data.download_dir DIR, or use --data JSON --data.json_path FILE" in _offline_way(Alpaca())
    assert "give --data.data_path DIR, or use --data TextFiles --data.train_data_path DIR" in _offline_way(
        TinyStories()
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "given, means",
    [
        (["--precision", "bf16"], "bf16-mixed"),
        (["--precision", "32"], "32-true"),
        (["--config", "precision.yaml"], "32-true"),
    ],
)
def test_lightnings_older_precision_names_mean_what_fabric_makes_of_them(tmp_path, embedded, given, means):
    """litgpt passes --precision to Fabric, which still takes 32, 16 and bf16 (a YAML config gives 32 as a number);
    Memfit takes them too, as the names Fabric maps them to, and records those."""
    (tmp_path / "precision.yaml").write_text("precision: 32\n")
    result = run_in_process(
        "finetune/lora.py",
        *given,
        "--train.max_steps",
        "1",
        "--train.save_interval",
        "1",
        "--eval.final_validation",
        "false",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"| precision {means} |" in result.stdout
    hparams = yaml.safe_load((tmp_path / "out/finetune/lora/final/hyperparameters.yaml").read_text())
    assert hparams["precision"] == means


@pytest.mark.slow
def test_evaluate_example_picks_the_record_litgpt_picks(tmp_path, embedded):
    """--eval.evaluate_example as litgpt reads it: an index into the validation set, and past it the training
    sample of that index (litgpt.utils.generate_example); past both, one line instead of an IndexError."""
    from litgpt.data import JSON
    from litgpt.tokenizer import Tokenizer

    from memfit.errors import UserError
    from memfit.training.sample import sample_prompt

    checkpoint, json_path = embedded
    records = json.loads(Path(json_path).read_text())[:40]
    (tmp_path / "data.json").write_text(json.dumps(records))
    data = JSON(json_path=tmp_path / "data.json", val_split_fraction=0.1, num_workers=0)
    tokenizer = Tokenizer(checkpoint)
    data.connect(tokenizer=tokenizer, batch_size=1, max_seq_length=64)
    data.setup()
    val, train = data.test_dataset.data, data.train_dataset.data
    assert (len(val), len(train)) == (4, 36)

    def prompt_of(record):
        return tokenizer.encode(data.prompt_style.apply(prompt=record["instruction"], **record))

    for example, record in (("first", val[0]), (2, val[2]), (10, train[10]), (35, train[35])):
        assert torch.equal(sample_prompt(data, tokenizer, example, seed=1), prompt_of(record)), example
    with pytest.raises(UserError, match="past both the validation set"):
        sample_prompt(data, tokenizer, 36, seed=1)


def _run_dir(tmp_path: Path) -> Path:
    (run_dir,) = (tmp_path / "out" / "profiles").iterdir()
    return run_dir


@pytest.mark.slow
def test_wandb_logger_files_the_run_offline(tmp_path, embedded):
    pytest.importorskip("wandb", reason="wandb is not installed (the test extra installs it)")
    result = run_script(
        "finetune/lora.py",
        "--train.max_steps",
        "3",
        "--logger_name",
        "wandb",
        "--log.project",
        "memfit-test",
        "--log.run",
        "named-run",
        "--profile.enabled",
        "false",
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (records,) = (_run_dir(tmp_path) / "wandb").glob("offline-run-*/run-*.wandb")
    written = records.read_bytes()  # wandb's own record log: protobuf, whose strings are stored as they are
    assert b"memfit-test" in written and b"named-run" in written and b"loss" in written and b"val_loss" in written


@pytest.mark.slow
def test_mlflow_logger_files_every_step(tmp_path, embedded, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (the test extra installs mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the run dir's file store, as the run wrote it

    result = run_script(
        "finetune/lora.py",
        "--train.max_steps",
        "3",
        "--logger_name",
        "mlflow",
        "--log.project",
        "memfit-test",
        "--profile.enabled",
        "false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = _run_dir(tmp_path)
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("memfit-test").experiment_id])
    assert run.info.run_name == run_dir.name
    losses = [metric.value for metric in client.get_metric_history(run.info.run_id, "loss")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(losses) == 3 and losses[-1] == pytest.approx(summary["last_loss"], rel=1e-4), (losses, summary)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, env, says",
    [
        (
            ["--logger_name", "wandb"],
            WITHOUT("wandb"),
            "--logger_name wandb needs the wandb package, which is not installed: pip install wandb",
        ),
        (
            ["--logger_name", "mlflow"],
            WITHOUT("mlflow"),
            "--logger_name mlflow needs the mlflow package, which is not installed: pip install mlflow",
        ),
        (["--log.project", "p"], {}, "--log.project names a wandb or MLflow run; with --logger_name tensorboard"),
        (["--logger_name", "mlflow", "--log.group", "g"], {}, "--log.group is wandb's; MLflow has no run groups"),
    ],
)
def test_logger_mistakes_are_one_line(tmp_path, args, env, says):
    # a package hidden from a process needs a process of its own
    result = (
        run_script("finetune/lora.py", *args, cwd=tmp_path, env=env)
        if env
        else run_in_process("finetune/lora.py", *args, cwd=tmp_path)
    )
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1 and says in errors[0], errors
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_access_token_reaches_a_gated_data_module_and_is_never_written(tmp_path, embedded, monkeypatch):
    """litgpt's LIMA refuses to be built without a token; --access_token gives it one (the estimate then runs
    without downloading), and the token is kept out of what a checkpoint records."""
    from litgpt.data import LIMA

    from memfit.training.checkpoint import plain_hparams

    monkeypatch.delenv("HF_TOKEN", raising=False)
    checkpoint_dir, _ = embedded
    args = [
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--data",
        "LIMA",
        "--estimate",
        "true",
        "--train.max_seq_length",
        "32",
    ]
    without = run_in_process("finetune/lora.py", *args, cwd=tmp_path)
    assert without.returncode == 2 and "LIMA requires authentication" in without.stderr
    given = run_in_process("finetune/lora.py", *args, "--access_token", "hf_secret", cwd=tmp_path)
    assert given.returncode == 0, given.stderr[-2000:]
    assert "Predicted peak" in given.stdout
    recorded = plain_hparams({"access_token": "hf_secret", "data": LIMA(access_token="hf_secret")})
    assert "hf_secret" not in json.dumps(recorded) and recorded["data"]["class_path"] == "litgpt.data.lima.LIMA"


@pytest.mark.slow
def test_access_token_with_data_that_downloads_nothing_is_one_line(tmp_path, embedded):
    result = run_in_process("finetune/lora.py", "--access_token", "hf_x", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and errors == [
        "error: --access_token is for data modules that download gated data (e.g. --data LIMA); the embedded data"
        " takes none, and Memfit downloads no checkpoints: drop it"
    ], errors


@pytest.mark.slow
def test_litgpt_full_finetune_config_runs_unchanged_and_means_the_same(tmp_path, embedded, monkeypatch):
    """A config in the shape of litgpt's config_hub/finetune/*/full.yaml (pinned litgpt 0.5): `resume: false`, an
    optimizer block with betas, a data block, null train fields; the resolved optimizer matches the file."""
    import yaml

    from conftest import load_script
    from memfit.settings.cli import CLI

    checkpoint_dir, json_path = embedded
    config = {
        "checkpoint_dir": str(checkpoint_dir),
        "out_dir": str(tmp_path / "out"),
        "precision": "32-true",
        "devices": 1,
        "num_nodes": 1,
        "resume": False,
        "data": {
            "class_path": "litgpt.data.JSON",
            "init_args": {
                "json_path": str(json_path),
                "mask_prompt": False,
                "val_split_fraction": 0.05,
                "prompt_style": "alpaca",
                "ignore_index": -100,
                "seed": 42,
                "num_workers": 0,
            },
        },
        "train": {
            "save_interval": 200,
            "log_interval": 1,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "lr_warmup_steps": 2,
            "epochs": 1,
            "max_tokens": None,
            "max_steps": 3,
            "max_seq_length": 512,
            "tie_embeddings": None,
            "max_norm": None,
            "min_lr": 6.0e-05,
        },
        "eval": {
            "interval": 25,
            "max_new_tokens": 100,
            "max_iters": 2,
            "initial_validation": False,
            "final_validation": True,
        },
        "logger_name": "csv",
        "seed": 1337,
        "optimizer": {
            "class_path": "torch.optim.AdamW",
            "init_args": {"lr": 2e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
    }
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    CLI(load_script("finetune/full.py").setup, ["--config", str(path), "--profile.enabled", "false"])
    state = torch.load(tmp_path / "out/final/training_state.pth", weights_only=False)
    group = state["optimizer"]["param_groups"][0]
    assert group["initial_lr"] == 2e-4 and group["weight_decay"] == 0.1 and tuple(group["betas"]) == (0.9, 0.95)
    assert state["counters"]["step"] == 3
    hparams = yaml.safe_load((tmp_path / "out/final/hyperparameters.yaml").read_text())
    assert hparams["train"]["global_batch_size"] == 8 and hparams["train"]["micro_batch_size"] == 2
    assert hparams["optimizer"] == config["optimizer"] and hparams["resume"] is False
