"""The reverse answers (``--estimate true --memory_budget CARD``) for three models people fine-tune on the 24, 40 and
80 GB cards: the longest sequence, the largest micro-batch, the fewest GPUs (FSDP) and the first plan listed, each from
the estimate, with the CPU time each whole process took on this machine.

    python benchmarks/fill_the_card.py --out profiles/cpu/fill_the_card.json

Every figure is a prediction of ``max_memory_allocated`` with 10% kept for the allocator's reserve, not a
measurement; nothing is downloaded (the architectures are litgpt's, by name).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CARDS = ("4090", "A100-40GB", "H100")
SETTINGS = {
    "Llama-3.1-8B QLoRA": [
        "finetune/lora.py",
        *("--model_name", "Meta-Llama-3.1-8B", "--quantize", "bnb.nf4", "--precision", "bf16-true"),
        *("--train.max_seq_length", "2048", "--train.micro_batch_size", "1", "--train.global_batch_size", "16"),
    ],
    "Llama-2-7B LoRA": [
        "finetune/lora.py",
        *("--model_name", "Llama-2-7b-hf", "--precision", "bf16-true"),
        *("--train.max_seq_length", "2048", "--train.micro_batch_size", "1", "--train.global_batch_size", "16"),
    ],
    "Llama-3-8B full, FSDP x8": [
        "finetune/full.py",
        *("--model_name", "Meta-Llama-3-8B", "--precision", "bf16-true", "--strategy", "fsdp", "--devices", "8"),
        *("--train.max_seq_length", "2048", "--train.micro_batch_size", "1", "--train.global_batch_size", "64"),
    ],
}


def answers(stdout: str) -> dict:
    """The reverse answers' lines and the first row, as printed."""
    lines = stdout.splitlines()
    found = {"rows": [line.strip() for line in lines if line.startswith("  x")][:3]}
    for line in lines:
        for name in ("these settings", "the first plan listed"):
            if line.startswith(f"  {name}"):
                found[name] = line.strip()
    return found


def _answer(line: str, flag: str) -> str:
    """``flag``'s answer in a reverse-answers line, as the table gives it: the value and its peak ("2827 (21.35 GiB)"),
    or "not even 1 fits (50.01 GiB)"; "-" where the line has none."""
    if flag + " " not in line and flag + ":" not in line:
        return "-"
    after = line.split(flag, 1)[1].lstrip(": ")
    return after.split(")")[0].split(";")[0] + ")"


def table(record: dict) -> str:
    """docs/memory.md's table of these answers, from a record this benchmark wrote (tests/test_estimate.py checks the
    page against the committed record)."""
    lines = [
        "| settings | card | longest sequence | largest micro-batch | fewest GPUs | first plan listed | CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in record["results"]:
        given = row["these settings"]
        longest, micro, devices = (
            _answer(given, flag) for flag in ("--train.max_seq_length", "--train.micro_batch_size", "--devices")
        )
        first = row["rows"][0].split("  [")[0].split(None, 1)
        fastest = f"{first[0]}, {first[1].strip().replace('  ', ': ', 1)}"
        cells = [row["settings"], row["card"], longest, micro, devices, fastest, f"{row['cpu_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/fill_the_card.json")
    parser.add_argument("--table", action="store_true", help="print docs/memory.md's table from --out, run nothing")
    parser.add_argument(
        "--settings",
        nargs="*",
        choices=list(SETTINGS),
        default=None,
        help="only these settings, each card's row replacing its row in --out where --out has one",
    )
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    kept = json.loads(args.out.read_text())["results"] if args.settings is not None and args.out.is_file() else []
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name, (script, *flags) in SETTINGS.items():
            if args.settings is not None and name not in args.settings:
                continue
            for card in CARDS:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, str(ROOT / script), *flags, "--estimate", "true", "--memory_budget", card],
                    cwd=work,
                    capture_output=True,
                    text=True,
                )
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                row = {
                    "settings": name,
                    "card": card,
                    "command": f"python {script} {' '.join(flags)} --estimate true --memory_budget {card}",
                    "returncode": done.returncode,
                    "wall_s": round(time.perf_counter() - started, 1),
                    "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
                    **answers(done.stdout),
                }
                if done.returncode:
                    row["stderr_tail"] = done.stderr[-1500:]
                results.append(row)
                print(json.dumps(row), flush=True)
                # every row written as it ends: a cut run keeps what it measured; rows run now replace their own
                fresh = {(r["settings"], r["card"]): r for r in results}
                merged = [fresh.pop((r["settings"], r["card"]), r) for r in kept] + list(fresh.values())
                args.out.write_text(
                    json.dumps(
                        {
                            "measures": "predicted peaks (the estimate), CPU seconds of each whole process",
                            "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
                            "results": merged,
                        },
                        indent=1,
                    )
                )


if __name__ == "__main__":
    main()
