"""The main job on a busy CPU, both ways in one run: torch's own thread count against the one Memfit sizes to the
free cores (``memfit.training.cpu_threads``), beside the same job on the quiet machine:

    python benchmarks/busy_cpu.py --out profiles/cpu/busy_cpu.json

"Busy" is every core kept busy by another process (a spinning one per core: two on the 2-core machine, as a
newcomer's laptop running a build). Each run is the quick start's command for
``--steps`` steps with the profiler off, a whole process; tokens/s is the run's own (its closing line's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main_job(work: Path, name: str, steps: int, env: dict) -> dict:
    command = [
        sys.executable,
        str(ROOT / "finetune/lora.py"),
        *("--out_dir", str(work / name / "out"), "--profile_dir", str(work / name / "profiles")),
        *("--train.max_steps", str(steps), "--profile.enabled", "false"),
    ]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    speed = re.search(r"([0-9,]+) tokens/s", done.stdout)
    warning = next((line for line in done.stderr.splitlines() if line.startswith("warning: the CPU is busy")), None)
    return {
        "returncode": done.returncode,
        "tokens_per_s": float(speed.group(1).replace(",", "")) if speed else None,
        "warning": warning,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/busy_cpu.json")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    free = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        rows = {"quiet": main_job(work, "quiet", args.steps, free)}
        spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
        try:
            # torch's own count, as before Memfit sized it: the count given explicitly, which Memfit keeps
            rows["busy, torch's threads"] = main_job(work, "torch", args.steps, {**free, "OMP_NUM_THREADS": str(cores)})
            rows["busy, sized to the free cores"] = main_job(work, "sized", args.steps, free)
        finally:
            for process in spinning:
                process.kill()
    quiet = rows["quiet"]["tokens_per_s"]
    record = {
        "what": (
            f"tokens/s of the quick start's command for {args.steps} steps (profiler off), on the quiet machine and with"
            f" {cores} spinning processes, with torch's {cores} threads and with the threads Memfit sizes to the free"
            " cores; ratios against the quiet machine"
        ),
        "machine": f"{platform.machine()}, {cores} cores",
        "rows": rows,
        "against_quiet": {name: round(row["tokens_per_s"] / quiet, 3) for name, row in rows.items()},
    }
    print(json.dumps(record, indent=1))
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
