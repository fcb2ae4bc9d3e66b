"""What Memfit's always-on memory instrumentation costs: the same run with and without it, alternated in one run.

    python benchmarks/instrumentation_overhead.py --repeats 4 --out profiles/cpu/instrumentation_overhead.json

"With" is the default: a profiler window of one recorded step (memory, no Python stacks), the per-phase memory probes
every step, then the ledger, the trace parsing and the picture after the final checkpoint. "Without" is
``--profile.enabled false``: no window, no ledger and no picture (the per-phase probes stay: they are the per-step
memory scalars). Each run is a fresh process on the embedded default, at two lengths: the default run (80 steps)
and a longer one. The figures are the run's own training time (``summary.json``: training steps only), the
process's wall time (start to exit, including the ledger and the picture) and its CPU time, as medians over the
repeats, and each back-to-back pair's ratio and difference (median and spread). Most of the cost is paid once a
run (the window, the ledger, the picture), so it weighs less in the longer run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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
sys.path.insert(0, str(ROOT))

from memfit.training.precision import cpu_description  # noqa: E402  (after the path)


def one_run(args: list[str], work: Path) -> dict:
    """Wall time, and the CPU time the process used (``wait4``'s user + system: less sensitive than wall time to
    other work on a shared machine), of one run."""
    work.mkdir(parents=True)
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "finetune/lora.py"), *args],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    stderr = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"error: the run failed:\n{stderr[-2000:]}")
    (summary,) = (work / "out" / "profiles").glob("*/summary.json")
    summary = json.loads(summary.read_text())
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "tokens_per_s": summary["tokens_per_s"],
        "steps": summary["steps"],
    }


KEYS = ("wall_s", "cpu_s", "tokens_per_s")


def measure(options, steps: int | None, work: Path) -> dict:
    """Both sides at one run length (None: the default run), alternated ``repeats`` times; the ratios are the
    medians of each pair's (a pair runs back to back, so the machine's drift over minutes cancels)."""
    sides = {"with": [], "without": ["--profile.enabled", "false"]}
    length = [] if steps is None else ["--train.max_steps", str(steps), "--train.epochs", "1000"]
    runs = {name: [] for name in sides}
    for repeat in range(options.repeats):
        for name, flags in sides.items():
            runs[name].append(one_run([*options.extra, *length, *flags], work / f"{steps}-{name}-{repeat}"))
            print(steps or "default", name, repeat, runs[name][-1], flush=True)
    return summarize(runs)


def summarize(runs: dict) -> dict:
    """Medians and ranges of each side, and each back-to-back pair's ratio and difference (median, min, max)."""
    pairs = list(zip(runs["with"], runs["without"]))

    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "steps": runs["with"][0]["steps"],
        "runs": runs,
        "median": {name: {key: statistics.median(r[key] for r in rs) for key in KEYS} for name, rs in runs.items()},
        "range": {
            name: {key: [min(r[key] for r in rs), max(r[key] for r in rs)] for key in KEYS} for name, rs in runs.items()
        },
        "ratio_with_over_without": {key: spread([a[key] / b[key] for a, b in pairs]) for key in KEYS},
        "extra_s": {key: spread([a[key] - b[key] for a, b in pairs]) for key in ("wall_s", "cpu_s")},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long_steps", type=int, default=320, help="the longer run's steps (0: the default run only)")
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/instrumentation_overhead.json")
    parser.add_argument(
        "--extra",
        nargs="*",
        default=["--quantize", "bnb.nf4"],
        help="flags for both sides (the default logger, TensorBoard, included: the picture is drawn for its Images tab too)",
    )
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memfit-overhead-"))
    lengths = [measure(options, None, work)] + (
        [measure(options, options.long_steps, work)] if options.long_steps else []
    )
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": cpu_description(),
        "versions": {
            "python": platform.python_version(),
            **{m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt", "bitsandbytes")},
        },
        "command": (
            f"python finetune/lora.py {' '.join(options.extra)}"
            + (f" [--train.max_steps {options.long_steps} --train.epochs 1000]" if options.long_steps else "")
            + " [--profile.enabled false]"
        ),
        "measures": (
            "wall_s: process start to exit; cpu_s: the process's user + system CPU time (wait4); tokens_per_s:"
            " training steps only (summary.json); medians; ratios and extra: medians over back-to-back pairs"
        ),
        "repeats": options.repeats,
        "lengths": lengths,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(report, indent=2))
    print(
        json.dumps(
            {
                "lengths": [
                    {k: m[k] for k in ("steps", "median", "ratio_with_over_without", "extra_s")} for m in lengths
                ]
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
