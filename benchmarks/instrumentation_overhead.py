"""What Memfit's always-on memory instrumentation costs: the same run with and without it, alternated in one run.

    python benchmarks/instrumentation_overhead.py --repeats 3 --out profiles/cpu/instrumentation_overhead.json

"With" is the default: a profiler window of one recorded step (memory, shapes and stacks), the per-phase memory
probes every step, then the ledger, the trace parsing and the picture after the final checkpoint. "Without" is
``--profile.enabled false``: no window, no ledger and no picture (the per-phase probes stay: they are the per-step
memory scalars). Each run is a fresh process on the embedded default. The figures are the run's own training time
(``summary.json``: training steps only) and the process's wall time (start to exit, including the ledger and the
picture), as medians over the repeats, and their ratios.
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


def one_run(args: list[str], work: Path) -> dict:
    work.mkdir(parents=True)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "finetune/lora.py"), *args], cwd=work, capture_output=True,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"error: the run failed:\n{result.stderr[-2000:]}")
    (summary,) = (work / "profiles").glob("*/summary.json")
    summary = json.loads(summary.read_text())
    return {"wall_s": wall, "tokens_per_s": summary["tokens_per_s"], "steps": summary["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/instrumentation_overhead.json")
    parser.add_argument("--extra", nargs="*", default=["--quantize", "bnb.nf4"], help="flags for both sides")
    options = parser.parse_args()
    sides = {"with": [], "without": ["--profile.enabled", "false"]}
    work = Path(tempfile.mkdtemp(prefix="memfit-overhead-"))
    runs = {name: [] for name in sides}
    for repeat in range(options.repeats):
        for name, flags in sides.items():  # alternated, so drift in the machine's speed hits both sides
            runs[name].append(one_run([*options.extra, *flags, "--logger_name", "csv"], work / f"{name}-{repeat}"))
            print(name, repeat, runs[name][-1], flush=True)
    median = {name: {key: statistics.median(r[key] for r in rs) for key in ("wall_s", "tokens_per_s")}
              for name, rs in runs.items()}
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "versions": {"python": platform.python_version(),
                     **{m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt", "bitsandbytes")}},
        "command": f"python finetune/lora.py {' '.join(options.extra)} --logger_name csv [--profile.enabled false]",
        "measures": "wall_s: process start to exit; tokens_per_s: training steps only (summary.json); medians",
        "repeats": options.repeats,
        "runs": runs,
        "median": median,
        "range": {name: {key: [min(r[key] for r in rs), max(r[key] for r in rs)] for key in ("wall_s", "tokens_per_s")}
                  for name, rs in runs.items()},
        "wall_ratio_with_over_without": median["with"]["wall_s"] / median["without"]["wall_s"],
        "throughput_ratio_with_over_without": median["with"]["tokens_per_s"] / median["without"]["tokens_per_s"],
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("median", "wall_ratio_with_over_without",
                                              "throughput_ratio_with_over_without")}, indent=2))


if __name__ == "__main__":
    main()
