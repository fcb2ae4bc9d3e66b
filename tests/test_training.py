"""Training behaviour on CPU: quantized bases train, accumulation is exact, resume continues exactly."""

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import load_script, run_script, run_summary, shared_file, tiny_train

lora = load_script("finetune/lora.py")


def _setup(tmp_path, **kwargs):
    from memfit.profiling import ProfileArgs

    kwargs.setdefault("train", tiny_train())
    kwargs.setdefault("profile", ProfileArgs(enabled=False))
    lora.setup(out_dir=tmp_path / "out", profile_dir=tmp_path / "profiles", logger_name="csv", **kwargs)
    return run_summary(tmp_path / "profiles")


@pytest.mark.parametrize(
    "quantize, precision",
    [("bnb.nf4", "32-true"), ("bnb.nf4-dq", "32-true"), ("bnb.fp4", "32-true"), ("bnb.fp4-dq", "32-true"),
     ("bnb.int8-training", "16-true")],
)
def test_every_quantize_mode_trains_on_cpu(tmp_path, embedded, quantize, precision):
    steps = 30 if quantize != "bnb.int8-training" else 16  # float16 matmuls are slow on CPU
    _setup(tmp_path, quantize=quantize, precision=precision, train=tiny_train(max_steps=steps))
    (metrics,) = (tmp_path / "profiles").glob("*/metrics.csv")
    losses = [float(row["loss"]) for row in csv.DictReader(metrics.open()) if row.get("loss")]
    assert len(losses) == steps
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses


def test_impossible_combination_stops_before_writing(tmp_path):
    from memfit.cli import UserError

    with pytest.raises(UserError, match="bnb.int8-training needs --precision 16-true"):
        _setup(tmp_path, quantize="bnb.int8-training", precision="bf16-true")
    assert not tmp_path.joinpath("out").exists() and not tmp_path.joinpath("profiles").exists()


def test_gradient_accumulation_matches_one_big_batch(embedded):
    """k micro-batches of m give the LoRA gradients of one batch of k*m, with no_backward_sync around the first k-1."""
    import lightning as L
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    from memfit.loading import load_model
    from memfit.loop import Run, accumulate, sft_loss, sft_targets
    from memfit.memory import MemoryProbe, PhaseMemory

    checkpoint_dir, _ = embedded
    config = Config.from_file(checkpoint_dir / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True,
                              lora_dropout=0.0)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    generator = torch.Generator().manual_seed(0)
    # equal-length samples, all tokens counted: the mean loss of a big batch is the mean of the micro-batch means
    input_ids = torch.randint(0, 800, (8, 24), generator=generator)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}

    def grads(k: int) -> dict:
        torch.manual_seed(0)
        model = load_model(GPT, config, checkpoint_dir / "lit_model.pth", dtype=torch.float32,
                           device=torch.device("cpu"), new_parameters=("lora_A", "lora_B"))
        mark_only_lora_as_trainable(model)
        with torch.no_grad():  # B starts at zero, which would leave A without gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        model = fabric.setup_module(model)
        m = 8 // k
        micro = iter([{key: v[i * m:(i + 1) * m] for key, v in batch.items()} for i in range(k)])
        calls = []
        original = fabric.no_backward_sync

        def recording_no_backward_sync(module, enabled=True):
            calls.append(enabled)
            return original(module, enabled=enabled)

        fabric.no_backward_sync = recording_no_backward_sync
        run = Run(fabric=fabric, model=model, optimizer=None, scheduler=None, batches=micro, val_loader=None,
                  train=None, eval=None, accumulation=k, max_steps=1, loss_fn=sft_loss, targets_fn=sft_targets, out_dir=Path("."),
                  run_dir=Path("."), profile=None, memory=PhaseMemory(MemoryProbe(torch.device("cpu"))),
                  checkpoint=None)
        accumulate(run)
        del fabric.no_backward_sync
        assert calls == [True] * (k - 1) + [False]
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    one, four = grads(1), grads(4)
    assert one.keys() == four.keys() and len(one) == 8
    for name in one:
        assert one[name].abs().sum() > 0, name
        torch.testing.assert_close(four[name], one[name], rtol=1e-4, atol=1e-6)


def test_resume_continues_exactly(tmp_path, embedded):
    """Stopping after step 6 and resuming gives the same weights as training 10 steps straight."""
    from memfit.checkpoint import latest_checkpoint

    straight = tmp_path / "straight"
    _setup(straight, train=tiny_train(max_steps=10, save_interval=3))
    resumed = tmp_path / "resumed"
    _setup(resumed, train=tiny_train(max_steps=10, save_interval=3))
    # simulate a crash after step 6: drop the later checkpoints, keep a half-written one that must be ignored
    import shutil

    for name in ("step-000009", "final"):
        shutil.rmtree(resumed / "out" / name)
    (resumed / "out" / ".step-000009.tmp").mkdir()
    assert latest_checkpoint(resumed / "out").name == "step-000006"
    shutil.rmtree(resumed / "profiles")
    summary = _setup(resumed, train=tiny_train(max_steps=10, save_interval=3), resume=True)
    assert summary["steps"] == 10 and len(json.loads(json.dumps(summary))["memory"]["peak_bytes"]) > 0
    a = torch.load(straight / "out/final/lit_model.pth.lora", weights_only=True)["model"]
    b = torch.load(resumed / "out/final/lit_model.pth.lora", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7)
    state = torch.load(resumed / "out/final/training_state.pth", weights_only=False)
    assert state["counters"]["step"] == 10 and state["data"]["epoch"] >= 0


def test_sentencepiece_checkpoint_dir(tmp_path):
    """A litgpt checkpoint dir with a SentencePiece tokenizer.model (the real Llama 2 one) and random weights."""
    from litgpt import GPT, Config

    tokenizer = shared_file("llama2_tokenizer.model")
    alpaca = shared_file("alpaca_5000.json")
    checkpoint_dir = tmp_path / "llama-tiny-sp"
    checkpoint_dir.mkdir()
    config = dict(name="llama-tiny-sp", block_size=256, vocab_size=32000, padded_vocab_size=32000, n_layer=2,
                  n_head=4, n_query_groups=4, n_embd=64, intermediate_size=172, rotary_percentage=1.0,
                  parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")
    (checkpoint_dir / "model_config.yaml").write_text(yaml.safe_dump(config))
    (checkpoint_dir / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    torch.manual_seed(0)
    model = GPT(Config(**config))
    model.apply(model._init_weights)
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, checkpoint_dir / "lit_model.pth")
    subset = tmp_path / "alpaca_200.json"
    subset.write_text(json.dumps(json.loads(alpaca.read_text())[:200]))

    result = run_script(
        "finetune/lora.py", "--checkpoint_dir", str(checkpoint_dir), "--quantize", "bnb.nf4-dq",
        "--precision", "32-true", "--data", "JSON", "--data.json_path", str(subset),
        "--data.val_split_fraction", "0.1", "--train.max_steps", "8", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--train.max_seq_length", "128", "--eval.max_iters", "2",
        "--train.lr", "3e-3", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "profiles")
    assert summary["run"].startswith("lora-llama-tiny-sp-")
    assert summary["last_loss"] < summary["first_loss"], summary
    assert (tmp_path / "out/finetune/lora/final/tokenizer.model").is_file()
