"""This machine, for a benchmark's record. A benchmark helper: not part of memfit."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # memfit, when run from anywhere
from memfit.precision import sixteen_bit_matmul_instructions  # noqa: E402


def cpu_description() -> str:
    """This machine's CPU, for a benchmark's record: its model, the cores this process may use, and its 16-bit matmul
    instructions, on which a CPU's bf16 and float16 speed depends (memfit.precision.slow_half_precision_on_this_cpu)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
        if line.startswith("model name")
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    found = sixteen_bit_matmul_instructions()
    instructions = "unknown" if found is None else ", ".join(found) or "none (bf16 and float16 emulated)"
    return (
        f"CPU: {names[0] if names else platform.processor() or platform.machine()}, {cores} cores,"
        f" 16-bit matmul instructions: {instructions}"
    )


if __name__ == "__main__":
    print(cpu_description())
