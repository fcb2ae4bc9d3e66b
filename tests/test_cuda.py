"""GPU checks, skipped without CUDA. Real architectures with random weights: memory and speed do not depend on values.

Run with `pytest -m cuda` on a GPU machine; results of the GPU runs are committed under profiles/gpu/.
"""

import json
import math
import os

import pytest

from conftest import ROOT, cuda, run_script, run_summary

pytestmark = [pytest.mark.cuda, cuda, pytest.mark.xdist_group("one_gpu"), pytest.mark.slow]  # one at a time

ARCHITECTURE = "TinyLlama-1.1B-intermediate-step-1431k-3T"  # Llama-2 architecture at 1.1B: quick to write and load
# the warning of a run whose recorded step failed under the instrumentation and was taken again without it (on an H100,
# full.py's did, in backward: profiles/gpu/pytest_cuda.json)
INSTRUMENTATION_FAILED = "the recorded step failed under the memory instrumentation"


def predicted_peak_bytes(stdout: str) -> float:
    """The estimate's "Predicted peak: 974.83 MiB" in bytes, whichever unit it is printed in."""
    number, unit = stdout.split("Predicted peak: ")[1].split()[:2]
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


def predicted_phase_peaks(stdout: str) -> dict[str, float]:
    """The estimate table's "peak" row, in bytes, by phase (the header row names them)."""
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("role "))
    (row,) = [line for line in lines if line.startswith("peak ")]
    values = row.split()[1:]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    sizes = [float(values[i]) * units[values[i + 1]] for i in range(0, len(values), 2)]
    return dict(zip(header.split()[1:], sizes, strict=True))


