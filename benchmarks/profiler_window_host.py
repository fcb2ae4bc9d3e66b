"""The profiler window's host memory on a CPU run, measured against the estimate's "Profiler window" line.

    python benchmarks/profiler_window_host.py --out profiles/cpu/profiler_window_host.json

The embedded LoRA (micro-batches of 2 x 64 tokens, 32-true, 2 steps: the second recorded) at 1, 4 and 8 micro-batches
a step (4 is the most traced whole; 8 is traced from its last), with ``--profile.with_stack`` false (the default) and
true. Measured: the process's peak RSS (sampled from /proc every 20 ms by the process itself) with the window on less
the same run with it off, all in one sitting. Predicted: ``--estimate``'s line for the same flags, which counts the
fake trace's allocations and frees in the traced micro-batches (``memfit.observatory.profiling.window_host_bytes``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
MICRO_BATCHES = (1, 4, 8)

# The child reports its own peak RSS: its ru_maxrss would start at its parent's (Linux keeps the high-water mark
# across exec), and memfit's probe resets VmHWM at every phase.
MEASURED = (
    "import runpy, sys, threading, time\n"
    "peak = [0]\n"
    "def sample():\n"
    "    while True:\n"
    "        peak[0] = max(peak[0], int(open('/proc/self/statm').read().split()[1]))\n"
    "        time.sleep(0.02)\n"
    "threading.Thread(target=sample, daemon=True).start()\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as end:\n"
    "    assert not end.code, end.code\n"
    "import resource\n"
    "print('peak_rss_pages', peak[0], resource.getpagesize())\n"
)


def flags(micro_batches: int, with_stack: bool) -> list[str]:
    return [
        "--train.micro_batch_size", "2", "--train.global_batch_size", str(2 * micro_batches),
        "--train.max_seq_length", "64", "--precision", "32-true", "--accelerator", "cpu",
        "--profile.with_stack", str(with_stack).lower(),
    ]  # fmt: skip


def peak_rss(cwd: Path, micro_batches: int, with_stack: bool, profiled: bool) -> int:
    """Bytes: the peak RSS of a 2-step run."""
    cwd.mkdir(parents=True)
    command = [sys.executable, "-c", MEASURED, str(ROOT / "finetune/lora.py"), *flags(micro_batches, with_stack)]
    command += ["--train.max_steps", "2", "--eval.final_validation", "false", "--logger_name", "csv"]
    command += ["--profile.enabled", str(profiled).lower()]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"the run failed: {result.stderr[-2000:]}")
    pages, page_size = map(int, result.stdout.split("peak_rss_pages")[1].split()[:2])
    return pages * page_size


def predicted(cwd: Path, micro_batches: int, with_stack: bool) -> int:
    """Bytes: the estimate's "Profiler window" line."""
    command = [sys.executable, str(ROOT / "finetune/lora.py"), *flags(micro_batches, with_stack), "--estimate", "true"]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"the estimate failed: {result.stderr[-2000:]}")
    number, unit = re.search(r"Profiler window: about ([0-9.]+) (KiB|MiB|GiB)", result.stdout).groups()
    return round(float(number) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/profiler_window_host.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for micro_batches in MICRO_BATCHES:
            off = peak_rss(tmp / f"off-{micro_batches}", micro_batches, False, profiled=False)
            for with_stack in (False, True):
                on = peak_rss(tmp / f"on-{micro_batches}-{with_stack}", micro_batches, with_stack, profiled=True)
                want = predicted(tmp, micro_batches, with_stack)
                row = {
                    "micro_batches": micro_batches,
                    "with_stack": with_stack,
                    "peak_rss_off_bytes": off,
                    "peak_rss_on_bytes": on,
                    "window_measured_bytes": on - off,
                    "window_predicted_bytes": want,
                }
                rows.append(row)
                print(
                    f"{micro_batches} micro-batch(es), with_stack {str(with_stack).lower():5}: window measured"
                    f" {(on - off) / MIB:7.1f} MiB (peak RSS {on / MIB:.1f} on, {off / MIB:.1f} off),"
                    f" predicted {want / MIB:7.1f} MiB ({want / (on - off):.2f}x)",
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "measures": "peak RSS of the process with the profiler window on less with it off (same flags, one sitting)",
        "rows": rows,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
