"""One process against DDP and FSDP (with and without CPU offload) on the same training, alternated in one run.

    python benchmarks/strategies.py --repeats 2 --out profiles/cpu/strategies.json
    python benchmarks/strategies.py --accelerator cuda --model_name Llama-3.2-1B --repeats 1 \
        --out profiles/gpu/strategies.json

Each side pre-trains the same litgpt architecture (random weights, seeded: every side starts from the same model) on
the embedded text, with the same global batch: one process accumulates what N processes share. Each run is a fresh
process (``pretrain/pretrain.py``), the sides alternated ``repeats`` times. Figures per run, from the run's own files:
tokens/s over the training loop (``summary.json``), rank 0's peak tensor memory in the profiled step (the ledger's
measured peak: on CPU the profiler's count of live tensor bytes, on CUDA ``max_memory_allocated``; offloaded
weights and state are host memory, outside a CUDA figure but inside a CPU one) and rank 0's peak RSS. The report
gives the medians and each side's ratio to one process.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memfit.training.precision import cpu_description  # noqa: E402  (after the path)

SIDES = {
    "1 process": ["--devices", "1"],
    "DDP x2": ["--devices", "2", "--strategy", "ddp"],
    "FSDP x2": ["--devices", "2", "--strategy", "fsdp"],
    "FSDP x2 + cpu_offload": ["--devices", "2", "--strategy", "fsdp", "--fsdp.cpu_offload", "true"],
}


def run_side(args: argparse.Namespace, side: list[str], cwd: Path) -> dict:
    command = [
        sys.executable,
        str(ROOT / "pretrain/pretrain.py"),
        "--model_name",
        args.model_name,
        "--accelerator",
        args.accelerator,
        "--precision",
        args.precision,
        *side,
        "--train.max_steps",
        str(args.steps),
        "--train.global_batch_size",
        str(args.global_batch_size),
        "--train.micro_batch_size",
        str(args.micro_batch_size),
        "--train.max_seq_length",
        str(args.length),
        "--train.save_interval",
        "1000",
        "--eval.interval",
        "1000",
        "--eval.final_validation",
        "false",
        "--logger_name",
        "csv",
    ]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    (summary_file,) = (cwd / "out" / "profiles").glob("*/summary.json")
    summary = json.loads(summary_file.read_text())
    ledger = json.loads((summary_file.parent / "ledger.json").read_text())
    return {
        "command": " ".join(command[1:]),
        "tokens_per_s": summary["tokens_per_s"],
        "rank0_peak_tensor_bytes": max(phase["peak_bytes"] for phase in ledger["phases"].values()),
        "rank0_peak_tensor_measures": ledger["measures"],
        "rank0_peak_rss_bytes": max(summary["memory"]["peak_bytes"].values()),
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--model_name", default="pythia-70m", help="a litgpt config name (random weights)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        for side, flags in SIDES.items():
            with tempfile.TemporaryDirectory() as cwd:
                runs[side].append(run_side(args, flags, Path(cwd)))
            last = runs[side][-1]
            print(
                f"repeat {repeat + 1} {side:>22}: {last['tokens_per_s']:8.0f} tokens/s, rank 0 peak tensors"
                f" {last['rank0_peak_tensor_bytes'] / 2**20:8.2f} MiB,"
                f" RSS {last['rank0_peak_rss_bytes'] / 2**20:8.1f} MiB",
                flush=True,
            )

    def median(side: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[side])

    baseline = "1 process"
    report = {}
    print(
        f"\n{'side':>22} {'tokens/s':>10} {'x 1 process':>12} {'rank 0 tensors':>15} {'x 1 process':>12}"
        f" {'rank 0 RSS':>11}"
    )
    for side in SIDES:
        report[side] = {
            "tokens_per_s": median(side, "tokens_per_s"),
            "tokens_per_s_ratio": median(side, "tokens_per_s") / median(baseline, "tokens_per_s"),
            "rank0_peak_tensor_bytes": median(side, "rank0_peak_tensor_bytes"),
            "rank0_peak_tensor_ratio": (
                median(side, "rank0_peak_tensor_bytes") / median(baseline, "rank0_peak_tensor_bytes")
            ),
            "rank0_peak_rss_bytes": median(side, "rank0_peak_rss_bytes"),
        }
        r = report[side]
        print(
            f"{side:>22} {r['tokens_per_s']:10.0f} {r['tokens_per_s_ratio']:12.2f}"
            f" {r['rank0_peak_tensor_bytes'] / 2**20:11.2f} MiB {r['rank0_peak_tensor_ratio']:12.2f}"
            f" {r['rank0_peak_rss_bytes'] / 2**20:7.0f} MiB"
        )
    if args.out:
        versions = {name: importlib.metadata.version(name) for name in ("torch", "lightning", "litgpt")}
        record = {
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d"),
            "device": args.accelerator,
            "cpu": cpu_description(),
            "cores": __import__("os").cpu_count(),
            "python": platform.python_version(),
            "versions": versions,
            "settings": vars(args) | {"out": str(args.out)},
            "medians": report,
            "runs": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"Written: {args.out}")


if __name__ == "__main__":
    main()
