"""Memfit's finetune/lora.py against `litgpt finetune_lora` on the same work, alternated in one run.

    python benchmarks/compare_litgpt.py --repeats 2 --out profiles/cpu/compare_litgpt.json

One litgpt checkpoint dir (the embedded tiny Llama) and one dataset, whose every sample is truncated to the same
length by both tools (so both train the same number of tokens per step), are shared. For each configuration
(precision, quantize) the two commands run one after the other, ``repeats`` times, each in a fresh process with the
same model, data, LoRA settings, batch sizes, sequence length and steps; validation and checkpoints are out of the
way. Figures per run: tokens/s over the training loop (the tool's own training time: Memfit's ``summary.json``,
litgpt's performance report), the process's peak RSS (``wait4``'s ``ru_maxrss``: the CPU figure; on CUDA
``max_memory_allocated`` would be the one) and wall time. The report gives the medians and Memfit/litgpt ratios with
their spread over the repeats. A third side, Memfit with ``--profile.enabled false`` (no profiler window, ledger
or picture), shows what that instrumentation costs. litgpt's CLI needs ``requests``: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [("32-true", None), ("32-true", "bnb.nf4"), ("bf16-true", None), ("bf16-true", "bnb.nf4")]


def dataset(path: Path, records: int) -> Path:
    """Instruction records longer than any --train.max_seq_length used here: both tools truncate each to it."""
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches".split()
    data = [{"instruction": f"Repeat the words, round {i}.", "input": "",
             "output": " ".join(words[(i + k) % len(words)] for k in range(600))} for i in range(records)]
    path.write_text(json.dumps(data))
    return path


class Failed(Exception):
    """A tool refused or failed the configuration; the message is its last line."""


def run(command: list[str], cwd: Path) -> tuple[str, float, int]:
    """(stdout + stderr, wall seconds, peak RSS bytes) of one process."""
    cwd.mkdir(parents=True)
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage, not every child's
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if process.returncode:
        raise Failed(([line for line in output.splitlines() if line.strip()] or ["(no output)"])[-1])
    return output, wall, usage.ru_maxrss * 1024


def commands(tool: str, checkpoint: Path, data: Path, precision: str, quantize: str | None, args) -> list[str]:
    shared = [
        "--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0.05", "--data.mask_prompt",
        "false", "--precision", precision, "--train.micro_batch_size", str(args.micro_batch_size),
        "--train.global_batch_size", str(args.global_batch_size), "--train.max_seq_length", str(args.length),
        "--train.max_steps", str(args.steps), "--train.lr_warmup_steps", "2", "--train.log_interval", "1",
        "--eval.interval", "100000", "--eval.final_validation", "false", "--lora_r", "8", "--lora_alpha", "16",
        "--lora_dropout", "0.05", "--lora_query", "true", "--lora_value", "true", "--logger_name", "csv",
        "--seed", "1337", *(["--quantize", quantize] if quantize else []),
    ]
    if tool.startswith("memfit"):
        return [sys.executable, str(ROOT / "finetune/lora.py"), "--checkpoint_dir", str(checkpoint), *shared,
                "--train.save_interval", "100000", "--train.lr", "3e-4", "--out_dir", "out",
                *(["--profile.enabled", "false"] if tool == "memfit_unprofiled" else [])]
    litgpt = shutil.which("litgpt") or "litgpt"
    return [litgpt, "finetune_lora", str(checkpoint), *shared, "--train.save_interval", "100000",
            "--optimizer", json.dumps({"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-4}}), "--out_dir", "out",
            "--eval.initial_validation", "false"]


def training_seconds(tool: str, output: str, cwd: Path) -> float:
    if tool.startswith("memfit"):
        (summary,) = (cwd / "profiles").glob("*/summary.json")
        summary = json.loads(summary.read_text())
        return summary["train_seconds"]
    match = re.search(r"Training [Tt]ime\D*([0-9.]+)\s*s", output)
    if match is None:
        raise SystemExit(f"error: no training time in litgpt's output:\n{output[-2000:]}")
    return float(match.group(1))


def main() -> None:
    from memfit.embedded import ensure_embedded

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/compare_litgpt.json")
    args = parser.parse_args()

    checkpoint, _ = ensure_embedded()
    work = Path(tempfile.mkdtemp(prefix="memfit-vs-litgpt-"))
    data = dataset(work / "data.json", args.records)
    tokens = args.steps * args.global_batch_size * args.length
    results = []
    for precision, quantize in CONFIGS:
        runs = {"memfit": [], "litgpt": [], "memfit_unprofiled": []}
        refused = {}
        for repeat in range(args.repeats):
            for tool in runs:  # alternated, so drift in the machine's speed hits every side
                if tool in refused:
                    continue
                cwd = work / f"{precision}-{quantize}-{tool}-{repeat}"
                try:
                    output, wall, rss = run(commands(tool, checkpoint, data, precision, quantize, args), cwd)
                except Failed as error:
                    refused[tool] = str(error)
                    print(precision, quantize, tool, "failed:", error, flush=True)
                    continue
                seconds = training_seconds(tool, output, cwd)
                runs[tool].append({"tokens_per_s": tokens / seconds, "training_s": seconds, "wall_s": wall,
                                   "peak_rss_bytes": rss})
                print(precision, quantize, tool, repeat, runs[tool][-1], flush=True)
        median = {tool: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for tool, rs in runs.items() if rs}
        result = {"precision": precision, "quantize": quantize, "runs": runs, "median": median, "failed": refused}
        if runs["memfit"] and runs["litgpt"]:
            speed = [m["tokens_per_s"] / l["tokens_per_s"] for m, l in zip(runs["memfit"], runs["litgpt"])]
            memory = [m["peak_rss_bytes"] / l["peak_rss_bytes"] for m, l in zip(runs["memfit"], runs["litgpt"])]
            result["tokens_per_s_ratio"] = {"median": statistics.median(speed), "min": min(speed), "max": max(speed)}
            result["peak_rss_ratio"] = {"median": statistics.median(memory), "min": min(memory), "max": max(memory)}
            print(f"{precision} {quantize}: tokens/s x{result['tokens_per_s_ratio']['median']:.2f}, peak RSS"
                  f" x{result['peak_rss_ratio']['median']:.2f} (Memfit/litgpt)", flush=True)
        results.append(result)
    report = {
        "what": "Memfit finetune/lora.py vs litgpt finetune_lora, same model/data/settings, alternated",
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "measures": "tokens/s over each tool's own training time; peak RSS of the process (wait4 ru_maxrss)",
        "versions": {"python": platform.python_version(),
                     **{m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt", "bitsandbytes")}},
        "command": "python benchmarks/compare_litgpt.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {"model": "embedded tiny Llama (Memfit's default)", "steps": args.steps,
                     "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
                     "sequence_length": args.length, "tokens_per_run": tokens, "repeats": args.repeats},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
