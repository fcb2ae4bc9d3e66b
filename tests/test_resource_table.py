"""profiles/README.md is made from the committed raw results, and says which results are missing."""

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import resource_table  # noqa: E402


def test_the_committed_table_is_what_the_results_give():
    assert (ROOT / "profiles/README.md").read_text() == resource_table.table(), (
        "profiles/README.md is stale: run python benchmarks/resource_table.py"
    )


def test_every_cpu_comparison_row_comes_from_its_json():
    text = (ROOT / "profiles/README.md").read_text()
    for name in (
        "compare_litgpt.json",
        "compare_litgpt_avx2.json",
        "compare_litgpt_avx2_tiny6.json",
    ):  # two CPU families
        data = json.loads((ROOT / "profiles/cpu" / name).read_text())
        assert f"`profiles/cpu/{name}`: {data['device']}" in text
        for result in data["results"]:
            memfit = result["median"]["memfit"]
            assert f"{memfit['tokens_per_s']:,.0f}" in text and f"{memfit['peak_rss_bytes'] / 2**20:.0f} MiB" in text
    if not (ROOT / "profiles/gpu/compare_litgpt.json").is_file():
        assert "No results are committed for: `profiles/gpu/compare_litgpt.json`" in text


def test_a_gpu_comparison_renders_with_its_floor(tmp_path, monkeypatch):
    """The GPU layout (CUDA peaks, the floor's columns), from a result in compare_litgpt.py's shape."""
    side = {
        "tokens_per_s": 2000.0,
        "training_s": 10.0,
        "wall_s": 60.0,
        "peak_rss_bytes": 2**31,
        "max_allocated_bytes": 7 * 2**30,
        "max_reserved_bytes": 8 * 2**30,
    }
    result = {
        "method": "lora",
        "architecture": "Llama-2-7b-hf",
        "precision": "bf16-true",
        "quantize": "bnb.nf4",
        "micro_batch_size": 1,
        "sequence_length": 512,
        "runs": {},
        "failed": {},
        "median": {"memfit": side, "litgpt": {**side, "max_allocated_bytes": 8 * 2**30}},
        "tokens_per_s_ratio": {"median": 1.0, "min": 1.0, "max": 1.0},
        "peak_memory_ratio": {"median": 0.875, "min": 0.875, "max": 0.875},
        "floor": {"memory_bytes": 4 * 2**30, "tokens_per_s": 20000.0},
    }
    path = tmp_path / "profiles/gpu/compare_litgpt.json"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps({"device": "NVIDIA H100", "measures": "CUDA", "settings": {"warmup_steps": 5}, "results": [result]})
    )
    monkeypatch.setattr(resource_table, "ROOT", tmp_path)
    row = resource_table.compare_section(path)[-1]
    assert "CUDA max allocated" in resource_table.compare_section(path)[2]
    assert "| 7.00 GiB | 8.00 GiB | x0.88 (0.88-0.88) |" in row and row.endswith("| - | 4.00 GiB | 20,000 |")


def test_every_cuda_test_outcome_comes_from_its_json():
    data = json.loads((ROOT / "profiles/gpu/pytest_cuda.json").read_text())
    text = (ROOT / "profiles/README.md").read_text()
    for run in data["runs"]:
        for test, outcome in run["outcomes"]:
            assert f"| `{test.split('::')[-1]}` | {outcome} |" in text


@pytest.mark.slow
def test_a_cuda_test_run_becomes_the_tables_json(tmp_path, monkeypatch):
    """benchmarks/gpu_check.py turns pytest's JUnit XML into profiles/gpu/pytest_cuda.json: a real pytest run with a passing, a
    failing and a skipped test gives each outcome, the failure's first line, and a table section that shows them."""
    import subprocess

    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes():\n    assert 1 + 1 == 2\n"
        "def test_fails():\n    assert 2 + 2 == 5, 'SystemError: run_backward returned NULL'\n"
        "@pytest.mark.skip(reason='needs a CUDA GPU')\ndef test_skips():\n    pass\n"
    )
    junit = tmp_path / "pytest_cuda.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            f"--junitxml={junit}",
            str(tmp_path / "test_sample.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
    )
    out = tmp_path / "gpu/pytest_cuda.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/cuda_tests_json.py"), str(junit), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "1 passed, 1 failed, 0 error, 1 skipped" in done.stdout
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["outcomes"] == [
        ["test_sample.py::test_passes", "PASSED"],
        ["test_sample.py::test_fails", "FAILED"],
        ["test_sample.py::test_skips", "SKIPPED"],
    ]
    assert "SystemError: run_backward returned NULL" in run["failure_reasons"]["test_sample.py::test_fails"]
    assert data["versions"]["torch"] and data["code"].startswith(("commit ", "unknown"))
    monkeypatch.setattr(resource_table, "PROFILES", tmp_path)
    section = "\n".join(resource_table.tests_section(out))
    assert "| `test_fails` | FAILED | AssertionError: SystemError: run_backward returned NULL" in section
    assert "| `test_passes` | PASSED |" in section and "| `test_skips` | SKIPPED |" in section
