"""memfit.memory: the readings a run reports, on the CPU (process RSS)."""

import pytest

pytestmark = pytest.mark.slow  # each test starts a process

_RESETS = """
import torch
from memfit.memory import MemoryProbe, proc_status

probe = MemoryProbe(torch.device("cpu"))
before = proc_status()["VmRSS"]
held = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
del held
probe.reset_peak()  # the next phase begins: VmHWM falls back to what is resident now
probe.reset_peak()
assert proc_status()["VmHWM"] < before + 32 * 2**20  # the reset worked: the phase's own peak forgot the 64 MiB
assert probe.run_peak() >= before + 60 * 2**20, (probe.run_peak(), before)
assert probe.scalars()["memory/cpu_peak_rss_gib"] * 2**30 >= before + 60 * 2**20
"""


def test_the_run_peak_outlives_each_phase_reset():
    """Each phase resets the high-water mark to measure its own peak; the per-step scalar still reports the run's.
    In a fresh process: in a test worker that has run other tests, the allocator can serve the 64 MiB from memory
    already resident, and RSS never rises."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _RESETS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_benchmarks_cuda_hook_keeps_the_peak_each_reset_forgets():
    """benchmarks/cuda_peaks (compare_litgpt's measurement of both tools): Memfit resets the allocator's peak every
    phase, so the hook wraps the reset as soon as torch.cuda is imported, whichever way it is imported."""
    import subprocess
    import sys

    from conftest import ROOT

    probe = (
        "import torch\n"
        "from torch.cuda import reset_peak_memory_stats as imported\n"
        "print(hasattr(torch.cuda.reset_peak_memory_stats, '__wrapped__'), hasattr(imported, '__wrapped__'))\n"
    )
    env = {"PYTHONPATH": str(ROOT / "benchmarks/cuda_peaks"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "True"], result.stderr
