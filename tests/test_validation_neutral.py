"""Validation never changes training, on every CPU, for quantized bases too.

bitsandbytes repacks a 4-bit weight into a CPU inference layout when its layer runs in eval mode on a CPU with
AVX512-BF16 (``Linear4bit.support_avx512bf16_for_cpu``), and the repacked layer no longer passes gradients. These
tests force that flag on, so they take the AVX512-BF16 path on every CPU, not only on the ones that have it.
"""

import pytest
import torch

from conftest import load_script, tiny_train

lora = load_script("finetune/lora.py")


@pytest.fixture
def avx512bf16_cpu(monkeypatch):
    """Every Linear4bit built from here on believes the CPU has AVX512-BF16 (a no-op where it really has)."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)


def _tiny_lora_gpt(intermediate_size: int = 256):
    from litgpt.lora import GPT, Config

    config = Config(
        block_size=32,
        vocab_size=64,
        padded_vocab_size=64,
        n_layer=2,
        n_head=2,
        n_query_groups=2,
        n_embd=64,
        intermediate_size=intermediate_size,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        lora_r=4,
        lora_alpha=8,
        lora_query=True,
        lora_value=True,
        lora_mlp=True,
        lora_head=False,
    )
    return GPT, config


def _state(tmp_path):
    torch.manual_seed(0)
    GPT, config = _tiny_lora_gpt()
    model = GPT(config)
    torch.save(model.state_dict(), tmp_path / "lit_model.pth")
    return GPT, config, tmp_path / "lit_model.pth"


def _lora_grads(model, x) -> dict:
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if "lora_A" in n}


def test_forced_flag_really_takes_bitsandbytes_repacking_path(tmp_path, avx512bf16_cpu):
    """The hazard exists as described: a plain bitsandbytes layer, eval + no_grad, is repacked in place and then
    stops passing gradients. Without this, the test below could pass because the flag did nothing."""
    import os

    import bitsandbytes as bnb

    if os.environ.get("MEMFIT_TEST_AVX512BF16") == "1" and not torch.cpu._is_avx512_bf16_supported():
        # tests/bnb_cpu_family made bitsandbytes register its AVX512-BF16 kernels on a CPU without the instructions:
        # the repacked matmul this test runs would end the process with SIGILL (training never runs it: memfit
        # turns repacking off, which the rest of the suite checks on this path)
        pytest.skip("the packed AVX512-BF16 kernel cannot run on this CPU; bitsandbytes' CPU family is emulated")

    from memfit.training.bitsandbytes_layers import _quantize_4bit

    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    assert layer.support_avx512bf16_for_cpu
    _quantize_4bit(layer, torch.randn(64, 64), torch.device("cpu"))
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None
    layer.eval()
    real_avx512bf16 = bnb.functional.has_avx512bf16()
    with torch.no_grad():
        try:
            layer(torch.randn(2, 64))
        except Exception:  # noqa: BLE001  (without the instruction set the repacked matmul itself may fail)
            assert not real_avx512bf16
    assert getattr(layer.weight.quant_state, "packing_format_for_cpu", False)  # the weight was repacked in place
    if real_avx512bf16:  # the packed kernel runs only where the CPU has it: then training through it is silent
        layer.train()
        x = torch.randn(2, 64, requires_grad=True)
        with pytest.warns(UserWarning, match="autograd kernel was not registered"):
            layer(x).sum().backward()
        assert x.grad is None  # gemv_4bit has no autograd: nothing behind this layer learns


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, quantize, weights_file",
    [
        ("finetune/lora.py", "bnb.nf4", "lit_model.pth.lora"),
        ("finetune/lora.py", "bnb.nf4-dq", "lit_model.pth.lora"),
        ("finetune/adapter.py", "bnb.nf4", "lit_model.pth.adapter"),
        ("finetune/adapter_v2.py", "bnb.nf4-dq", "lit_model.pth.adapter_v2"),
        ("finetune/full.py", None, "lit_model.pth"),
        ("pretrain/pretrain.py", None, "lit_model.pth"),
    ],
)
def test_validation_and_samples_every_two_steps_give_the_same_weights(
    tmp_path, embedded, avx512bf16_cpu, script, quantize, weights_file
):
    """Every script: validation (and a generated sample) every 2 steps trains exactly as no validation."""
    from litgpt.args import EvalArgs

    from memfit.args import ProfileArgs

    module = load_script(script)
    weights = {}
    for interval in (2, 1000):
        out = tmp_path / f"every-{interval}"
        train = tiny_train(max_steps=6, max_seq_length=32) if script.startswith("pretrain") else tiny_train(max_steps=6)
        run = module.setup(
            out_dir=out / "out",
            profile_dir=out / "profiles",
            logger_name="csv",
            quantize=quantize,
            train=train,
            # with validation, also a generated sample each time (litgpt's --eval.max_new_tokens),
            # longer than the longest training sample: the rope cache grows for it, then is restored
            eval=EvalArgs(interval=interval, max_iters=2, max_new_tokens=20 if interval == 2 else None),
            profile=ProfileArgs(enabled=False),
        )
        assert len(run.val_losses) == (3 if interval == 2 else 1)  # steps 2 and 4, plus the final one
        assert len(run.samples) == (3 if interval == 2 else 0) and None not in run.samples
        weights[interval] = torch.load(out / "out/final" / weights_file, weights_only=True)["model"]
    assert weights[2].keys() == weights[1000].keys() and weights[2]
    for name in weights[2]:
        assert torch.equal(weights[2][name], weights[1000][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("avx512bf16", [False, True])
def test_qlora_trains_through_validation_on_either_cpu_family(tmp_path, embedded, avx512bf16):
    """Each CPU family, emulated (tests/bnb_cpu_family): without AVX512-BF16 bitsandbytes registers no packed CPU
    kernel, with it it does (and would repack a 4-bit weight in eval mode); either way the signature run with
    validation every 5 steps still learns."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, run_summary

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "tests/bnb_cpu_family"),
        "MEMFIT_TEST_AVX512BF16": str(int(avx512bf16)),
        "PYTHONUNBUFFERED": "1",
    }
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import bitsandbytes as b; print(b.functional.has_avx512bf16(),"
            " b.nn.Linear4bit(64, 64).support_avx512bf16_for_cpu)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.split() == [str(avx512bf16)] * 2, probe.stderr[-2000:]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "finetune/lora.py"),
            "--quantize",
            "bnb.nf4-dq",
            "--train.max_steps",
            "24",
            "--eval.interval",
            "5",
            "--eval.max_iters",
            "2",
            "--profile.enabled",
            "false",
            "--logger_name",
            "csv",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")
    assert summary["last_loss"] < summary["first_loss"] - 0.5, summary  # litgpt's warm-up from 0, cosine to 0
