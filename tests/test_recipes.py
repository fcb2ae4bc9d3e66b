"""recipes/: every YAML loads against its script's signature, says what it is for, and runs as a tiny variant."""

import math
import re
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, load_script, run_summary

RECIPES = sorted((ROOT / "recipes").glob("*/*.yaml"))


def _script(recipe: Path) -> str:
    return re.search(r"# Run:\s+python (\S+) --config", recipe.read_text()).group(1)


def _parser(script: str):
    from jsonargparse import auto_parser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    return auto_parser(load_script(script).setup, as_positional=False, exit_on_error=False)


def test_the_recipe_set_covers_the_models_and_methods():
    names = {f"{r.parent.name}/{r.stem}" for r in RECIPES}
    for model in ("tinyllama-1.1b", "llama-2-7b", "llama-3.1-8b", "llama-2-70b"):
        assert any(n.startswith(model + "/") for n in names), model
    for method in ("lora", "qlora", "adapter", "adapter_v2", "full-fsdp-offload", "pretrain"):
        assert any(n.endswith("/" + method) for n in names), method


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.parent.name}/{r.stem}")
def test_recipe_loads_against_its_script(recipe):
    text = recipe.read_text()
    for header in ("# Run:", "# Hardware:", "# Memory:"):
        assert header in text, header
    assert "predicted by --estimate" in text
    # a fine-tuning recipe names only what fine-tuning uses (min_lr is pretraining's: it printed a warning)
    assert recipe.stem == "pretrain" or "min_lr" not in text
    config = _parser(_script(recipe)).parse_args(["--config", str(recipe)])
    assert config.train.max_seq_length and config.precision == "bf16-true"
    if "qlora" in recipe.stem:
        assert config.quantize == "bnb.nf4-dq"
    if "fsdp" in recipe.stem:
        assert config.strategy == "fsdp" and config.fsdp.cpu_offload


@pytest.mark.slow
def test_a_recipes_memory_line_is_what_the_estimate_predicts_today():
    """The `# Memory:` lines are --estimate's predictions, refreshed by benchmarks/recipe_headers.py after the
    estimate changes (several had drifted by up to 17%). All of them take minutes to estimate; one stands for them.
    It is estimated as a reader would, `--config RECIPE --estimate true` where neither the weights nor the data it
    names are (an estimate needs neither): each absence is a note, and the architecture is litgpt's by the dir's name."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/recipe_headers.py"), "--check", "--only", "tinyllama-1.1b/lora"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and "0 of 1 headers stale" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "note: --data.json_path 'data/alpaca.json' is not on this machine" in result.stdout, result.stdout
    assert (
        "note: --checkpoint_dir 'checkpoints/TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T' is not on this"
        " machine; the estimate needs no weights and uses litgpt's tiny-llama-1.1b architecture"
    ) in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.parent.name}/{r.stem}")
def test_tiny_variant_of_recipe_trains_on_cpu(tmp_path, embedded, recipe):
    """The recipe's own method settings train on the embedded model and data.

    What this tests: the recipe's method and its options (LoRA layers and rank, adapter settings), --quantize, the
    optimizer, activation checkpointing and the learning rate, exactly as the recipe sets them. What it does not:
    the strategy, devices, nodes and FSDP offload (one CPU process here; the GPU tests cover those), precision
    (32-true: this CPU runs bf16 matmuls about 13x slower), and the batch sizes, sequence length and run length."""
    script = _script(recipe)
    parser = _parser(script)
    overrides = [
        "--config",
        str(recipe),
        "--checkpoint_dir",
        "null",
        "--model_name",
        "null",
        "--data",
        "null",
        "--accelerator",
        "cpu",
        "--devices",
        "1",
        "--num_nodes",
        "1",
        "--strategy",
        "auto",
        "--fsdp.cpu_offload",
        "false",
        "--precision",
        "32-true",
        "--train.max_steps",
        "3",
        "--train.max_seq_length",
        "96",
        "--train.global_batch_size",
        "4",
        "--train.micro_batch_size",
        "2",
        "--train.lr_warmup_steps",
        "1",
        "--train.save_interval",
        "null",
        "--eval.max_iters",
        "2",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        "--out_dir",
        str(tmp_path / "out"),
        "--profile_dir",
        str(tmp_path / "profiles"),
    ]
    init = parser.instantiate_classes(parser.parse_args(overrides))
    init.pop("config", None)
    load_script(script).setup(**init)
    summary = run_summary(tmp_path / "profiles")
    assert summary["steps"] == 3 and math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    recipe_settings = _parser(script).parse_args(["--config", str(recipe)])
    hparams = yaml.safe_load((tmp_path / "out/final/hyperparameters.yaml").read_text())
    for key in ("quantize", "optimizer", "activation_checkpointing", "lora_r", "lora_mlp"):
        if key in hparams:
            assert hparams[key] == recipe_settings[key], key
    assert hparams["train"]["lr"] == recipe_settings.train.lr
