"""``--compile true`` against eager, both in one run, for every recipe on the embedded default:

    python benchmarks/compile.py --out profiles/cpu/compile.json
    python benchmarks/compile.py --model pythia-14m --out profiles/cpu/compile_pythia14m.json

``--model``: a real architecture instead of the embedded default, with random weights (a larger CPU-sized model:
pythia-14m's 6 blocks and 50k-token vocabulary), fine-tuned on the embedded instructions and pretrained on the
embedded text.

Each recipe trains ``--train.max_steps`` steps twice, eager then compiled, each a whole process, on the CPU. Per run:
the tokens/s of each step after the first two (the median: the first compiles, the second may compile again for a new
length), the first step's seconds (``compile_seconds``: compilation included), the ledger's measured peak of the
recorded step (CPU tensor memory from the profiler's events) and how many times dynamo compiled the blocks' forward
(its recompilations, from ``TORCH_LOGS=recompiles``). Beside them, the step's estimate eager and compiled
(``--estimate true --compile true``), each the largest of the step's phases in its ``estimate.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = (
    ("finetune/lora.py",),
    ("finetune/lora.py", "--quantize", "bnb.nf4"),  # QLoRA: bitsandbytes' 4-bit layers inside the compiled blocks
    ("finetune/adapter.py",),
    ("finetune/adapter_v2.py",),
    ("finetune/full.py",),
    ("pretrain/pretrain.py",),
)
"""Each a script and the flags it runs with"""


def _name(recipe: tuple) -> str:
    return "-".join([Path(recipe[0]).stem, *(flag.strip("-").replace(".", "") for flag in recipe[1::2])])


def with_model(recipe: tuple, model: str | None, work: Path) -> tuple:
    """``recipe`` on ``model``'s architecture: a checkpoint of random weights for fine-tuning (written once into
    ``work``), the architecture by name for pretraining; the recipe itself where ``model`` is None."""
    if model is None:
        return recipe
    script, *flags = recipe
    if script.startswith("pretrain"):
        return (script, *flags, "--model_name", model)
    from memfit.training.embedded import ensure_embedded
    from memfit.training.random_checkpoints import write_random_checkpoint

    checkpoint = work / model
    if not (checkpoint / "lit_model.pth").is_file():
        import torch

        write_random_checkpoint(model, checkpoint, dtype=torch.float32)
    data = ("--data", "JSON", "--data.json_path", str(ensure_embedded()[1]), "--data.val_split_fraction", "0.1")
    return (script, *flags, "--checkpoint_dir", str(checkpoint), *data)


def run(recipe: tuple, compiled: bool, steps: int, work: Path, name: str, accelerator: str) -> dict:
    script, *flags = recipe
    out = work / f"{name}-{'compiled' if compiled else 'eager'}"
    command = [
        sys.executable,
        str(ROOT / script),
        *flags,
        *("--accelerator", accelerator),
        *("--compile", str(compiled).lower(), "--train.max_steps", str(steps), "--train.log_interval", "1"),
        *("--logger_name", "csv", "--out_dir", str(out / "out"), "--profile_dir", str(out / "profiles")),
    ]
    env = {**os.environ, "TORCH_LOGS": "recompiles"}
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        return {"returncode": done.returncode, "stderr_tail": done.stderr[-1500:]}
    (run_dir,) = (out / "profiles").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    per_step = [
        float(row["tokens_per_s"])
        for row in csv.DictReader((run_dir / "metrics.csv").open())
        if row.get("tokens_per_s")
    ]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    return {
        "returncode": 0,
        "tokens_per_s_after_step_2": statistics.median(per_step[2:]),
        "first_step_seconds": summary["compile_seconds"] if compiled else None,
        "measured_peak_bytes": max(phase["peak_bytes"] for phase in ledger["phases"].values()),
        "compilations": 1 + len(re.findall(r"Recompiling function", done.stderr)) if compiled else 0,
        "final_loss": summary["last_loss"],
    }


def step_estimate(recipe: tuple, compiled: bool, work: Path, name: str, accelerator: str) -> int:
    """The step's predicted peak (``--estimate true``, with ``--compile`` as the run): the largest of the step's
    phases in its ``estimate.json``, what the ledger's measured peak is compared with."""
    script, *flags = recipe
    where = work / f"estimate-{name}-{'compiled' if compiled else 'eager'}"
    done = subprocess.run(
        [sys.executable, str(ROOT / script), *flags, "--estimate", "true", "--accelerator", accelerator]
        + ["--compile", str(compiled).lower(), "--profile_dir", str(where)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(recipe)} --estimate: {done.stderr[-1500:]}")
    (estimate,) = where.glob("*/estimate.json")
    return max(phase["peak_bytes"] for phase in json.loads(estimate.read_text())["phases"].values())


def table(record: dict) -> str:
    """docs/compile.md's table, from a record this benchmark wrote (tests/test_compile.py checks the page against the
    committed record)."""
    lines = [
        "| recipe | tokens/s eager | tokens/s compiled | compiled / eager | first step compiled (s) | compilations"
        " | measured peak eager | measured peak compiled | compiled / eager | eager estimate | compiled estimate"
        " | compiled estimate / measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for row in record["rows"]:
        eager, compiled, ratio = row["eager"], row["compiled"], row["compiled_over_eager"]
        cells = [
            f"`{row['recipe']}`",
            f"{eager['tokens_per_s_after_step_2']:,.0f}",
            f"{compiled['tokens_per_s_after_step_2']:,.0f}",
            f"{ratio['tokens_per_s']:.2f}",
            f"{compiled['first_step_seconds']:.1f}",
            str(compiled["compilations"]),
            f"{eager['measured_peak_bytes'] / mib:.2f} MiB",
            f"{compiled['measured_peak_bytes'] / mib:.2f} MiB",
            f"{ratio['measured_peak']:.2f}",
            f"{row['eager_estimate_bytes'] / mib:.2f} MiB",
            f"{row['compiled_estimate_bytes'] / mib:.2f} MiB",
            f"{row['compiled_estimate_bytes'] / compiled['measured_peak_bytes']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/compile.json")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--table", action="store_true", help="print docs/compile.md's table from --out, run nothing")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"], help="where the runs train")
    parser.add_argument(
        "--recipes",
        nargs="*",
        default=None,
        help="only these rows (a row's recipe, as written), each replacing its row in --out where --out has one",
    )
    parser.add_argument(
        "--model", default=None, help="a litgpt architecture by name, random weights (default: embedded)"
    )
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for named in RECIPES:
            if args.recipes is not None and " ".join(named) not in args.recipes:
                continue
            recipe, name = with_model(named, args.model, work), _name(named)
            eager = run(recipe, False, args.steps, work, name, args.accelerator)
            compiled = run(recipe, True, args.steps, work, name, args.accelerator)
            row = {
                "recipe": " ".join(named),
                "eager": eager,
                "compiled": compiled,
                "eager_estimate_bytes": step_estimate(recipe, False, work, name, args.accelerator),
                "compiled_estimate_bytes": step_estimate(recipe, True, work, name, args.accelerator),
            }
            if eager["returncode"] == 0 and compiled["returncode"] == 0:
                row["compiled_over_eager"] = {
                    "tokens_per_s": round(
                        compiled["tokens_per_s_after_step_2"] / eager["tokens_per_s_after_step_2"], 3
                    ),
                    "measured_peak": round(compiled["measured_peak_bytes"] / eager["measured_peak_bytes"], 3),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = {
        "what": (
            "each recipe on the model named below, eager and compiled (--compile true), one CPU process each: the median"
            " tokens/s of the steps after the first two, the first step's seconds with compilation, the ledger's"
            " measured peak (CPU tensor memory of the recorded step), dynamo's compilations of the blocks' forward,"
            " and the step's estimate, eager and compiled (--estimate true --compile true: the blocks' graphs as"
            " AOTAutograd's min-cut partitioner splits them, with what inductor writes to memory counted and what it"
            " fuses not)"
        ),
        "model": args.model or "the embedded default",
        "accelerator": args.accelerator,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "steps": args.steps,
        "rows": rows,
    }
    if args.recipes is not None and args.out.is_file():
        # the rows run now in place of the same recipes' rows, the rest as recorded (same model and steps only)
        earlier = json.loads(args.out.read_text())
        ran = (earlier.get("model", "the embedded default"), earlier["steps"], earlier.get("accelerator", "cpu"))
        if ran != (record["model"], args.steps, args.accelerator):
            raise SystemExit(f"{args.out} records another model, step count or accelerator: rerun it whole")
        fresh = {row["recipe"]: row for row in rows}
        record["rows"] = [fresh.pop(row["recipe"], row) for row in earlier["rows"]] + list(fresh.values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
