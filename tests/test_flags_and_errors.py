"""Flags, --help, --config, litgpt-style options, and one clear line for each user mistake."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, SCRIPTS, load_script, run_in_process, run_script, run_summary, shared_file


# Two mistakes run as the real command line (a new process, 4-5 s: nothing printed at import time comes before the
# line), one refused while parsing and one while building a class; the others through the same CLI entry in this
# process: a setting setup() refuses, a value jsonargparse refuses.
@pytest.mark.slow
@pytest.mark.parametrize(
    "args, says, own_process",
    [
        (["--quantize", "bnb.int8-training", "--precision", "bf16-true"], "needs --precision 16-true", False),
        (
            ["--quantize", "bnb.nf4", "--precision", "bf16-mixed"],
            "cannot be combined with --precision bf16-mixed",
            False,
        ),
        (["--train.global_batch_size", "6", "--train.micro_batch_size", "4"], "must be a multiple of", False),
        (["--checkpoint_dir", "no/such/dir"], "'no/such/dir' is not on this machine", False),
        (["--resume", "true"], "no step-* checkpoint", False),
        (["--accelerator", "cuda"], "no CUDA GPU is visible", False),
        (["--quantize", "bnb.nf5"], "--quantize 'bnb.nf5' is not one of 'bnb.nf4', 'bnb.nf4-dq'", False),
        (["--train.max_steps", "abc"], "--train.max_steps: Expected a <class 'int'> (got 'abc')", False),
        (["--data", "JSON", "--data.json_path", "missing.json"], "'missing.json' does not exist", True),
        (["--no_such_flag", "3"], "--no_such_flag is not a flag of this script; --help lists them", True),
        (["--trian.lr", "1e-4"], "--trian.lr is not a flag of this script; did you mean --train.lr?", False),
        (["--quantise", "bnb.nf4"], "--quantise is not a flag of this script; did you mean --quantize?", False),
    ],
)
def test_bad_input_is_one_line_nonzero_exit_and_no_files(tmp_path, embedded, args, says, own_process):
    # ``embedded``: built before, as by any earlier run; its first build's bar is not the one line (a check that
    # needs the checkpoint dir, --resume's, runs after it)
    result = (partial(run_script, fresh=True) if own_process else run_in_process)(
        "finetune/lora.py", *args, cwd=tmp_path
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no out_dir, no profile dir


@pytest.mark.slow
def test_int8_training_without_a_precision_takes_the_one_it_needs(tmp_path, embedded):
    """--quantize bnb.int8-training computes in float16: given no --precision, that is the precision (the default
    would have been refused), and the estimate's title line says so."""
    result = run_in_process(
        "finetune/lora.py",
        "--quantize",
        "bnb.int8-training",
        "--accelerator",
        "cpu",
        "--estimate",
        "true",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    title = next(line for line in result.stdout.splitlines() if line.startswith("Estimate for lora"))
    assert title.endswith("16-true:") and "bnb.int8-training" in result.stdout, result.stdout[:2000]


@pytest.mark.slow
def test_help_lists_flags_with_their_docs(tmp_path):
    result = run_script("finetune/lora.py", "--help", cwd=tmp_path, fresh=True)
    assert result.returncode == 0
    for flag in [
        "--precision",
        "--quantize",
        "--lora_r",
        "--lora_mlp",
        "--train.micro_batch_size",
        "--train.global_batch_size",
        "--train.lr",
        "--train.max_norm",
        "--eval.interval",
        "--out_dir",
        "--logger_name",
        "--profile.active",
        "--config",
        "--resume",
        "--devices",
        "--num_nodes",
    ]:
        assert flag in result.stdout, flag
    assert "Quantize the frozen base: bnb.* with bitsandbytes" in result.stdout and "torchao.nf4" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_in_help_says_what_it_does(tmp_path, script):
    """Each option's --help entry has a description, not only its type and default (the --train fields litgpt
    declares once showed none: jsonargparse reads the docstrings of the class itself, not of the one it extends)."""
    result = run_in_process(script, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    entries: list[list[str]] = []
    for line in result.stdout.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            entries.append([line.strip()])
        elif line.startswith("    ") and entries:
            entries[-1].append(line.strip())
        elif line.strip():  # a group's title ends the entry before it
            entries.append([])
    undocumented = []
    for entry in filter(None, entries):
        first, *rest = entry
        signature, _, described = first.partition("  ")
        text = " ".join([described.strip(), *rest])
        if not text.split("(type:")[0].strip():
            undocumented.append(signature.split()[0].rstrip(","))
    assert len(entries) > 40 and not undocumented, undocumented


@pytest.mark.slow
def test_litgpt_style_options_with_real_alpaca_and_yaml_config(tmp_path):
    """A litgpt user's `finetune_lora` flags work unchanged; the same settings also load from --config."""
    alpaca = shared_file("alpaca_5000.json")
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump({"lora_r": 4, "lora_mlp": True, "logger_name": "csv", "profile": {"enabled": False}})
    )
    result = run_script(
        "finetune/lora.py",
        "--config",
        str(config),
        "--data",
        "JSON",
        "--data.json_path",
        str(alpaca),
        "--data.val_split_fraction",
        "0.1",
        "--train.micro_batch_size",
        "4",
        "--train.global_batch_size",
        "8",
        "--train.max_steps",
        "6",
        "--train.max_seq_length",
        "256",
        "--eval.max_iters",
        "2",
        "--out_dir",
        "out/lora",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")
    assert summary["steps"] == 6 and summary["profile_traces"] == []
    hparams = yaml.safe_load((tmp_path / "out/lora/final/hyperparameters.yaml").read_text())
    assert hparams["lora_r"] == 4 and hparams["lora_mlp"] is True
    assert hparams["data"]["class_path"] == "litgpt.data.json_data.JSON"
    assert len(list((tmp_path / "out" / "profiles").glob("*/metrics.csv"))) == 1
    # hyperparameters.yaml is itself a valid --config: it parses, and its classes (the data module with its prompt
    # style) are built again
    check = run_in_process(
        "finetune/lora.py",
        "--config",
        str(tmp_path / "out/lora/final/hyperparameters.yaml"),
        "--print_config",
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert "lora_r: 4" in check.stdout
    from jsonargparse import auto_parser
    from litgpt.prompts import Alpaca, load_prompt_style

    from conftest import load_script

    assert hparams["data"]["init_args"]["prompt_style"] == "alpaca"
    parser = auto_parser(load_script("finetune/lora.py").setup, as_positional=False, exit_on_error=False)
    init = parser.instantiate_classes(
        parser.parse_args(["--config", str(tmp_path / "out/lora/final/hyperparameters.yaml")])
    )
    assert isinstance(init.data.prompt_style, Alpaca) and init.lora_r == 4
    # litgpt generate/chat read the template from the checkpoint dir
    assert isinstance(load_prompt_style(tmp_path / "out/lora/final"), Alpaca)


@pytest.mark.slow
def test_devices_auto_as_litgpt_takes_every_visible_device(tmp_path, embedded, capsys):
    import torch

    from conftest import load_script, tiny_train
    from memfit.args import ProfileArgs

    load_script("finetune/lora.py").setup(
        devices="auto",
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        logger_name="csv",
        train=tiny_train(max_steps=1),
        profile=ProfileArgs(enabled=False),
    )
    summary = json.loads(next((tmp_path / "profiles").glob("*/summary.json")).read_text())
    assert summary["world_size"] == (torch.cuda.device_count() if torch.cuda.is_available() else 1)
    # no profiler window: the summary does not send the user to a Profiler tab with nothing in it
    assert "(the run's metrics and summary; no profiler trace)" in capsys.readouterr().out


@pytest.mark.slow
def test_checkpoint_dir_first_without_the_flag_and_org_name_under_checkpoints(tmp_path, embedded):
    """litgpt's command forms: `finetune/lora.py checkpoints/org/name ...` and `finetune/lora.py org/name ...`."""
    import shutil

    source, _ = embedded
    shutil.copytree(source, tmp_path / "checkpoints/memfit/tiny")
    for given in ("checkpoints/memfit/tiny", "memfit/tiny"):
        result = run_in_process(
            "finetune/lora.py", given, "--estimate", "true", "--train.max_seq_length", "32", cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "Estimate for lora on tiny, 32 tokens" in result.stdout
    result = run_in_process("finetune/lora.py", "no/such/model", "--estimate", "true", cwd=tmp_path)
    assert result.returncode == 2 and "'no/such/model' is not on this machine" in result.stderr


def _litgpt_config(tmp_path, embedded, optimizer: dict, **extra) -> "Path":
    """A config in the shape of litgpt's config_hub/finetune/*/{lora,qlora}.yaml (pinned litgpt 0.5)."""
    checkpoint_dir, json_path = embedded
    config = {
        "checkpoint_dir": str(checkpoint_dir),
        "out_dir": str(tmp_path / "out"),
        "precision": "32-true",
        "quantize": "bnb.nf4",
        "devices": 1,
        "num_nodes": 1,
        "lora_r": 4,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_query": True,
        "lora_key": False,
        "lora_value": True,
        "lora_projection": False,
        "lora_mlp": True,
        "lora_head": False,
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
            "lr_warmup_steps": 10,
            "epochs": 4,
            "max_tokens": None,
            "max_steps": None,
            "max_seq_length": 512,
            "tie_embeddings": None,
            "max_norm": None,
            "min_lr": 6.0e-05,
        },
        "eval": {
            "interval": 100,
            "max_new_tokens": 100,
            "max_iters": 100,
            "initial_validation": False,
            "final_validation": True,
        },
        "logger_name": "csv",
        "seed": 1337,
        "optimizer": optimizer,
        **extra,
    }
    path = tmp_path / "litgpt.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer, name, extra",
    [
        (
            {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-4, "weight_decay": 0.0, "betas": [0.9, 0.95]}},
            "AdamW",
            {"betas": (0.9, 0.95)},
        ),
        (
            {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-4, "weight_decay": 0.02, "foreach": True}},
            "AdamW",
            {"foreach": True},
        ),
        (
            {"class_path": "bitsandbytes.optim.PagedAdamW8bit", "init_args": {"lr": 1e-4, "weight_decay": 0.01}},
            "PagedAdamW8bit",
            {},
        ),
    ],
)
def test_litgpt_recipe_config_runs_unchanged_and_means_the_same(
    tmp_path, embedded, monkeypatch, capsys, optimizer, name, extra
):
    from conftest import load_script
    from memfit.settings.cli import CLI

    monkeypatch.chdir(tmp_path)
    config = _litgpt_config(tmp_path, embedded, optimizer)
    CLI(
        load_script("finetune/lora.py").setup,
        ["--config", str(config), "--train.max_steps", "2", "--eval.max_iters", "1", "--profile.enabled", "false"],
    )
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("lora: "))
    assert f"| {name}{'-foreach' if extra.get('foreach') else ''} |" in header
    assert "x 4 micro-batch(es) of 2 per step" in header  # global batch 8 of micro-batches of 2, one device
    state = torch.load(tmp_path / "out/final/training_state.pth", weights_only=False)
    group = state["optimizer"]["param_groups"][0]
    args = optimizer["init_args"]
    assert group["initial_lr"] == args["lr"] and group["weight_decay"] == args["weight_decay"]
    for key, value in extra.items():
        assert group[key] == value, key
    assert state["counters"]["step"] == 2
    weights = torch.load(tmp_path / "out/final/lit_model.pth.lora", weights_only=True)["model"]
    mlp_lora_a = [w for n, w in weights.items() if "mlp" in n and n.endswith("lora_A")]
    assert mlp_lora_a and all(w.shape[0] == 4 for w in mlp_lora_a)  # lora_mlp: true, lora_r: 4
    # what was resolved is what is recorded: --config of the checkpoint's hyperparameters means the same run
    hparams = yaml.safe_load((tmp_path / "out/final/hyperparameters.yaml").read_text())
    assert hparams["train"]["lr"] == args["lr"] and hparams["optimizer"] == optimizer


