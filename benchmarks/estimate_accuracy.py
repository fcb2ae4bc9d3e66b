"""GPU benchmark: predicted (--estimate) vs measured max_memory_allocated, both sides in one run.

    python benchmarks/estimate_accuracy.py --out profiles/gpu/estimate_accuracy.json

Each configuration uses a real architecture with random weights (memory does not depend on the values): it is
estimated on fake tensors, then trained for a few steps on the GPU in a fresh process, and the ledger's measured
peak (CUDA allocator, peak reset per phase) is compared with the prediction. The data is generated so that every
sample is longer than ``--train.max_seq_length`` and counts every token (``--data.mask_prompt false``): every
micro-batch then has exactly the shape the estimate assumes, and whichever step the ledger profiles is the peak one. The
target is +-5%. Needs CUDA; writes the raw figures (device, versions, commands, predicted and measured bytes, ratio) as
JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name, script, architecture (litgpt config name), flags
CONFIGS = [
    (
        "qlora-7b-512",
        "finetune/lora.py",
        "Llama-2-7b-hf",
        [
            "--precision",
            "bf16-true",
            "--quantize",
            "bnb.nf4",
            "--train.max_seq_length",
            "512",
            "--train.micro_batch_size",
            "4",
        ],
    ),
    (
        "qlora-7b-2048",
        "finetune/lora.py",
        "Llama-2-7b-hf",
        [
            "--precision",
            "bf16-true",
            "--quantize",
            "bnb.nf4",
            "--train.max_seq_length",
            "2048",
            "--train.micro_batch_size",
            "2",
        ],
    ),
    (
        "lora-bf16-7b-512",
        "finetune/lora.py",
        "Llama-2-7b-hf",
        ["--precision", "bf16-true", "--train.max_seq_length", "512", "--train.micro_batch_size", "4"],
    ),
    (
        "full-1.1b",
        "finetune/full.py",
        "TinyLlama-1.1B-intermediate-step-1431k-3T",
        ["--precision", "bf16-true", "--train.max_seq_length", "1024", "--train.micro_batch_size", "4"],
    ),
    (
        "full-1.1b-checkpointing",
        "finetune/full.py",
        "TinyLlama-1.1B-intermediate-step-1431k-3T",
        [
            "--precision",
            "bf16-true",
            "--train.max_seq_length",
            "1024",
            "--train.micro_batch_size",
            "4",
            "--activation_checkpointing",
            "true",
        ],
    ),
    # -mixed: CUDA's autocast computes more in float32 than the CPU's the estimate traces with
    # (memfit.training.cuda_autocast); a LayerNorm model (Pythia) beside a Llama
    (
        "lora-bf16-mixed-1.1b",
        "finetune/lora.py",
        "TinyLlama-1.1B-intermediate-step-1431k-3T",
        ["--precision", "bf16-mixed", "--train.max_seq_length", "1024", "--train.micro_batch_size", "4"],
    ),
    (
        "lora-bf16-mixed-pythia-1b",
        "finetune/lora.py",
        "pythia-1b",
        ["--precision", "bf16-mixed", "--train.max_seq_length", "1024", "--train.micro_batch_size", "4"],
    ),
    (
        "full-1.1b-fsdp-offload",
        "finetune/full.py",
        "TinyLlama-1.1B-intermediate-step-1431k-3T",
        [
            "--precision",
            "bf16-true",
            "--train.max_seq_length",
            "1024",
            "--train.micro_batch_size",
            "4",
            "--strategy",
            "fsdp",
            "--fsdp.cpu_offload",
            "true",
        ],
    ),
]


def fixed_length_records(n: int, min_tokens: int, seed: int = 0) -> list[dict]:
    """Instruction records whose answers are at least ``min_tokens`` tokens long with any tokenizer (one word is at
    least one token), so truncation makes every sample exactly ``--train.max_seq_length`` long."""
    words = ["memory", "gradient", "optimizer", "activation", "weight", "token", "batch", "layer", "kernel", "peak"]
    rng = random.Random(seed)
    return [
        {
            "instruction": "Repeat the words.",
            "input": "",
            "output": " ".join(rng.choice(words) for _ in range(min_tokens)),
        }
        for _ in range(n)
    ]


def run(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The process's result; one that runs past ``timeout`` seconds is stopped and reported as failed, so one
    configuration cannot use up a GPU session's time."""
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        return subprocess.CompletedProcess(command, 124, stdout="", stderr=f"stopped after {stopped.timeout:.0f} s")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/gpu/estimate_accuracy.json")
    parser.add_argument("--only", nargs="*", help="names of configurations to run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each estimate or training process may run")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=None,
        help="where random-weight checkpoints are made, and reused by later benchmarks (default: the"
        " run's temporary dir)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: this benchmark measures CUDA memory; run it on a GPU machine")
    from memfit.training.random_checkpoints import random_checkpoint

    work = Path(tempfile.mkdtemp(prefix="memfit-bench-"))
    json_path = work / "fixed_length.json"
    json_path.write_text(json.dumps(fixed_length_records(64, 2 * 2048)))
    results = []
    report = {
        "device": torch.cuda.get_device_name(0),
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            **{m: importlib.metadata.version(m) for m in ("lightning", "litgpt", "bitsandbytes")},
        },
        "measures": "max_memory_allocated (CUDA caching allocator), predicted vs measured in the same run",
        "command": "python benchmarks/estimate_accuracy.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "results": results,  # filled as the configurations run
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, script, architecture, flags in CONFIGS:
        if args.only and name not in args.only:
            continue
        checkpoint = random_checkpoint(architecture, args.checkpoints or work)
        common = [
            sys.executable,
            str(ROOT / script),
            "--checkpoint_dir",
            str(checkpoint),
            "--data",
            "JSON",
            "--data.json_path",
            str(json_path),
            "--data.val_split_fraction",
            "0.05",
            "--data.mask_prompt",
            "false",
            *flags,
            "--train.global_batch_size",
            flags[flags.index("--train.micro_batch_size") + 1],
        ]
        estimate_cmd = common + ["--estimate", "true"]
        train_cmd = common + [
            "--train.max_steps",
            "4",
            "--eval.max_iters",
            "2",
            "--eval.final_validation",
            "false",
            "--profile_dir",
            str(work / name),
            "--out_dir",
            str(work / name / "out"),
            "--train.save_interval",
            "null",
        ]
        started = time.time()
        estimate = run(estimate_cmd, work, args.timeout)
        trained = run(train_cmd, work, args.timeout)
        entry = {
            "name": name,
            "script": script,
            "architecture": architecture,
            "flags": flags,
            "estimate_command": " ".join(estimate_cmd),
            "train_command": " ".join(train_cmd),
            "seconds": time.time() - started,
        }
        if estimate.returncode or trained.returncode:
            entry["error"] = (estimate.stderr + trained.stderr)[-3000:]
        else:
            # the estimate printed for the longest sample; the ledger's step is the one measured
            predicted = float(estimate.stdout.split("Predicted peak: ")[1].split()[0])
            unit = estimate.stdout.split("Predicted peak: ")[1].split()[1]
            (ledger_file,) = (work / name).glob("*/ledger.json")
            ledger = json.loads(ledger_file.read_text())
            measured = max(p["peak_bytes"] for p in ledger["phases"].values())
            entry.update(
                predicted_bytes=predicted * {"GiB": 2**30, "MiB": 2**20}[unit],
                measured_bytes=measured,
                measured_sequence_length=ledger["sequence_length"],
                ledger=ledger,
                # where a configuration misses, both sides role by role and the measured step's memory by operator:
                # a GPU window is too short to run it again for them
                predicted_table=estimate.stdout[estimate.stdout.find("role ") : estimate.stdout.find("Predicted peak")],
                measured_operators=_operators(ledger_file.parent),
            )
            entry["ratio"] = entry["predicted_bytes"] / measured
        results.append(entry)
        print(json.dumps({k: entry.get(k) for k in ("name", "predicted_bytes", "measured_bytes", "ratio", "error")}))
        # written after each configuration, so a run stopped part-way keeps what it measured
        args.out.write_text(json.dumps(report, indent=2))


def _operators(run_dir: Path, shown: int = 25) -> list[dict]:
    """The profiled step's memory by operator (the page's table), the ``shown`` that allocated most."""
    from memfit.trace_events import operator_memory, read_trace_events, trace_files

    traces = trace_files(run_dir, "rank0")
    if not traces:
        return []
    operators, _ = operator_memory(read_trace_events(traces[0]), device_type=1)
    read_trace_events.cache_clear()
    return operators[:shown]


if __name__ == "__main__":
    main()
