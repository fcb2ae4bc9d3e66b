"""memfit.training.cpu_threads: on a busy CPU a run trains on the cores other processes leave free, and says so."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

PROBE = (
    "import torch\n"
    "from memfit.training.cpu_threads import threads_for_free_cores\n"
    "before = torch.get_num_threads()\n"
    "after = threads_for_free_cores(print)\n"
    "print(before, after, torch.get_num_threads())\n"
)


def _probe(env: dict) -> tuple[list[int], str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    *lines, counts = result.stdout.strip().splitlines()
    return [int(value) for value in counts.split()], "\n".join(lines)


@pytest.fixture
def busy_cpu():
    """As many spinning processes as the machine has cores: every core busy."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    yield
    for process in spinning:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_a_busy_cpu_gets_fewer_threads_and_one_warning_line(busy_cpu):
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    (before, after, now), said = _probe(env)
    assert before == (os.cpu_count() or 1) and after == now < before, (before, after, now, said)
    assert said.startswith("warning: the CPU is busy (other processes keep about") and said.count("\n") == 0, said


@pytest.mark.slow
def test_a_thread_count_the_user_chose_is_kept_silently(busy_cpu):
    # (the suite's workers set both counts to 1: MKL's would cap OMP's)
    env = {**{k: v for k, v in os.environ.items() if k != "MKL_NUM_THREADS"}, "OMP_NUM_THREADS": "2"}
    (before, after, now), said = _probe(env)
    assert before == after == now == 2 and said == ""
