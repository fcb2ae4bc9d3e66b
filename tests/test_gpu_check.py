"""benchmarks/gpu_check.py, the lent GPU's one command, as far as a CPU can check it without running it (its CPU
rehearsal, ``--rehearse``, runs every check's plumbing in about 2.5 minutes: docs/benchmarks.md)."""

import json
import sys
import threading
import time

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