@pytest.fixture(scope="module")
def real_architecture(tmp_path_factory):
    """The random-weight checkpoint, written once per worker, or once for all of them where
    ``MEMFIT_TEST_CHECKPOINTS`` names a dir that holds it (benchmarks/gpu_check.py writes it there first: four
    workers each writing 2.2 GB at once stalled every test on the lent H100)."""
    from memfit.training.random_checkpoints import random_checkpoint

    return random_checkpoint(ARCHITECTURE, os.environ.get("MEMFIT_TEST_CHECKPOINTS") or tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("quantize", ["bnb.nf4", "bnb.nf4-dq"])
def test_qlora_on_gpu(tmp_path, embedded, real_architecture, quantize):
    """QLoRA with bf16-true on CUDA trains, and the bf16 base never sits whole on the GPU while loading."""
    _, json_path = embedded
    result = run_script(
        "finetune/lora.py",
        "--checkpoint_dir",
        str(real_architecture),
        "--precision",
        "bf16-true",
        "--quantize",
        quantize,
        "--data",
        "JSON",
        "--data.json_path",
        str(json_path),
        "--data.val_split_fraction",
        "0.05",
        "--train.max_steps",
        "6",
        "--train.micro_batch_size",
        "4",
        "--train.global_batch_size",
        "8",
        "--eval.max_iters",
        "2",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")
    assert summary["memory"]["measures"] == "cuda_allocated"
    bf16_bytes = (real_architecture / "lit_model.pth").stat().st_size
    # 4-bit linears + bf16 embeddings/norms: well under half of the bf16 checkpoint, at every point of loading
    assert summary["memory"]["peak_bytes"]["load"] < 0.5 * bf16_bytes, (summary["memory"], bf16_bytes)
    assert summary["memory_snapshot"] and summary["profile_traces"]
    # a model whose logits do not depend on its input scores ln(vocab) at every step (a zero final norm did once)
    assert abs(summary["first_loss"] - math.log(32000)) > 1e-3, summary["first_loss"]
    assert summary["last_loss"] < summary["first_loss"]


def test_accelerator_auto_picks_the_gpu(tmp_path, embedded):
    """With no flags the run is on the GPU. The ledger's "not found" (on an H100, 64 MiB of the embedded model's
    75.5 MiB forward peak, in every phase, before the workspaces were measured) is the allocator's blocks alive since
    before the step that hold no role; the cuBLAS workspaces, measured by freeing them, are as many bytes as the
    estimate's model of them (two, one per thread that runs matmuls) and are found at the peak by address."""
    from memfit.prediction.estimate import cublas_workspace_bytes

    result = run_script("finetune/lora.py", "--train.max_steps", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_summary(tmp_path / "out" / "profiles")["memory"]["measures"] == "cuda_allocated"
    (ledger_file,) = (tmp_path / "out" / "profiles").glob("*/ledger.json")
    ledger = json.loads(ledger_file.read_text())
    forward = ledger["phases"]["forward"]
    without_role = sum(ledger["before_step_without_role_bytes"])
    workspaces = sum(ledger["cublas_workspaces_bytes"])
    assert workspaces == cublas_workspace_bytes("cuda"), (ledger["cublas_workspaces_bytes"], without_role)
    assert forward["found_at_peak_bytes"]["cublas_workspaces"] == workspaces, forward
    assert abs(forward["not_found_bytes"] - (without_role - workspaces)) <= 2**21 + 0.05 * forward["peak_bytes"], (
        forward,
        without_role,
        workspaces,
    )


@pytest.mark.parametrize(
    "script, flags",
    [
        ("finetune/adapter.py", ["--quantize", "bnb.nf4"]),
        ("finetune/adapter_v2.py", ["--quantize", "bnb.nf4-dq"]),
        # recomputed regions in every step of a two-step window: only the ledger's step has the allocator's history;
        # 11 of the 22 blocks checkpointed, the estimate pricing each
        ("finetune/full.py", ["--activation_checkpointing", "11", "--profile.active", "2"]),
        # saved activations in pinned host memory: the estimate keeps one block's on the device
        ("finetune/lora.py", ["--activation_offloading", "true"]),
        # a step of 8 micro-batches, traced from its last
        ("finetune/lora.py", ["--quantize", "bnb.nf4", "--train.global_batch_size", "16"]),
        ("finetune/lora.py", ["--quantize", "bnb.fp4"]),
        ("finetune/lora.py", ["--quantize", "bnb.int8-training", "--precision", "16-true"]),
        ("finetune/lora.py", ["--precision", "bf16-mixed"]),
        ("finetune/full.py", ["--optimizer", "PagedAdamW"]),
        ("finetune/full.py", ["--optimizer_in_backward", "true"]),
        # sharded gradient accumulation (memfit.training.strategy reads FSDP's own hooks) on the installed torch
        ("finetune/full.py", ["--strategy", "fsdp", "--devices", "1", "--train.global_batch_size", "4"]),
        # clipping on the offloaded gradients: an all-reduce of CPU tensors, which needs gloo beside NCCL
        (
            "finetune/full.py",
            ["--strategy", "fsdp", "--devices", "1", "--fsdp.cpu_offload", "true", "--train.max_norm", "1.0"],
        ),
        ("finetune/lora.py", ["--optimizer", "AdamW8bit"]),
        ("finetune/lora.py", ["--optimizer", "PagedAdamW8bit"]),
        # GPUs without bf16 train in 16-mixed: its gradient scaler's first steps overflow and are skipped
        ("finetune/full.py", ["--precision", "16-mixed"]),
        ("pretrain/pretrain.py", ["--train.max_seq_length", "256"]),
    ],
)
def test_every_script_and_technique_on_gpu(tmp_path, embedded, real_architecture, script, flags):
    """Each script for a few steps on a real architecture; FSDP + CPU offload on one GPU; 8-bit and paged optimizers;
    16-mixed.
    The ledger's measured peak must be within 10% of the estimate for the same settings."""
    _, json_path = embedded
    data = ["--data", "JSON", "--data.json_path", str(json_path), "--data.val_split_fraction", "0.05"]
    if script.startswith("pretrain"):
        data = ["--data", "PlainText", "--data.path", str(json_path.with_name("corpus.txt"))]
    args = [
        "--checkpoint_dir",
        str(real_architecture),
        "--precision",
        "bf16-true",
        *data,
        "--train.micro_batch_size",
        "2",
        "--train.global_batch_size",
        "2",
        "--eval.max_iters",
        "2",
        *flags,  # last: a case's own settings win
    ]
    result = run_script(script, *args, "--train.max_steps", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert INSTRUMENTATION_FAILED not in result.stdout, result.stdout[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")
    assert summary["memory"]["measures"] == "cuda_allocated" and summary["steps"] == 4
    (ledger_file,) = (tmp_path / "out" / "profiles").glob("*/ledger.json")
    ledger = json.loads(ledger_file.read_text())
    measured = max(p["peak_bytes"] for p in ledger["phases"].values())
    width = ledger["sequence_length"] - (1 if script.startswith("pretrain") else 0)
    estimate = run_script(script, *args, "--train.max_seq_length", str(width), "--estimate", "true", cwd=tmp_path)
    predicted = predicted_peak_bytes(estimate.stdout)
    if ledger["update_skipped"]:
        # 16-mixed's gradient scaler skipped this step's update (overflowed gradients, common in a run's first steps
        # on random weights): its optimizer_step held no update's memory, which the estimate (of a step that updates)
        # counts; the run says so, and the phases before the update are compared
        assert "weight update was skipped" in result.stdout, result.stdout[-3000:]
        predicted = max(v for k, v in predicted_phase_peaks(estimate.stdout).items() if k != "optimizer_step")
        measured = max(p["peak_bytes"] for k, p in ledger["phases"].items() if k not in ("optimizer_step", "zero_grad"))
    # on a miss, both sides role by role: a GPU window is too short to run the case again for them
    measured_roles = {
        name: {role: round(b / 2**20, 1) for role, b in phase["found_at_peak_bytes"].items()}
        | {"peak MiB": round(phase["peak_bytes"] / 2**20, 1)}
        for name, phase in ledger["phases"].items()
    }
    predicted_table = estimate.stdout[estimate.stdout.find("role ") : estimate.stdout.find("Predicted peak")]
    assert abs(predicted - measured) < 0.10 * measured, (
        predicted / 2**30,
        measured / 2**30,
        measured_roles,
        predicted_table,
    )


def test_out_of_memory_on_gpu_is_explained(tmp_path, embedded, real_architecture):
    """A real CUDA OOM (memory capped with set_per_process_memory_fraction) ends with the explanation, exit 3."""
    _, json_path = embedded
    script = tmp_path / "capped.py"
    script.write_text(
        "import sys, runpy, torch\n"
        "torch.cuda.set_per_process_memory_fraction(0.02)\n"
        f"sys.argv = ['full.py'] + sys.argv[1:]\n"
        f"runpy.run_path({str(ROOT / 'finetune/full.py')!r}, run_name='__main__')\n"
    )
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            str(script),
            "--checkpoint_dir",
            str(real_architecture),
            "--precision",
            "bf16-true",
            "--data",
            "JSON",
            "--data.json_path",
            str(json_path),
            "--train.max_steps",
            "3",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Out of memory in" in result.stderr and "Settings that fit" in result.stderr
    assert "Traceback" not in result.stderr


def test_resume_is_exact_on_the_gpu_with_lora_dropout(tmp_path, embedded):
    """LoRA dropout on CUDA draws from the device's generator: a resumed run restores it and matches a straight one."""
    import shutil

    import torch

    common = [
        "--lora_dropout",
        "0.3",
        "--precision",
        "32-true",
        "--train.max_steps",
        "6",
        "--train.save_interval",
        "3",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
    ]
    for name in ("straight", "resumed"):
        (tmp_path / name).mkdir()
        result = run_script("finetune/lora.py", *common, cwd=tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "resumed/out/finetune/lora"
    shutil.rmtree(out / "final")
    result = run_script("finetune/lora.py", *common, "--resume", "true", cwd=tmp_path / "resumed")
    assert result.returncode == 0, result.stderr[-3000:]
    a = torch.load(tmp_path / "straight/out/finetune/lora/final/lit_model.pth.lora", weights_only=True)["model"]
    b = torch.load(out / "final/lit_model.pth.lora", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7)


def test_a_run_begun_on_the_cpu_resumes_on_the_gpu(tmp_path, embedded):
    """A checkpoint written without a GPU has no GPU generator state: the GPU run resumes it and says what that
    changes (Fabric's strict load once made it "no readable step-* checkpoint")."""
    common = ["--train.max_steps", "4", "--train.save_interval", "2", "--profile.enabled", "false"]
    result = run_script("finetune/lora.py", *common, "--accelerator", "cpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    import shutil

    shutil.rmtree(tmp_path / "out/finetune/lora/final")
    result = run_script("finetune/lora.py", *common, "--accelerator", "cuda", "--resume", "true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "was written without a GPU" in result.stdout, result.stdout[-3000:]
    assert (tmp_path / "out/finetune/lora/final/lit_model.pth.lora").is_file()


def test_the_ledger_peak_is_the_runs_peak(tmp_path, embedded):
    """On CUDA, the profiled step's ledger peak is within 3% of the highest per-step allocator peak of the run."""
    import csv

    result = run_script("finetune/full.py", "--train.max_steps", "8", "--logger_name", "csv", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert INSTRUMENTATION_FAILED not in result.stdout, result.stdout[-3000:]
    (run_dir,) = (tmp_path / "out" / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    ledger_peak = max(p["peak_bytes"] for p in ledger["phases"].values())
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    run_peak = max(float(r["memory/step_peak_gib"]) for r in rows if r.get("memory/step_peak_gib")) * 2**30
    assert abs(ledger_peak - run_peak) <= 0.03 * run_peak, (ledger_peak, run_peak)
