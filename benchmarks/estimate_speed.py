"""How long ``--estimate`` and the ``--memory_budget`` planner take, as a user runs them (a whole process each), and how
much of that is importing torch, Lightning and litgpt, which every script does before it can estimate anything.

    python benchmarks/estimate_speed.py --out profiles/cpu/estimate_speed.json

Wall-clock and CPU seconds (user + system), the median of ``--repeats`` runs, in this order each time: the imports
alone, the 7B QLoRA estimate, the planner and reverse answers for 8B QLoRA at 8,192 tokens on a 4090, the planner for
a full fine-tune of the 1.1B architecture. Nothing is downloaded: the estimates read the
architecture from litgpt's config by name.
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

COMMANDS = {
    "imports": ["-c", "import torch, lightning, litgpt, litgpt.lora"],
    "estimate_7b_qlora": [
        str(ROOT / "finetune/lora.py"),
        "--model_name",
        "Llama-2-7b-hf",
        "--quantize",
        "bnb.nf4",
        "--estimate",
        "true",
    ],
    "fill_the_card_8b_qlora_4090": [
        str(ROOT / "finetune/lora.py"),
        "--model_name",
        "Meta-Llama-3.1-8B",
        "--quantize",
        "bnb.nf4",
        "--train.max_seq_length",
        "8192",
        "--estimate",
        "true",
        "--memory_budget",
        "4090",
    ],
    "planner_1.1b_full": [
        str(ROOT / "finetune/full.py"),
        "--model_name",
        "TinyLlama-1.1B-intermediate-step-1431k-3T",
        "--train.max_seq_length",
        "512",
        "--estimate",
        "true",
        "--memory_budget",
        "12GiB",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/estimate_speed.json")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    seconds = {name: [] for name in COMMANDS}
    cpu_seconds = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.repeats):
            for name, command in COMMANDS.items():
                started = time.perf_counter()
                process = subprocess.Popen(
                    [sys.executable, *command], cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                )
                stderr = process.stderr.read()
                _, status, usage = os.wait4(process.pid, 0)  # the process's own CPU time: user + system
                seconds[name].append(time.perf_counter() - started)
                cpu_seconds[name].append(usage.ru_utime + usage.ru_stime)
                if os.waitstatus_to_exitcode(status):
                    sys.exit(f"error: {name} failed:\n{stderr[-2000:]}")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    report = {
        "what": "wall-clock seconds of whole processes (median of the repeats), and their CPU seconds (user + system,"
        " wait4); 'after imports' subtracts the imports' median wall seconds",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
        "versions": {"python": platform.python_version(), "torch": __import__("torch").__version__},
        "commands": {
            name: "python " + " ".join(c.replace(str(ROOT) + "/", "") for c in command)
            for name, command in COMMANDS.items()
        },
        "seconds": seconds,
        "median_seconds": medians,
        "cpu_seconds": cpu_seconds,
        "median_cpu_seconds": {name: statistics.median(values) for name, values in cpu_seconds.items()},
        "median_seconds_after_imports": {
            name: medians[name] - medians["imports"] for name in COMMANDS if name != "imports"
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"median_seconds": medians, "after_imports": report["median_seconds_after_imports"]}, indent=1))


if __name__ == "__main__":
    main()
