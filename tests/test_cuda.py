"""GPU checks, skipped without CUDA. Real architectures with random weights: memory and speed do not depend on values.

Run with `pytest -m cuda` on a GPU machine; results of the GPU runs are committed under profiles/gpu/.
"""

import json

import pytest
import torch

from conftest import cuda, run_script, run_summary

pytestmark = [pytest.mark.cuda, cuda]

ARCHITECTURE = "TinyLlama-1.1B-intermediate-step-1431k-3T"  # Llama-2 architecture at 1.1B: quick to write and load


@pytest.fixture(scope="module")
def real_architecture(tmp_path_factory):
    from memfit.embedded import write_random_checkpoint

    return write_random_checkpoint(ARCHITECTURE, tmp_path_factory.mktemp("ckpt") / ARCHITECTURE)


@pytest.mark.parametrize("quantize", ["bnb.nf4", "bnb.nf4-dq"])
def test_qlora_on_gpu(tmp_path, embedded, real_architecture, quantize):
    """QLoRA with bf16-true on CUDA trains, and the bf16 base never sits whole on the GPU while loading."""
    _, json_path = embedded
    result = run_script(
        "finetune/lora.py", "--checkpoint_dir", str(real_architecture), "--precision", "bf16-true",
        "--quantize", quantize, "--data", "JSON", "--data.json_path", str(json_path),
        "--data.val_split_fraction", "0.05", "--train.max_steps", "6", "--train.micro_batch_size", "4",
        "--train.global_batch_size", "8", "--eval.max_iters", "2", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "profiles")
    assert summary["memory"]["measures"] == "cuda_allocated"
    bf16_bytes = (real_architecture / "lit_model.pth").stat().st_size
    # 4-bit linears + bf16 embeddings/norms: well under half of the bf16 checkpoint, at every point of loading
    assert summary["memory"]["peak_bytes"]["load"] < 0.5 * bf16_bytes, (summary["memory"], bf16_bytes)
    assert summary["memory_snapshot"] and summary["profile_traces"]
    assert summary["last_loss"] < summary["first_loss"]


def test_accelerator_auto_picks_the_gpu(tmp_path, embedded):
    result = run_script("finetune/lora.py", "--train.max_steps", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_summary(tmp_path / "profiles")["memory"]["measures"] == "cuda_allocated"
