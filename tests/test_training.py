"""Training behaviour on CPU: quantized bases train, accumulation is exact, resume continues exactly."""

import json

import pytest
import torch
import yaml

from conftest import load_script, quiet, run_script, run_summary, shared_file

lora = load_script("finetune/lora.py")


def test_impossible_combination_stops_before_writing(tmp_path):
    """Refused in setup() before anything is built or written: milliseconds, so it stays in the fast tier (its
    setup() called directly, not as a run)."""
    from memfit.errors import UserError

    with pytest.raises(UserError, match="bnb.int8-training needs --precision 16-true"):
        lora.setup(
            out_dir=tmp_path / "out",
            profile_dir=tmp_path / "profiles",
            **quiet(quantize="bnb.int8-training", precision="bf16-true"),
        )
    assert not tmp_path.joinpath("out").exists() and not tmp_path.joinpath("profiles").exists()


# Accumulation is tested on every script's own train_step: tests/test_train_step.py


@pytest.mark.slow
def test_sentencepiece_checkpoint_dir(tmp_path):
    """A litgpt checkpoint dir with a SentencePiece tokenizer.model (the real Llama 2 one) and random weights."""
    from litgpt import GPT, Config

    tokenizer = shared_file("llama2_tokenizer.model")
    alpaca = shared_file("alpaca_5000.json")
    checkpoint_dir = tmp_path / "llama-tiny-sp"
    checkpoint_dir.mkdir()
    config = dict(
        name="llama-tiny-sp",
        block_size=256,
        vocab_size=32000,
        padded_vocab_size=32000,
        n_layer=2,
        n_head=4,
        n_query_groups=4,
        n_embd=64,
        intermediate_size=172,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    (checkpoint_dir / "model_config.yaml").write_text(yaml.safe_dump(config))
    (checkpoint_dir / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    torch.manual_seed(0)
    model = GPT(Config(**config))
    model.apply(model._init_weights)
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, checkpoint_dir / "lit_model.pth")
    subset = tmp_path / "alpaca_200.json"
    subset.write_text(json.dumps(json.loads(alpaca.read_text())[:200]))

    result = run_script(
        "finetune/lora.py",
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--quantize",
        "bnb.nf4-dq",
        "--precision",
        "32-true",
        "--data",
        "JSON",
        "--data.json_path",
        str(subset),
        "--data.val_split_fraction",
        "0.1",
        "--train.max_steps",
        "8",
        "--train.micro_batch_size",
        "2",
        "--train.global_batch_size",
        "4",
        "--train.max_seq_length",
        "128",
        "--eval.max_iters",
        "2",
        "--train.lr",
        "3e-3",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")
    assert summary["run"].startswith("lora-llama-tiny-sp-")
    assert summary["last_loss"] < summary["first_loss"], summary
    assert (tmp_path / "out/finetune/lora/final/tokenizer.model").is_file()


@pytest.mark.slow
def test_the_profile_flags_do_not_change_the_training(tmp_path):
    """The same seed trains the same weights with the default profiler window, with profiling off and with another
    window: the longest samples go to the default window's step whatever is profiled (before, they moved with the
    window, and to the first step with profiling off)."""
    from conftest import WEIGHTS

    common = ["--train.max_steps", "5", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]
    common += ["--logger_name", "csv", "--eval.interval", "100"]
    windows = {"default": [], "off": ["--profile.enabled", "false"], "later": ["--profile.wait", "3"]}
    weights = {}
    for name, flags in windows.items():
        (tmp_path / name).mkdir()
        result = run_script("finetune/lora.py", *common, *flags, cwd=tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        saved = torch.load(tmp_path / name / "out/finetune/lora/final" / WEIGHTS["lora"], weights_only=True)
        weights[name] = saved.get("model", saved)
    for name in ("off", "later"):
        for key, tensor in weights["default"].items():
            assert torch.equal(tensor, weights[name][key]), (name, key)