@pytest.mark.slow
def test_an_optimizer_argument_memfit_does_not_take_is_refused_by_name(tmp_path, embedded, monkeypatch, capsys):
    from conftest import load_script
    from memfit.settings.cli import CLI

    monkeypatch.chdir(tmp_path)
    config = _litgpt_config(
        tmp_path, embedded, {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-4, "capturable": True}}
    )
    with pytest.raises(SystemExit) as exit_info:
        CLI(load_script("finetune/lora.py").setup, ["--config", str(config)])
    assert exit_info.value.code == 2
    assert "--optimizer init_args 'capturable' is not taken by torch.optim.AdamW" in capsys.readouterr().err


@pytest.mark.slow
def test_litgpt_pre_0_4_optimizer_keys_in_train_are_refused_with_where_they_moved(
    tmp_path, embedded, monkeypatch, capsys
):
    """Older copies of litgpt's hub (e.g. llama-2-7b/full.yaml) set train.learning_rate/weight_decay/beta1/beta2,
    which litgpt 0.5 refuses too; the line says where they go now."""
    from conftest import load_script
    from memfit.settings.cli import CLI

    monkeypatch.chdir(tmp_path)
    config = _litgpt_config(tmp_path, embedded, {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-4}})
    old = yaml.safe_load(config.read_text())
    old["train"].update(learning_rate=2e-4, weight_decay=0.1, beta1=0.9, beta2=0.95)
    del old["optimizer"]
    config.write_text(yaml.safe_dump(old))
    with pytest.raises(SystemExit) as exit_info:
        CLI(load_script("finetune/lora.py").setup, ["--config", str(config)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "the form of litgpt before 0.4" in err and "init_args: {lr: ..., weight_decay: ..., betas:" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_lora_run_on_the_embedded_default_merges_with_litgpt_and_trains_on(tmp_path, embedded, monkeypatch):
    """The embedded default's base is recorded by path too: litgpt's merge_lora finds it (it failed on a null
    checkpoint_dir), the merged dir is a base for another run, and the run's hyperparameters.yaml still reruns
    on the embedded data."""
    from litgpt.scripts.merge_lora import merge_lora

    monkeypatch.chdir(tmp_path)
    common = ["--train.max_steps", "2", "--profile.enabled", "false", "--logger_name", "csv"]
    first = run_in_process("finetune/lora.py", *common, "--out_dir", "first", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    final = tmp_path / "first/final"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    merge_lora(checkpoint_dir=final)
    monkeypatch.chdir(tmp_path)
    assert (final / "lit_model.pth").is_file()
    again = run_in_process(
        "finetune/lora.py", "--config", str(final / "hyperparameters.yaml"), "--out_dir", "again", cwd=tmp_path
    )
    assert again.returncode == 0 and "lora-embedded-" in again.stdout, again.stderr[-2000:]
    _, json_path = embedded
    on = run_in_process(
        "finetune/lora.py",
        "--checkpoint_dir",
        str(final),
        "--data",
        "JSON",
        "--data.json_path",
        str(json_path),
        "--data.num_workers",
        "0",
        *common,
        "--out_dir",
        "on",
        cwd=tmp_path,
    )
    assert on.returncode == 0, on.stderr[-2000:]


@pytest.mark.slow
def test_litgpt_merges_and_generates_from_another_directory(tmp_path, embedded, monkeypatch, capsys):
    """A Memfit LoRA checkpoint works with litgpt's own tools from anywhere: merge_lora finds the base checkpoint
    (stored by absolute path), and generate reads the run's prompt template (prompt_style.yaml)."""
    import shutil

    from litgpt.generate.base import main as litgpt_generate
    from litgpt.prompts import Alpaca, load_prompt_style
    from litgpt.scripts.merge_lora import merge_lora

    from conftest import load_script, tiny_train
    from memfit.args import ProfileArgs

    checkpoint_dir, json_path = embedded
    run_dir = tmp_path / "run"
    shutil.copytree(checkpoint_dir, run_dir / "ckpt")
    (run_dir / "ckpt/config.json").write_text('{"model_type": "llama"}')  # the Hugging Face config, as litgpt keeps it
    monkeypatch.chdir(run_dir)
    from litgpt.data import JSON

    load_script("finetune/lora.py").setup(
        checkpoint_dir=Path("ckpt"),
        data=JSON(json_path=json_path, val_split_fraction=0.1, num_workers=0),
        train=tiny_train(max_steps=2),
        profile=ProfileArgs(enabled=False),
        logger_name="csv",
    )
    final = (run_dir / "out/finetune/lora/final").resolve()
    hparams = yaml.safe_load((final / "hyperparameters.yaml").read_text())
    assert hparams["checkpoint_dir"] == str((run_dir / "ckpt").resolve()) and hparams["precision"] == "32-true"
    assert (final / "config.json").read_text() == '{"model_type": "llama"}'  # copied as litgpt copies it

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    merge_lora(checkpoint_dir=final)
    assert (final / "lit_model.pth").is_file()
    assert isinstance(load_prompt_style(final), Alpaca)
    capsys.readouterr()
    litgpt_generate(checkpoint_dir=final, prompt="Reverse the word.", max_new_tokens=4, num_samples=1)
    assert "### Response:" in capsys.readouterr().out  # the Alpaca template was applied to the prompt


@pytest.mark.parametrize(
    "script",
    ["finetune/lora.py", "finetune/adapter.py", "finetune/adapter_v2.py", "finetune/full.py", "pretrain/pretrain.py"],
)
def test_help_shows_exactly_the_values_each_flag_accepts(script):
    """jsonargparse's help cut every value at its dots, so --quantize was listed as nf4, nf4-dq, ..., which the
    parser then refused: each value of a fixed set is shown as typed, and parses."""
    from memfit.settings.cli import choices, make_parser

    parser = make_parser(load_script(script).setup)
    shown = " ".join(parser.format_help().split())
    checked = 0
    for action in parser._actions:
        values = choices(getattr(action, "_typehint", None))
        if not values or not action.option_strings:
            continue
        listed = f"(type: one of {', '.join(dict.fromkeys(map(str, values)))}"
        assert listed in shown, (action.dest, listed)
        for value in values:
            parser.parse_args([f"--{action.dest}", str(value)])  # raises on a refused value
            checked += 1
    assert checked >= 20 and "bnb.nf4-dq" in shown
    # the other forms of a flag that also takes a word: --devices 2, --resume true or a checkpoint's path
    assert "(type: one of auto, or an integer, default: 1)" in shown
    assert "(type: one of true, false, auto, or a path, default: False)" in shown
    assert shown.count("32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 32, 16, bf16") >= 1
    assert "bf16, 32, 16" not in shown  # each of litgpt's old forms listed once
    # a bare Literal's values once, not again as "or" forms; a path said in words, not as a Python class
    assert "(type: one of auto, cpu, cuda, gpu, default: auto)" in shown and "gpu, or auto" not in shown
    assert "<class" not in shown and "(type: a path, default: out/profiles)" in shown


@pytest.mark.slow
def test_config_files_that_are_not_recipes_are_one_line_and_an_alias_bomb_costs_nothing(tmp_path):
    """A --config file that is empty, a YAML list, not UTF-8, or whose aliases expand to hundreds of millions of
    values (it took 22 GB before the kernel killed the run) ends in one line naming the file and what is wrong. The
    bomb runs in a process of its own whose address space is capped, so a regression fails here instead of taking
    the machine; the others run in this process."""
    import subprocess
    import sys

    from conftest import ROOT

    files = tmp_path / "configs"
    files.mkdir()
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    cases = {
        "bomb.yaml": ("\n".join(levels) + "\n", "its YAML aliases expand to over 100,000 values"),
        "empty.yaml": ("", "is empty: it sets nothing"),
        "list.yaml": ("- train:\n    max_steps: 2\n", "is a YAML list, not a mapping"),
        "latin1.yaml": (b"precision: bf16-true  # \xe9t\xe9\n", "is not UTF-8 text (byte 0xe9 at 24)"),
    }
    launcher = (
        "import resource, runpy, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, resource.RLIM_INFINITY))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    run = tmp_path / "run"
    run.mkdir()
    for name, (content, says) in cases.items():
        path = files / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        if name != "bomb.yaml":
            result = run_in_process("finetune/lora.py", "--config", str(path), cwd=run)
        else:
            result = subprocess.run(
                [sys.executable, "-c", launcher, str(ROOT / "finetune/lora.py"), "--config", str(path)],
                cwd=run,
                capture_output=True,
                text=True,
                timeout=120,
            )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and says in lines[0], (name, result.stderr[-2000:])
        assert lines[0].startswith(f"error: --config '{path}'")
    assert list(run.iterdir()) == []


def test_docs_flags_page_names_every_flag_of_every_script():
    """docs/flags.md is linked as "every flag": each flag any script's --help shows is named there."""
    import re

    from memfit.settings.cli import make_parser

    documented = (ROOT / "docs/flags.md").read_text()
    missing = {}
    for script in SCRIPTS:
        shown = make_parser(load_script(script).setup).format_help()
        # an option's own line starts two spaces in; a description's wrapped lines start further in
        flags = set(re.findall(r"^  (--[a-z_][a-z_.]*[a-z_])\b", shown, flags=re.MULTILINE)) - {"--help"}
        assert len(flags) > 30, shown[:2000]
        missing[script] = sorted(flag for flag in flags if f"`{flag}" not in documented)
    assert all(not flags for flags in missing.values()), missing


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_pretraining_flag_is_shown_by_pretraining_alone_and_refused_elsewhere(tmp_path, script):
    """litgpt's shared TrainArgs bring --train.tie_embeddings to every script; only pretraining honours it, so only
    pretraining's --help lists it, and a fine-tuning script given it refuses it in one line."""
    shown = run_in_process(script, "--help", cwd=tmp_path).stdout
    pretraining = script.startswith("pretrain/")
    assert ("--train.tie_embeddings" in shown) == pretraining
    if not pretraining:
        given = run_in_process(script, "--train.tie_embeddings", "true", "--estimate", "true", cwd=tmp_path)
        lines = given.stderr.strip().splitlines()
        assert given.returncode == 2 and len(lines) == 1 and "--train.tie_embeddings is for pretraining" in lines[0]
