"""memfit.training.bitsandbytes_layers: every --quantize mode on CPU, and bitsandbytes loaded without reaching the
network."""

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import ROOT, load_script, script_summary, tiny_train
from memfit.training.quantizers import QUANTIZERS

lora = load_script("finetune/lora.py")


@pytest.mark.slow
def test_bitsandbytes_is_imported_without_fetching_a_kernel_from_the_hub(tmp_path):
    """No network at run time: on CPUs with AVX512-BF16 bitsandbytes' import asks Hugging Face's `kernels` package
    for a kernel from the Hub and, without it, prints "Failed to load CPU gemm_4bit_forward from kernels-community".
    With a stand-in `kernels` that writes its calls down, Memfit's import makes none and prints nothing of it, and
    4-bit layers still compute (with the kernel bitsandbytes ships). A plain import on such a CPU shows the stand-in
    is reached where the guard is missing."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'tests' / 'with_hub_kernels'}{os.pathsep}{ROOT}",
        "MEMFIT_TEST_KERNEL_CALLS": str(tmp_path / "calls"),
    }
    memfit_import = """
import torch
from memfit.training.bitsandbytes_layers import import_bitsandbytes
bnb = import_bitsandbytes()
layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
w = torch.randn(32, 64, dtype=torch.bfloat16)
layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")._quantize("cpu")
x = torch.randn(3, 64, dtype=torch.bfloat16)
dequantized = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
torch.testing.assert_close(layer(x), x @ dequantized.t(), rtol=2e-2, atol=2e-2)
print(bnb.functional.has_avx512bf16())
"""
    result = subprocess.run([sys.executable, "-c", memfit_import], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (tmp_path / "calls").exists()
    assert "kernels-community" not in result.stderr
    if result.stdout.strip() == "True":  # this CPU takes the path that asks the Hub
        plain = subprocess.run(
            [sys.executable, "-c", "import bitsandbytes"], env=env, capture_output=True, text=True, timeout=120
        )
        assert plain.returncode == 0, plain.stderr[-2000:]
        assert (tmp_path / "calls").read_text().split() == ["kernels-community/quantization-bitsandbytes"]


@pytest.mark.slow
@pytest.mark.parametrize("quantize", list(QUANTIZERS))
def test_every_quantize_mode_trains_on_cpu(tmp_path, embedded, quantize):
    """Every --quantize choice --help shows trains (the registry's, not a list kept here: an entry whose layers the
    loading code cannot build fails here, not in a user's run)."""
    kind = QUANTIZERS[quantize]
    if kind.library == "torchao" and importlib.util.find_spec("torchao") is None:
        pytest.skip(f"--quantize {quantize} needs torchao (pip install -e '.[torchao]')")
    precision = kind.needs_precision or "32-true"
    steps = 30 if precision != "16-true" else 16  # float16 matmuls are slow on CPU
    script_summary(
        "finetune/lora.py", tmp_path, quantize=quantize, precision=precision, train=tiny_train(max_steps=steps)
    )
    (metrics,) = (tmp_path / "profiles").glob("*/metrics.csv")
    losses = [float(row["loss"]) for row in csv.DictReader(metrics.open()) if row.get("loss")]
    assert len(losses) == steps
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_4bit_backward_on_a_cpu_is_bitsandbytes_gradient_through_the_fast_layout(dtype, monkeypatch):
    """On a CPU in 16 bits, a 4-bit layer's input gradient comes from the transposed copy of its dequantized weight
    (``memfit.training.bitsandbytes_layers._with_fast_cpu_backward``): the same gradient as bitsandbytes' own backward
    to
    bfloat16 rounding, for an input of any leading shape, and the bias's gradient exactly; float32 runs bitsandbytes'
    own."""
    import torch

    from memfit.training.bitsandbytes_layers import import_bitsandbytes

    bnb = import_bitsandbytes()
    matmul_4bit = bnb.autograd._functions.MatMul4Bit
    assert matmul_4bit.backward is not matmul_4bit._memfit_own_backward
    compute = getattr(torch, dtype)
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 96, bias=True, compute_dtype=compute, quant_type="nf4")
    weight = torch.randn(96, 128, dtype=compute)
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")._quantize("cpu")
    layer.bias = torch.nn.Parameter(torch.randn(96, dtype=compute))
    x = torch.randn(2, 40, 128, dtype=compute)

    def gradients() -> tuple[torch.Tensor, torch.Tensor]:
        inputs = x.clone().requires_grad_()
        layer.bias.grad = None
        (layer(inputs) * torch.linspace(-1, 1, 96, dtype=compute)).sum().backward()
        return inputs.grad, layer.bias.grad

    fast = gradients()
    monkeypatch.setattr(matmul_4bit, "backward", staticmethod(matmul_4bit._memfit_own_backward))
    own = gradients()
    torch.testing.assert_close(fast[0], own[0], rtol=1.6e-2, atol=1e-2)
    assert fast[0].abs().max() > 1  # a gradient, not zeros
    torch.testing.assert_close(fast[1], own[1], rtol=0, atol=0)
    if dtype == "float32":
        assert torch.equal(fast[0], own[0])  # bitsandbytes' own backward ran
