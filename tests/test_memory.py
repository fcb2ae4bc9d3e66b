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


_BLAS_LATE = """
import resource, sys
import numpy
from memfit.memory import reserve_blas_buffers
if sys.argv[1] == "reserved":
    reserve_blas_buffers()
size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 200_000_000, resource.RLIM_INFINITY))
hog = []
try:
    while True:
        hog.append(bytearray(10_000_000))
except MemoryError:
    pass
del hog[-2:]  # 20 MB left: enough for Python, not for OpenBLAS's buffers
square = numpy.ones((512, 512))
print("product", (square @ square).sum())
"""


def test_numpys_blas_buffers_taken_at_the_start_survive_an_exhausted_address_space():
    """Under an address-space limit OpenBLAS maps its buffers at its first product and, finding no room, ends the
    process itself (exit 1, no Python error to catch). Reserved at the start (``reserve_blas_buffers``, which a CPU
    run's probe calls under a limit), the late product runs."""
    import subprocess
    import sys

    import numpy

    blas = numpy.__config__.CONFIG["Build Dependencies"]["blas"]["name"]
    if "openblas" not in blas.lower():
        pytest.skip(f"numpy's BLAS here is {blas}, not OpenBLAS, whose exit(1) this provokes")
    late = subprocess.run([sys.executable, "-c", _BLAS_LATE, "late"], capture_output=True, text=True, timeout=120)
    assert late.returncode != 0 and "OpenBLAS" in late.stdout + late.stderr, (late.returncode, late.stderr[-500:])
    reserved = subprocess.run(
        [sys.executable, "-c", _BLAS_LATE, "reserved"], capture_output=True, text=True, timeout=120
    )
    assert reserved.returncode == 0 and "product" in reserved.stdout, reserved.stderr[-2000:]
