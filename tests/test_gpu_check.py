"""benchmarks/gpu_check.py, the lent GPU's one command, as far as a CPU can check it without running it (its CPU
rehearsal, ``--rehearse``, runs every check's plumbing in about 2.5 minutes: docs/benchmarks.md)."""

import json
import sys
import threading
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))


def test_the_signature_command_checked_on_the_gpu_is_the_readmes():
    from gpu_check import SIGNATURE

    readme = (ROOT / "README.md").read_text()
    assert f"&& {SIGNATURE}\n" in readme


def test_each_check_is_one_json_line_as_it_ends_and_the_summary_one_line_each(tmp_path):
    """What a session cut off part-way still brings back: the lines written so far; the summary names every check,
    its status, and each failed test with its reason."""
    from gpu_check import Session, summary

    session = Session(tmp_path, tmp_path, tmp_path, rehearse=True, deadline=time.time() + 60, lock=threading.Lock())
    (tmp_path / "checks.jsonl").write_text("")
    session.record({"check": "environment", "status": "pass", "figures": {"torch": "2.11.0"}, "seconds": 3})
    session.record(
        {
            "check": "pytest_cuda",
            "status": "fail",
            "figures": {"PASSED": 21, "FAILED": 1, "failures": {"tests/test_cuda.py::test_x": "assert 3 == 0"}},
            "seconds": 300,
        }
    )
    session.record({"check": "compare_litgpt", "status": "skip", "why": "40 s left of the session, 170 needed"})
    lines = (tmp_path / "checks.jsonl").read_text().splitlines()
    assert [json.loads(line)["check"] for line in lines] == ["environment", "pytest_cuda", "compare_litgpt"]
    text = summary(tmp_path, time.time() - 10)
    assert "PASS  environment" in text and "FAIL  pytest_cuda" in text and "SKIP  compare_litgpt" in text
    assert "tests/test_cuda.py::test_x: assert 3 == 0" in text
    assert len(text.splitlines()) == 5


@pytest.mark.slow
def test_the_session_script_without_a_gpu_ends_at_once_with_one_line():
    """Without a GPU, ``bash benchmarks/gpu_session.sh 1`` ends in seconds with one line pointing at the rehearsal
    (it once ran on, writing a 1.1B checkpoint on the CPU); a call that names no call is told which there are."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        import pytest

        pytest.skip("this machine has nvidia-smi: the script would run the GPU check")
    started = time.time()
    result = subprocess.run(["bash", "benchmarks/gpu_session.sh", "1"], cwd=ROOT, capture_output=True, text=True)
    assert time.time() - started < 10
    assert result.returncode == 1 and len(result.stdout.strip().splitlines()) == 1, result
    assert "needs an NVIDIA GPU" in result.stdout and "gpu_check.py --call 1 --rehearse" in result.stdout
    result = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "1|2" in result.stdout


def test_each_call_runs_within_five_minutes_of_command_time():
    """Two prepared calls: every check's own limit is inside the call's seconds, and a call's lanes together are
    sized so its command ends before the 300 s the run is given."""
    from gpu_check import CALL_SECONDS, CALLS

    assert CALL_SECONDS <= 280
    for first, lane_a, lane_b in CALLS.values():
        assert all(limit <= CALL_SECONDS for _, _, limit in first + lane_a + lane_b)
    names = [name for checks in CALLS.values() for part in checks for name, _, _ in part]
    assert "pytest_cuda" in names and "qlora_7b" in names and "recorded_step_cost" in names
