"""memfit.training.checkpoint and resuming: what a checkpoint holds and refuses, a resume that continues exactly (every
generator restored, the data order kept), settings a resume may and may not change, and saves that never leave a
half-written checkpoint. FSDP's sharded checkpoints: test_fsdp.py; resuming after a signal: test_signals.py."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (
    ROOT,
    SCRIPTS,
    WEIGHTS,
    cli_exit,
    load_script,
    lora_run,
    quiet,
    run_in_process,
    run_script,
    run_summary,
    script_summary,
    tiny_train,
)
from memfit.errors import UserError

lora = load_script("finetune/lora.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, new",
    [
        ("finetune/lora.py", "lora_A"),
        ("finetune/adapter.py", "adapter_wte"),
        ("finetune/adapter_v2.py", "adapter_scale"),
        ("finetune/full.py", None),
    ],
)
def test_only_the_methods_own_parameters_may_be_missing(tmp_path, embedded, script, new):
    from memfit.errors import UserError
    from memfit.training.loading import load_model

    litgpt_module = {
        "lora": "litgpt.lora",
        "adapter": "litgpt.adapter",
        "adapter_v2": "litgpt.adapter_v2",
        "full": "litgpt.model",
    }[Path(script).stem]
    import importlib

    gpt = importlib.import_module(litgpt_module)
    source, _ = embedded
    config = gpt.Config.from_file(
        source / "model_config.yaml", **({"lora_r": 4, "lora_query": True} if new == "lora_A" else {})
    )
    allowed = {
        "lora_A": ("lora_A", "lora_B"),
        "adapter_wte": ("adapter_wte", "gating_factor"),
        "adapter_scale": ("adapter_wte", "gating_factor", "adapter_bias", "adapter_scale"),
        None: (),
    }[new]
    # the scripts declare the same names the loader is given here
    assert all(f'"{name}"' in Path(ROOT / script).read_text() for name in allowed)
    model = load_model(
        gpt.GPT,
        config,
        source / "lit_model.pth",
        dtype=torch.float32,
        device=torch.device("cpu"),
        new_parameters=allowed,
    )
    if new is not None:
        assert any(new in n for n, _ in model.named_parameters())
    state = torch.load(source / "lit_model.pth", weights_only=True)
    del state["transformer.h.0.norm_1.weight"]
    broken = tmp_path / "broken.pth"  # not beside the shared embedded checkpoint, where each case wrote one name
    torch.save(state, broken)
    with pytest.raises(UserError, match=r"lacks 1 of the model's weights \(such as 'transformer.h.0.norm_1.weight'\)"):
        load_model(gpt.GPT, config, broken, dtype=torch.float32, device=torch.device("cpu"), new_parameters=allowed)


def _lora_into(tmp_path: Path, out: Path, **kwargs):
    from conftest import load_script, run_summary, tiny_train
    from memfit.args import ProfileArgs

    profiles = tmp_path / "profiles"
    shutil.rmtree(profiles, ignore_errors=True)
    load_script("finetune/lora.py").setup(
        out_dir=out,
        profile_dir=profiles,
        logger_name="csv",
        train=tiny_train(max_steps=8, save_interval=4),
        profile=ProfileArgs(enabled=False),
        **kwargs,
    )
    return run_summary(profiles)


def _lora_weights(out: Path) -> dict:
    return torch.load(out / "final/lit_model.pth.lora", weights_only=True)["model"]


@pytest.mark.slow
def test_resume_with_a_changed_setting_is_refused(tmp_path, embedded):
    lora_run(tmp_path, train=tiny_train(max_steps=4, save_interval=2))
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    for args, key in [
        (["--train.lr", "0.1"], "--train.lr is 0.1 here but 0.003"),
        (["--lora_r", "4"], "--lora_r is 4"),
    ]:
        code, err = cli_exit(
            lora,
            [
                "--out_dir",
                str(tmp_path / "out"),
                "--profile_dir",
                str(tmp_path / "p"),
                "--resume",
                "true",
                "--train.max_steps",
                "4",
                "--train.save_interval",
                "2",
                "--train.global_batch_size",
                "8",
                "--train.micro_batch_size",
                "4",
                "--train.lr_warmup_steps",
                "2",
                "--train.lr",
                "3e-3",
                "--train.min_lr",
                "3e-4",
                "--logger_name",
                "csv",
                "--profile.enabled",
                "false",
                *args,
            ],
        )
        assert code == 2 and key in err, err
    hparams = yaml.safe_load((tmp_path / "out/step-000002/hyperparameters.yaml").read_text())
    assert hparams["train"]["lr"] == 3e-3


@pytest.mark.slow
def test_resume_may_change_how_the_data_is_read_but_not_what_it_is(tmp_path, embedded):
    """The loader's worker count does not change a step (Memfit's sampler orders the data), so a resumed run may
    change it, e.g. after workers ran out of memory; a data module's field that changes the samples is refused by
    its own flag, as the user types it."""
    _, json_path = embedded
    common = [
        "--out_dir",
        str(tmp_path / "out"),
        "--profile_dir",
        str(tmp_path / "p"),
        "--data",
        "JSON",
        "--data.json_path",
        str(json_path),
        "--data.mask_prompt",
        "true",
        "--train.global_batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.lr_warmup_steps",
        "2",
        "--train.save_interval",
        "2",
        "--train.lr",
        "3e-3",
        "--train.min_lr",
        "3e-4",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    first = run_in_process(
        "finetune/lora.py", *common, "--data.num_workers", "0", "--train.max_steps", "4", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    changed = run_in_process(
        "finetune/lora.py",
        *common,
        "--data.val_split_fraction",
        "0.2",
        "--train.max_steps",
        "4",
        "--resume",
        "true",
        cwd=tmp_path,
    )
    assert changed.returncode == 2, changed.stderr[-2000:]
    assert "--data.val_split_fraction is 0.2 here but 0.05 in the run being resumed" in changed.stderr, changed.stderr
    resumed = run_in_process(
        "finetune/lora.py",
        *common,
        "--data.num_workers",
        "1",
        "--train.max_steps",
        "4",
        "--resume",
        "true",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and (tmp_path / "out/final").is_dir()


@pytest.mark.slow
def test_resume_onto_rewritten_data_is_refused_unless_the_flag_accepts_it(tmp_path, embedded):
    """The data file rewritten between the parts of a run (400 records became 50, every answer changed) resumed
    silently with another epoch; the checkpoint's fingerprint of the training samples now names the change."""

    records = json.loads(embedded[1].read_text())
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records[:80]))
    common = [
        "--out_dir",
        str(tmp_path / "out"),
        "--profile_dir",
        str(tmp_path / "p"),
        "--data",
        "JSON",
        "--data.json_path",
        str(data),
        "--data.val_split_fraction",
        "0.1",
        "--train.global_batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.save_interval",
        "2",
        "--train.max_steps",
        "4",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    first = run_in_process("finetune/lora.py", *common, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    data.write_text(json.dumps([{**r, "output": r["output"][::-1]} for r in records[:50]]))
    refused = run_in_process("finetune/lora.py", *common, "--resume", "true", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in refused.stderr and not list((tmp_path / "out").glob(".*"))  # no lock, no staging
    assert (
        line.startswith(
            f"error: --resume: --data JSON ({data}) is not the training data of the checkpoint being"
            " resumed (45 samples"
        )
        and "the checkpoint's: 72 samples" in line
    ), line
    assert line.endswith("add --resume_with_changed_data true to go on with this data from the same position"), line
    accepted = run_in_process(
        "finetune/lora.py", *common, "--resume", "true", "--resume_with_changed_data", "true", cwd=tmp_path
    )
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    assert "warning: --data JSON" in accepted.stdout and (tmp_path / "out/final").is_dir()
    refused = run_in_process(
        "finetune/lora.py", *common, "--overwrite", "true", "--resume_with_changed_data", "true", cwd=tmp_path
    )
    assert refused.stderr.strip() == (
        "error: --resume_with_changed_data true applies to a resumed run: add --resume, or drop it"
    )


@pytest.mark.slow
def test_a_lora_checkpoint_holding_a_whole_model_is_refused(tmp_path, embedded):
    """A lit_model.pth.lora that holds a whole model (0 LoRA tensors) resumed silently, its base weights replacing
    the run's own."""
    lora_run(tmp_path, train=tiny_train(max_steps=2, save_interval=1))
    shutil.rmtree(tmp_path / "out/final")
    base = torch.load(embedded[0] / "lit_model.pth", weights_only=True)
    torch.save({"model": base}, tmp_path / "out/step-000001/lit_model.pth.lora")
    with pytest.raises(UserError) as refused:
        lora_run(tmp_path, train=tiny_train(max_steps=2, save_interval=1), resume=True)
    assert str(refused.value).startswith(
        f"--resume: {tmp_path / 'out/step-000001/lit_model.pth.lora'} holds 0 of the"
    ), refused.value
    assert "it is not this run's checkpoint" in str(refused.value)


@pytest.mark.slow
def test_resume_in_less_memory_gives_the_uninterrupted_runs_weights(tmp_path, embedded):
    """What the out-of-memory explanation suggests, a smaller micro-batch (same global batch), activation
    checkpointing and another AdamW kernel, is the same training: a run resumed with all three changed ends with the
    weights of the uninterrupted one (no dropout: its masks follow the micro-batches' shapes)."""
    common = [
        "--lora_dropout",
        "0",
        "--train.global_batch_size",
        "8",
        "--train.lr_warmup_steps",
        "2",
        "--train.save_interval",
        "2",
        "--train.max_steps",
        "4",
        "--train.lr",
        "3e-3",
        "--train.min_lr",
        "3e-4",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    whole = run_in_process(
        "finetune/lora.py", *common, "--out_dir", "whole", "--train.micro_batch_size", "4", cwd=tmp_path
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = run_in_process(
        "finetune/lora.py", *common, "--out_dir", "parts", "--train.micro_batch_size", "4", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(tmp_path / "parts/final")  # as if it ran out of memory in step 3
    resumed = run_in_process(
        "finetune/lora.py",
        *common,
        "--out_dir",
        "parts",
        "--resume",
        "true",
        "--train.micro_batch_size",
        "2",
        "--activation_checkpointing",
        "true",
        "--optimizer",
        "AdamW-foreach",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "x 4 micro-batch(es) of 2 per step" in resumed.stdout
    expected = torch.load(tmp_path / "whole/final/lit_model.pth.lora", weights_only=True)["model"]
    got = torch.load(tmp_path / "parts/final/lit_model.pth.lora", weights_only=True)["model"]
    started = torch.load(tmp_path / "parts/step-000002/lit_model.pth.lora", weights_only=True)["model"]
    assert expected.keys() == got.keys()
    assert all(not torch.equal(expected[name], started[name]) for name in expected)  # steps 3 and 4 moved them all
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)
    hparams = yaml.safe_load((tmp_path / "parts/final/hyperparameters.yaml").read_text())
    assert hparams["train"]["micro_batch_size"] == 2 and hparams["optimizer"] == "AdamW-foreach"  # what ran


@pytest.mark.slow
def test_resume_from_another_methods_checkpoint_is_refused(tmp_path, embedded):
    adapter = load_script("finetune/adapter.py")
    adapter.setup(
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        **quiet(train=tiny_train(max_steps=2, save_interval=2, lr=1e-2, min_lr=1e-3)),
    )
    shutil.move(tmp_path / "out/final", tmp_path / "out/step-000003")
    # the settings of a LoRA run, so that only the weights are another method's
    lora.setup(out_dir=tmp_path / "lora", profile_dir=tmp_path / "profiles", **quiet(train=tiny_train(max_steps=1)))
    shutil.copy(tmp_path / "lora/final/hyperparameters.yaml", tmp_path / "out/step-000003")
    with pytest.raises(UserError, match="holds no lit_model.pth.lora but lit_model.pth.adapter"):
        lora_run(tmp_path, train=tiny_train(max_steps=1), resume=True)


@pytest.mark.slow
def test_a_failed_save_keeps_the_previous_final_and_leaves_no_tmp(tmp_path, embedded):
    import lightning as L

    from memfit.training.checkpoint import save_checkpoint

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(2, 2)
    save_checkpoint(fabric, tmp_path, "final", "w.pth", model, {"step": 1}, {"a": 1})
    first = (tmp_path / "final/w.pth").read_bytes()
    with torch.no_grad():
        model.weight.add_(1)
    with pytest.raises(Exception):
        save_checkpoint(fabric, tmp_path, "final", "w.pth", model, {"step": 2, "bad": lambda: 0}, {"a": 2})
    assert (tmp_path / "final/w.pth").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    save_checkpoint(fabric, tmp_path, "final", "w.pth", model, {"step": 2}, {"a": 2})
    assert (tmp_path / "final/w.pth").read_bytes() != first and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.mark.slow
def test_resume_falls_back_from_a_damaged_latest_checkpoint(tmp_path, embedded, capsys):
    lora_run(tmp_path, train=tiny_train(max_steps=6, save_interval=2))
    shutil.rmtree(tmp_path / "out/final")
    weights = tmp_path / "out/step-000004/lit_model.pth.lora"
    weights.write_bytes(weights.read_bytes()[:100])
    shutil.rmtree(tmp_path / "profiles")
    lora_run(tmp_path, train=tiny_train(max_steps=6, save_interval=2), resume=True)
    out = capsys.readouterr().out
    assert "step-000004 is damaged" in out and "Resumed from" in out and "step-000002 at step 2" in out
    assert run_summary(tmp_path / "profiles")["steps"] == 6


@pytest.mark.slow
def test_resume_falls_back_from_a_latest_checkpoint_whose_settings_are_damaged(tmp_path, embedded, capsys):
    """A garbled hyperparameters.yaml was a YAML traceback; a deleted one let changed settings through. Either way
    the checkpoint is passed over for the previous one, with a warning, and that one's settings are checked."""
    lora_run(tmp_path, train=tiny_train(max_steps=6, save_interval=2))
    shutil.rmtree(tmp_path / "out/final")
    settings = tmp_path / "out/step-000004/hyperparameters.yaml"
    settings.write_text("train: {max_steps: [6\n")  # garbled
    with pytest.raises(UserError, match="--train.lr is 0.1 here but 0.003 in the run being resumed"):
        lora_run(tmp_path, train=tiny_train(max_steps=6, save_interval=2, lr=0.1), resume=True)
    assert f"warning: {settings} cannot be read" in capsys.readouterr().out
    settings.unlink()  # deleted
    shutil.rmtree(tmp_path / "profiles", ignore_errors=True)
    lora_run(tmp_path, train=tiny_train(max_steps=6, save_interval=2), resume=True)
    out = capsys.readouterr().out
    assert f"warning: {settings} cannot be read (it is missing)" in out and "trying the previous checkpoint" in out
    assert "step-000002 at step 2" in out and run_summary(tmp_path / "profiles")["steps"] == 6


@pytest.mark.slow
def test_resume_keeps_the_data_order_when_the_profiler_window_changes(tmp_path, embedded):
    """The longest samples' place is the default window's step whatever window is asked for (here step 4 is
    recorded); a resumed run (here without profiling, a setting resume may change) keeps the order its first part
    used, and ends exactly as the straight run."""
    from memfit.args import ProfileArgs

    lora_run(
        tmp_path / "straight",
        train=tiny_train(max_steps=8, save_interval=2),
        profile=ProfileArgs(wait=2, warmup=1, active=1),
    )
    state = torch.load(tmp_path / "straight/out/final/training_state.pth", weights_only=False)
    assert state["data"]["longest_position"] == (3 * 2 - 1) * 4  # last micro-batch of step 3, not the window's 4
    resumed_dir = tmp_path / "resumed"
    lora_run(
        resumed_dir, train=tiny_train(max_steps=8, save_interval=2), profile=ProfileArgs(wait=2, warmup=1, active=1)
    )
    for name in ("step-000006", "final"):
        shutil.rmtree(resumed_dir / "out" / name)
    shutil.rmtree(resumed_dir / "profiles")
    lora_run(resumed_dir, train=tiny_train(max_steps=8, save_interval=2), resume=True)  # profiling off this time
    a = torch.load(tmp_path / "straight/out/final/lit_model.pth.lora", weights_only=True)["model"]
    b = torch.load(resumed_dir / "out/final/lit_model.pth.lora", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_checkpoints_are_written_beside_their_destination_not_in_tmpdir(tmp_path, embedded, small_disk):
    """Lightning's writer staged every checkpoint file in $TMPDIR: with a small /tmp (here a 1 MiB disk, smaller than
    the 4 MiB weights) the first save failed, reported as /tmp's, however much room the out_dir had."""
    result = run_script(
        "finetune/full.py",
        "--train.max_steps",
        "1",
        "--eval.final_validation",
        "false",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        cwd=tmp_path,
        env={"TMPDIR": str(small_disk)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out/finetune/full/final/lit_model.pth").is_file()
    assert list(small_disk.rglob("*")) == []


@pytest.mark.slow
def test_resume_takes_the_runs_own_settings_and_a_finished_run_says_so(tmp_path, embedded):
    """After Ctrl-C the hint said --resume true, and doing just that was refused ("--precision is ... here but ...:
    drop --precision", a flag never given): the flags not given again are now the run's own; one given differently is
    still refused by name. A finished run says it is finished instead of naming a setting."""
    out = ["--out_dir", str(tmp_path / "out"), "--profile_dir", str(tmp_path / "p")]
    first = run_in_process(
        "finetune/lora.py",
        *out,
        "--lora_r",
        "4",
        "--train.lr",
        "0.002",
        "--train.max_steps",
        "4",
        "--train.save_interval",
        "2",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        "--eval.final_validation",
        "false",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    finished = run_in_process("finetune/lora.py", *out, "--resume", "true", cwd=tmp_path)
    assert finished.returncode == 2 and finished.stderr.strip() == (
        f"error: --resume true: the run in --out_dir {str(tmp_path / 'out')!r} is finished (final); nothing to"
        " continue: replace it with --overwrite true, or choose a fresh --out_dir"
    ), finished.stderr
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    changed = run_in_process("finetune/lora.py", *out, "--resume", "true", "--lora_r", "8", cwd=tmp_path)
    assert changed.returncode == 2 and "--lora_r is 8 here but 4 in the run being resumed" in changed.stderr
    resumed = run_in_process("finetune/lora.py", *out, "--resume", "true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    settings = yaml.safe_load((tmp_path / "out/final/hyperparameters.yaml").read_text())
    assert settings["lora_r"] == 4 and settings["train"]["lr"] == 0.002 and settings["logger_name"] == "csv"


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, embedded):
    """Stopping after step 6 and resuming gives the same weights as training 10 steps straight, also from a
    checkpoint holding a GPU's random generator."""
    from memfit.files import mark_as_written_by_memfit
    from memfit.training.out_dir import latest_checkpoint

    straight = tmp_path / "straight"
    script_summary("finetune/lora.py", straight, train=tiny_train(max_steps=10, save_interval=3))
    resumed = tmp_path / "resumed"
    script_summary("finetune/lora.py", resumed, train=tiny_train(max_steps=10, save_interval=3))
    # simulate a crash after step 6: drop the later checkpoints, keep a half-written one that must be ignored
    import shutil

    for name in ("step-000009", "final"):
        shutil.rmtree(resumed / "out" / name)
    (resumed / "out" / ".step-000009.tmp").mkdir()
    mark_as_written_by_memfit(resumed / "out" / ".step-000009.tmp")  # the first thing a save writes
    assert latest_checkpoint(resumed / "out").name == "step-000006"
    # as a GPU run writes it: the GPU's generator beside the CPU's, which a CPU run has no use for (and a GPU run
    # resuming a CPU checkpoint finds absent: neither way is a damaged checkpoint)
    training_state = resumed / "out/step-000006/training_state.pth"
    state = torch.load(training_state, weights_only=False)
    state["cuda_rng"] = torch.zeros(16, dtype=torch.uint8)
    for rank_states in state["rank_rng_states"]:
        rank_states["cuda_rng"] = torch.zeros(16, dtype=torch.uint8)
    torch.save(state, training_state)
    shutil.rmtree(resumed / "profiles")
    # on the same device named another way (the first run's "auto"): a resumed run may change its device
    summary = script_summary(
        "finetune/lora.py", resumed, train=tiny_train(max_steps=10, save_interval=3), resume=True, accelerator="cpu"
    )
    assert summary["steps"] == 10 and len(json.loads(json.dumps(summary))["memory"]["peak_bytes"]) > 0
    a = torch.load(straight / "out/final/lit_model.pth.lora", weights_only=True)["model"]
    b = torch.load(resumed / "out/final/lit_model.pth.lora", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7)
    state = torch.load(resumed / "out/final/training_state.pth", weights_only=False)
    assert state["counters"]["step"] == 10 and state["data"]["epoch"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_for_every_method(tmp_path, embedded, script):
    """A run stopped after step 4 and resumed ends with the weights of an uninterrupted 8-step run."""
    train = tiny_train(max_steps=8, save_interval=4, lr=1e-3)
    name = script_summary(script, tmp_path / "straight", train=train)["script"]
    script_summary(script, tmp_path / "resumed", train=train)
    out = tmp_path / "resumed/out"
    shutil.rmtree(out / "final")
    shutil.rmtree(tmp_path / "resumed/profiles")
    assert script_summary(script, tmp_path / "resumed", train=train, resume=True)["steps"] == 8
    a = torch.load(tmp_path / "straight/out/final" / WEIGHTS[name], weights_only=True)["model"]
    b = torch.load(out / "final" / WEIGHTS[name], weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_litgpt_resume_forms_auto_and_a_checkpoint_path(tmp_path, embedded):
    """litgpt's --resume auto (the latest checkpoint if any, else a fresh start) and --resume PATH (a checkpoint's
    weights file, from another out_dir) both continue exactly: the weights equal an uninterrupted 8-step run's."""
    straight = tmp_path / "straight"
    assert _lora_into(tmp_path, straight, resume="auto")["steps"] == 8  # nothing to resume: a fresh start, no error
    crashed = tmp_path / "crashed"
    shutil.copytree(straight, crashed)
    shutil.rmtree(crashed / "final")
    shutil.rmtree(crashed / "step-000008", ignore_errors=True)  # the last step is saved as final/ alone
    assert _lora_into(tmp_path, crashed, resume="auto")["steps"] == 8
    elsewhere = tmp_path / "elsewhere"
    _lora_into(tmp_path, elsewhere, resume=straight / "step-000004/lit_model.pth.lora")  # litgpt's form: the file
    for out in (crashed, elsewhere):
        a, b = _lora_weights(straight), _lora_weights(out)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_resume_path_that_is_no_checkpoint_is_one_line(tmp_path, embedded):
    (tmp_path / "nothing").mkdir()
    result = run_in_process("finetune/lora.py", "--resume", "nothing", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and errors == [
        "error: --resume 'nothing' is not a checkpoint Memfit wrote (no training_state.pth there); give a step-* dir,"
        " or true/auto for the latest in --out_dir"
    ], errors


@pytest.mark.slow
def test_resuming_another_scripts_checkpoint_names_the_script_that_wrote_it(tmp_path, embedded):
    """lora.py --resume of a full.py or an adapter.py checkpoint: the refusal names the script that wrote it, not a
    flag the user never gave ("--lora_alpha is 16 here but None") or a key of the other script's settings."""
    for script, says in (
        ("finetune/full.py", "was written by finetune/full.py (it holds lit_model.pth), not lora.py"),
        ("finetune/adapter.py", "was written by finetune/adapter.py (it holds lit_model.pth.adapter), not lora.py"),
    ):
        name = script.split("/")[1][:-3]
        script_summary(script, tmp_path / name, train=tiny_train(max_steps=3, save_interval=2))
        step = tmp_path / name / "out" / "step-000002"
        result = run_in_process("finetune/lora.py", "--resume", str(step), cwd=tmp_path / name)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr[-2000:]


def test_a_damaged_checkpoints_settings_fall_back_to_the_step_before_it_by_number(tmp_path, capsys):
    """Past step 999,999 the step-* names are 7 digits: sorted as strings, step-999999 came after step-1000000, so a
    resume from a damaged step-1000000 found no earlier checkpoint. The command line and the run take the same one
    (``memfit.training.checkpoint.resume_point``), the command line without the run's warning."""
    from memfit.training.checkpoint import resume_point

    for step, text in ((999_999, yaml.safe_dump({"seed": 1})), (1_000_000, "{ damaged"), (3, yaml.safe_dump({}))):
        (tmp_path / f"step-{step:06d}").mkdir()
        (tmp_path / f"step-{step:06d}/hyperparameters.yaml").write_text(text)
    found, stored = resume_point(tmp_path / "step-1000000", warn=False)
    assert (found.name, stored) == ("step-999999", {"seed": 1})
    assert capsys.readouterr().out == ""
    resume_point(tmp_path / "step-1000000")
    assert "step-1000000/hyperparameters.yaml cannot be read" in capsys.readouterr().out
