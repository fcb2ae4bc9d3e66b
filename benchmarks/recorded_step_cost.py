"""What the recorded step costs on a model of real size, on this machine's CPU: LoRA on the 1.1B TinyLlama
architecture (random weights, 32-true), the same run with the profiler window (the default) and with
``--profile.enabled false``, alternated.

    python benchmarks/recorded_step_cost.py --out profiles/cpu/recorded_step_cost_1.1b.json

Each run trains ``--steps`` steps of one micro-batch of ``--length`` tokens (fixed-length records: every step has the
same tokens) and logs each step's tokens/s (``--logger_name csv``). The recorded step's extra seconds are its time
against the median of the steps after it in the same run, and the same step of the unprofiled run against its own
steps after it (what step 3 costs without the window: the control). The process's wall and CPU seconds (``wait4``)
are given for both runs; the difference includes the ledger, the pictures and the page made after training. The GPU
check measures the same on 7B QLoRA (``benchmarks/gpu_check.py``'s ``recorded_step_cost``, with
``recorded_step_figures`` from here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from memfit.args import ProfileArgs  # noqa: E402  (after the path)
from memfit.training.precision import cpu_description  # noqa: E402

TINY_LLAMA = "TinyLlama-1.1B-intermediate-step-1431k-3T"


def recorded_step_figures(tokens_per_s_by_step: dict[int, float], tokens_per_step: int, recorded: int) -> dict:
    """The recorded step's seconds, the median of the steps after it, and the difference, from a run's per-step
    tokens/s (every step the same tokens)."""
    seconds = {step: tokens_per_step / rate for step, rate in tokens_per_s_by_step.items()}
    steady = statistics.median(v for step, v in seconds.items() if step > recorded)
    return {
        "recorded_step_seconds": round(seconds[recorded], 3),
        "steady_step_seconds_median": round(steady, 3),
        "recorded_step_extra_seconds": round(seconds[recorded] - steady, 3),
        "seconds_by_step": {step: round(v, 3) for step, v in sorted(seconds.items())},
    }


def tokens_per_s_by_step(metrics_csv: Path) -> dict[int, float]:
    """The run's own per-step tokens/s, by step (``metrics.csv`` of ``--logger_name csv``)."""
    import csv

    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("tokens_per_s")]
    return {int(r["step"]): float(r["tokens_per_s"]) for r in rows}


def one_run(command: list[str], work: Path) -> dict:
    """Wall and CPU seconds of one run (a fresh process), and its per-step tokens/s."""
    work.mkdir(parents=True)
    started = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"error: the run failed:\n{stderr[-3000:]}")
    (metrics,) = work.glob("out/profiles/*/metrics.csv")
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "tokens_per_s_by_step": tokens_per_s_by_step(metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/recorded_step_cost_1.1b.json")
    parser.add_argument("--checkpoints", type=Path, default=Path(tempfile.gettempdir()) / "memfit-checkpoints")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="profiled/unprofiled pairs, alternated")
    args = parser.parse_args()
    recorded = ProfileArgs.default_recorded_step(args.steps)
    if args.steps < recorded + 2:
        raise SystemExit(
            f"error: --steps {args.steps} leaves fewer than 2 steps after the recorded one: give 6 or more"
        )

    from estimate_accuracy import fixed_length_records

    from memfit.training.random_checkpoints import random_checkpoint

    checkpoint = random_checkpoint(TINY_LLAMA, args.checkpoints)
    work = Path(tempfile.mkdtemp(prefix="recorded-step-cost-"))
    samples = work / "samples.json"
    samples.write_text(json.dumps(fixed_length_records(64, 2 * args.length)))
    base = [
        sys.executable,
        str(ROOT / "finetune/lora.py"),
        "--checkpoint_dir",
        str(checkpoint),
        "--accelerator",
        "cpu",
        "--precision",
        "32-true",
        "--data",
        "JSON",
        "--data.json_path",
        str(samples),
        "--data.mask_prompt",
        "false",
        "--data.val_split_fraction",
        "0.05",
        "--train.micro_batch_size",
        "1",
        "--train.global_batch_size",
        "1",
        "--train.max_seq_length",
        str(args.length),
        "--train.max_steps",
        str(args.steps),
        "--eval.interval",
        "1000",
        "--eval.final_validation",
        "false",
        "--logger_name",
        "csv",
    ]
    pairs = []
    for repeat in range(args.repeats):
        pair = {}
        for name, flags in (("profiled", []), ("unprofiled", ["--profile.enabled", "false"])):
            run = one_run(base + flags, work / f"{repeat}-{name}")
            run.update(recorded_step_figures(run.pop("tokens_per_s_by_step"), args.length, recorded))
            pair[name] = run
            print(name, json.dumps(run), flush=True)
        pair["recorded_step_extra_seconds_beyond_the_control"] = round(
            pair["profiled"]["recorded_step_extra_seconds"] - pair["unprofiled"]["recorded_step_extra_seconds"], 3
        )
        pair["process_extra_wall_s"] = round(pair["profiled"]["wall_s"] - pair["unprofiled"]["wall_s"], 2)
        pair["process_extra_cpu_s"] = round(pair["profiled"]["cpu_s"] - pair["unprofiled"]["cpu_s"], 2)
        pairs.append(pair)
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    document = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": f"{platform.machine()}, {os.cpu_count()} cores, {cpu_description()}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join(["python", "benchmarks/recorded_step_cost.py", *sys.argv[1:]]),
        "commit": commit.stdout.strip() or "unknown",
        "measures": (
            f"LoRA on {TINY_LLAMA}'s architecture (random weights), 32-true on the CPU, micro-batch 1 x {args.length}"
            f" tokens, {args.steps} steps; a step's seconds are its tokens over the run's own per-step tokens/s; the"
            f" recorded step is step {recorded}; 'steady' is the median of the steps after it in the same run;"
            " the process's wall and CPU seconds (wait4) include loading, the ledger and the pictures"
        ),
        "recorded_step": recorded,
        "pairs": pairs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
