"""profiles/gpu/pytest_cuda.json from the JUnit XML of a `pytest -m cuda` run (benchmarks/gpu_check.py writes both).

    python benchmarks/cuda_tests_json.py profiles/gpu/pytest_cuda.xml --command "python -m pytest -m cuda ..."

Each test's outcome and, for a failure, the first line of pytest's message, with the device, the versions and the
commit, in the shape the resource table renders (benchmarks/resource_table.py, "GPU: the CUDA tests").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def outcomes(junit: Path) -> tuple[list[list[str]], dict[str, str]]:
    """``[[test id, PASSED|FAILED|ERROR|SKIPPED], ...]`` in the run's order, and the first line of each failure."""
    results, reasons = [], {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, reason = "PASSED", ""
        for tag, name in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "SKIPPED")):
            element = case.find(tag)
            if element is not None:
                outcome = name
                reason = (element.get("message") or element.text or "").strip().splitlines()[:1]
                reason = reason[0][:300] if reason else ""
                break
        results.append([test, outcome])
        if outcome in ("FAILED", "ERROR") and reason:
            reasons[test] = reason
    return results, reasons


def device() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU ({platform.machine()})"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory // 2**20} MiB)"


def commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return f"commit {head}" + (" with uncommitted changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("junit", type=Path)
    parser.add_argument("--command", default="python -m pytest -m cuda", help="the pytest command that made it")
    parser.add_argument("--tmp", default="/tmp", help="where pytest's temporary files were")
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/gpu/pytest_cuda.json")
    args = parser.parse_args()
    import torch

    results, reasons = outcomes(args.junit)
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in (
        "lightning",
        "litgpt",
        "bitsandbytes",
        "jsonargparse",
        "plotly",
        "matplotlib",
        "tensorboard",
        "torch-tb-profiler",
    ):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    report = {
        "what": "pytest -m cuda (tests/test_cuda.py)",
        "device": device(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d"),
        "code": commit(),
        "architecture": "the tests' own: TinyLlama-1.1B architecture with random weights, and the embedded default",
        "runs": [
            {
                "call": "one pytest run"
                + (
                    ", several tests at a time (pytest-xdist)"
                    if " -n 0 " not in f"{args.command} "
                    else ", one test at a time"
                ),
                "command": args.command,
                "tmp": args.tmp,
                "outcomes": results,
                "failure_reasons": reasons,
            }
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"wrote {args.out}: "
        + ", ".join(f"{sum(o == k for _, o in results)} {k.lower()}" for k in ("PASSED", "FAILED", "ERROR", "SKIPPED"))
    )


if __name__ == "__main__":
    main()
