"""Memfit's fine-tuning scripts against litgpt's on the same work, alternated in one run.

    python benchmarks/compare_litgpt.py --repeats 2 --out profiles/cpu/compare_litgpt.json
    python benchmarks/compare_litgpt.py --device cuda --repeats 1 --out profiles/gpu/compare_litgpt.json

One litgpt checkpoint dir (the embedded tiny Llama) and one dataset, whose every sample is truncated to the same
length by both tools (so both train the same number of tokens per step), are shared. For each configuration
(precision, quantize) the two commands run one after the other, ``repeats`` times, each in a fresh process with the
same model, data, LoRA settings, batch sizes, sequence length and steps; validation and checkpoints are out of the
way. Figures per run: tokens/s over the training loop (the tool's own training time: Memfit's ``summary.json``,
litgpt's performance report), the process's peak RSS (``wait4``'s ``ru_maxrss``: the CPU figure; on CUDA
``max_memory_allocated`` would be the one) and wall time. The report gives the medians and Memfit/litgpt ratios with
their spread over the repeats. A third side, Memfit with ``--profile.enabled false`` (no profiler window, ledger
or picture), shows what that instrumentation costs. litgpt's CLI needs ``requests``: ``pip install -e '.[bench]'``.

With ``--device cuda`` the configurations are issue 10's GPU set: the Llama-2-7B architecture with random weights
(LoRA, bf16-true, nf4 and nf4-dq, micro-batch 1 and 4, 512 and 2048 tokens) and a full fine-tune of the 1.1B TinyLlama
architecture (``finetune/full.py`` against ``litgpt finetune_full``). Every process, Memfit's and litgpt's, reports its
CUDA ``max_memory_allocated`` and ``max_memory_reserved`` at exit through the same hook (``benchmarks/cuda_peaks``),
so neither tool's own report is trusted. Beside each measurement the analytic floor (``benchmarks/floor.py``) is
printed: the memory no implementation can go below, and the tokens/s none can exceed at the card's measured matmul rate.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memfit.training.embedded import TINY_LLAMA  # noqa: E402  (after the path)

# The embedded tiny Llama's 1,024-token vocabulary makes its logits a small part of a step. Real models' are not
# (Llama 2: 32,000): the same tiny Llama with Llama 2's vocabulary, random weights, where the loss's memory shows.
TINY_LLAMA_32K = "tiny-llama-32k"
_SHAPE = ("block_size", "n_layer", "n_head", "n_query_groups", "n_embd", "intermediate_size")
ARCHITECTURES = {TINY_LLAMA_32K: ("Llama-2-7b-hf", {"name": TINY_LLAMA_32K, **{k: TINY_LLAMA[k] for k in _SHAPE}})}
"""Architectures made here: a litgpt config name and what changes in it"""
# (method, architecture, precision, quantize, micro_batch_size, length); None: the embedded tiny Llama
CPU_CONFIGS = [
    *[
        ("lora", None, precision, quantize, 4, 256)
        for precision in ("32-true", "bf16-true")
        for quantize in (None, "bnb.nf4")
    ],
    *[("lora", TINY_LLAMA_32K, precision, None, 4, 256) for precision in ("32-true", "bf16-true")],
]
GPU_CONFIGS = [
    *[
        ("lora", "Llama-2-7b-hf", "bf16-true", quantize, micro, length)
        for quantize in ("bnb.nf4", "bnb.nf4-dq")
        for micro in (1, 4)
        for length in (512, 2048)
    ],
    ("full", "TinyLlama-1.1B-intermediate-step-1431k-3T", "bf16-true", None, 4, 1024),
]
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_query": True, "lora_value": True}


def dataset(path: Path, records: int, words_per_record: int = 600) -> Path:
    """Instruction records longer than any --train.max_seq_length used here (a word is at least one token): both
    tools truncate each to it."""
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches".split()
    data = [
        {
            "instruction": f"Repeat the words, round {i}.",
            "input": "",
            "output": " ".join(words[(i + k) % len(words)] for k in range(words_per_record)),
        }
        for i in range(records)
    ]
    path.write_text(json.dumps(data))
    return path


def describe_cpu() -> str:
    """memfit.training.precision.cpu_description, asked of a child process: importing it here (torch) would raise this
    driver's RSS above the tools' own peaks, which their ru_maxrss cannot then go below (``run``)."""
    return subprocess.run(
        [sys.executable, "-c", "from memfit.training.precision import cpu_description; print(cpu_description())"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


class Failed(Exception):
    """A tool refused or failed the configuration; the message is its last line."""


def run(command: list[str], cwd: Path, cuda: bool, timeout: float = 1800) -> tuple[str, float, dict]:
    """(stdout + stderr, wall seconds, peak memory) of one process: its RSS (``ru_maxrss``), and on CUDA its
    allocator's peaks as the exit hook wrote them."""
    cwd.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cuda:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks/cuda_peaks"), env.get("PYTHONPATH")]))
        env["MEMFIT_BENCH_CUDA_PEAKS"] = str(cwd / "cuda_peaks.json")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # one run past the limit is stopped and reported as failed, so one configuration cannot use up a GPU session
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    try:
        output = process.stdout.read()
        _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage, not every child's
    finally:
        watchdog.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if process.returncode and wall >= timeout:
        raise Failed(f"stopped after {timeout:.0f} s")
    if process.returncode:
        raise Failed(([line for line in output.splitlines() if line.strip()] or ["(no output)"])[-1])
    peaks = {"peak_rss_bytes": usage.ru_maxrss * 1024}
    # A child's ru_maxrss starts at the RSS of the process that started it (Linux keeps the high-water mark across
    # exec): a figure not above this driver's own peak measured the driver, not the tool.
    if peaks["peak_rss_bytes"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024:
        raise Failed("peak RSS not measurable: the benchmark's own process holds more than the tool's peak")
    if cuda:
        peaks |= json.loads((cwd / "cuda_peaks.json").read_text())
    return output, wall, peaks


def commands(
    tool: str,
    method: str,
    checkpoint: Path,
    data: Path,
    precision: str,
    quantize: str | None,
    micro_batch_size: int,
    length: int,
    args,
) -> list[str]:
    shared = [
        "--data",
        "JSON",
        "--data.json_path",
        str(data),
        "--data.val_split_fraction",
        "0.05",
        "--data.mask_prompt",
        "false",
        "--precision",
        precision,
        "--train.micro_batch_size",
        str(micro_batch_size),
        "--train.global_batch_size",
        str(micro_batch_size * args.accumulation),
        "--train.max_seq_length",
        str(length),
        "--train.max_steps",
        str(args.steps),
        "--train.lr_warmup_steps",
        "2",
        "--train.log_interval",
        "1",
        "--eval.interval",
        "100000",
        "--eval.final_validation",
        "false",
        "--logger_name",
        "csv",
        "--seed",
        "1337",
        *(["--quantize", quantize] if quantize else []),
        *([item for k, v in LORA.items() for item in (f"--{k}", str(v).lower())] if method == "lora" else []),
    ]
    if tool.startswith("memfit"):
        return [
            sys.executable,
            str(ROOT / f"finetune/{method}.py"),
            "--checkpoint_dir",
            str(checkpoint),
            *shared,
            "--train.save_interval",
            "100000",
            "--train.lr",
            "3e-4",
            "--out_dir",
            "out",
            *(["--profile.enabled", "false"] if tool == "memfit_unprofiled" else []),
        ]
    litgpt = shutil.which("litgpt") or "litgpt"
    return [
        litgpt,
        f"finetune_{method}",
        str(checkpoint),
        *shared,
        "--train.save_interval",
        "100000",
        "--optimizer",
        # the same optimizer settings as Memfit's run: torch's AdamW would otherwise decay weights by 0.01
        json.dumps({"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-4, "weight_decay": 0.0}}),
        "--out_dir",
        "out",
        "--eval.initial_validation",
        "false",
    ]


def floors(
    method: str,
    architecture: str,
    precision: str,
    quantize: str | None,
    micro_batch_size: int,
    length: int,
    matmul_flops: float,
) -> dict:
    """The analytic floor of a GPU configuration (benchmarks/floor.py): memory, and the fastest tokens/s."""
    import torch
    from floor import flops_per_token, matmul_parameters, memory_floor

    if method == "lora":
        from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    else:
        from litgpt import GPT, Config
    config = Config.from_name(architecture, **(LORA if method == "lora" else {}))
    with torch.device("meta"):
        model = GPT(config)
    if method == "lora":
        mark_only_lora_as_trainable(model)
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    floor = memory_floor(model, quantize, dtype, micro_batch_size * length, config.n_layer, config.n_embd)
    per_token = flops_per_token(matmul_parameters(model), full=method == "full")
    return {
        "memory_bytes": floor.total,
        "weights_bytes": floor.weights,
        "trainable_state_bytes": floor.trainable_state,
        "activations_bytes": floor.activations,
        "flops_per_token": per_token,
        "matmul_flops_per_s": matmul_flops,
        "tokens_per_s": matmul_flops / per_token,
    }


def training_seconds(tool: str, output: str, cwd: Path) -> float:
    if tool.startswith("memfit"):
        (summary,) = (cwd / "out" / "profiles").glob("*/summary.json")
        summary = json.loads(summary.read_text())
        return summary["train_seconds"]
    match = re.search(r"Training [Tt]ime\D*([0-9.]+)\s*s", output)
    if match is None:
        raise SystemExit(f"error: no training time in litgpt's output:\n{output[-2000:]}")
    return float(match.group(1))


def steady_tokens_per_s(tool: str, cwd: Path, tokens_per_step: int, accumulation: int, warmup_steps: int) -> float:
    """Tokens/s over the optimizer steps after the first ``warmup_steps``, from each tool's own per-step log, each
    step's time without the tool's logging: Memfit's per-step tokens/s (a step's time is its tokens over it);
    litgpt's per-micro-batch ``iter_time``, with its tokens from the cumulative count it logs."""
    import csv

    if tool.startswith("memfit"):
        (log,) = (cwd / "out" / "profiles").glob("*/metrics.csv")
        rates = [
            float(r["tokens_per_s"])
            for r in csv.DictReader(log.open())
            if r.get("tokens_per_s") and int(r["step"]) > warmup_steps
        ]
        return tokens_per_step * len(rates) / sum(tokens_per_step / rate for rate in rates)
    (log,) = (cwd / "out").rglob("metrics.csv")
    rows = sorted(
        (int(r["iter"]), float(r["iter_time"]), int(float(r["tokens"])))
        for r in csv.DictReader(log.open())
        if r.get("iter_time")
    )
    tokens = [count - previous for (_, _, count), (_, _, previous) in zip(rows, [(0, 0.0, 0), *rows])]
    steady = [(seconds, n) for (i, seconds, _), n in zip(rows, tokens) if (i - 1) // accumulation + 1 > warmup_steps]
    return sum(n for _, n in steady) / sum(seconds for seconds, _ in steady)


def main() -> None:
    from memfit.training.embedded import ensure_embedded
    from memfit.training.random_checkpoints import random_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument(
        "--warmup_steps",
        type=int,
        default=5,
        help="optimizer steps left out of the steady tokens/s (Memfit's profiler window is in them)",
    )
    parser.add_argument("--records", type=int, default=400)
    parser.add_argument("--only", nargs="*", type=int, help="indices of the configurations to run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each tool's process may run")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=None,
        help="where random-weight checkpoints are made, and reused by later benchmarks (default: the"
        " run's temporary dir)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    configs = GPU_CONFIGS if cuda else CPU_CONFIGS
    out = args.out or ROOT / f"profiles/{'gpu' if cuda else 'cpu'}/compare_litgpt.json"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            sys.exit("error: --device cuda: no CUDA GPU is visible")
        from floor import measured_matmul_flops

        matmul_flops = measured_matmul_flops(torch.device("cuda"))
        device = torch.cuda.get_device_name(0)
    else:
        device = describe_cpu()

    work = Path(tempfile.mkdtemp(prefix="memfit-vs-litgpt-"))
    data = dataset(work / "data.json", args.records, words_per_record=2 * max(c[5] for c in configs))
    results = []
    report = {
        "what": "Memfit's fine-tuning scripts vs litgpt's, same model/data/settings, alternated",
        "device": device,
        "measures": (
            "tokens/s over each tool's own training time, and steady_tokens_per_s over the steps after"
            " --warmup_steps from each tool's per-step log; CUDA max_memory_allocated and max_memory_reserved"
            " read at each process's exit by the same hook, and its peak RSS (wait4 ru_maxrss)"
            if cuda
            else "tokens/s over each tool's own training time, and steady_tokens_per_s over the steps after"
            " --warmup_steps from each tool's per-step log; peak RSS of the process (wait4 ru_maxrss)"
        ),
        "versions": {
            "python": platform.python_version(),
            **{m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt", "bitsandbytes")},
        },
        "command": "python benchmarks/compare_litgpt.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {
            "steps": args.steps,
            "accumulation": args.accumulation,
            "repeats": args.repeats,
            "warmup_steps": args.warmup_steps,
            "lora": LORA,
            "optimizer": "AdamW, lr 3e-4 after 2 warm-up steps, weight decay 0, torch's betas and eps, on both sides;"
            " the kernel differs: Memfit's is fused where torch has one (CUDA, and CPU in recent torch), litgpt's"
            " torch's default (foreach on CUDA, for-loop on CPU)",
            "scopes": "tokens_per_s: each tool's own training time (its loop, validation off); steady_tokens_per_s:"
            " the per-step logs after --warmup_steps (Memfit's recorded step is among those); wall_s: the whole"
            " process, start to exit, as a user waits for it",
            "machine_load": "load_1min_before: the machine's 1-minute load average as each run started",
            "model_weights": "random (a real architecture) or the embedded tiny Llama",
        },
        "results": results,  # filled as the configurations run
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    for index, (method, architecture, precision, quantize, micro, length) in enumerate(configs):
        if args.only and index not in args.only:
            continue
        if architecture is None:
            checkpoint, _ = ensure_embedded()
        else:
            name, changes = ARCHITECTURES.get(architecture, (architecture, {}))
            checkpoint = random_checkpoint(name, args.checkpoints or work, **changes)
        tokens = args.steps * micro * args.accumulation * length
        runs = {"memfit": [], "litgpt": [], "memfit_unprofiled": []}
        refused = {}
        for repeat in range(args.repeats):
            for tool in runs:  # alternated, so drift in the machine's speed hits every side
                if tool in refused:
                    continue
                cwd = work / f"{index}-{tool}-{repeat}"
                command = commands(tool, method, checkpoint, data, precision, quantize, micro, length, args)
                load = os.getloadavg()[0]  # other work on the machine shows here, run by run
                try:
                    output, wall, peaks = run(command, cwd, cuda, args.timeout)
                except Failed as error:
                    refused[tool] = str(error)
                    print(index, tool, "failed:", error, flush=True)
                    continue
                seconds = training_seconds(tool, output, cwd)
                steady = steady_tokens_per_s(
                    tool, cwd, micro * args.accumulation * length, args.accumulation, args.warmup_steps
                )
                runs[tool].append(
                    {
                        "tokens_per_s": tokens / seconds,
                        "steady_tokens_per_s": steady,
                        "training_s": seconds,
                        "wall_s": wall,
                        "load_1min_before": load,
                        **peaks,
                    }
                )
                print(index, method, precision, quantize, micro, length, tool, repeat, runs[tool][-1], flush=True)
        median = {
            tool: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for tool, rs in runs.items() if rs
        }
        result = {
            "method": method,
            "architecture": architecture or "embedded tiny Llama",
            "precision": precision,
            "quantize": quantize,
            "micro_batch_size": micro,
            "sequence_length": length,
            "tokens_per_run": tokens,
            "runs": runs,
            "median": median,
            "failed": refused,
        }
        memory_key = "max_allocated_bytes" if cuda else "peak_rss_bytes"
        if runs["memfit"] and runs["litgpt"]:
            for name, key in (
                ("tokens_per_s_ratio", "tokens_per_s"),
                ("steady_tokens_per_s_ratio", "steady_tokens_per_s"),
                ("wall_s_ratio", "wall_s"),
                ("peak_memory_ratio", memory_key),
            ):
                ratios = [m[key] / theirs[key] for m, theirs in zip(runs["memfit"], runs["litgpt"])]
                result[name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            print(
                f"{index}: tokens/s x{result['tokens_per_s_ratio']['median']:.2f} (after step {args.warmup_steps}:"
                f" x{result['steady_tokens_per_s_ratio']['median']:.2f}), peak memory"
                f" x{result['peak_memory_ratio']['median']:.2f} (Memfit/litgpt, {memory_key})",
                flush=True,
            )
        if cuda:
            floor = floors(method, architecture, precision, quantize, micro, length, matmul_flops)
            result["floor"] = floor
            if "memfit" in median:
                result["measured_over_floor"] = {
                    "memory": median["memfit"]["max_allocated_bytes"] / floor["memory_bytes"],
                    "tokens_per_s": median["memfit"]["tokens_per_s"] / floor["tokens_per_s"],
                }
                print(
                    f"{index}: floor {floor['memory_bytes'] / 2**30:.2f} GiB, {floor['tokens_per_s']:,.0f} tokens/s;"
                    f" measured/floor: memory x{result['measured_over_floor']['memory']:.2f}, tokens/s"
                    f" x{result['measured_over_floor']['tokens_per_s']:.2f}",
                    flush=True,
                )
        results.append(result)
        # written after each configuration, so a run stopped part-way keeps what it measured
        out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
