"""``--estimate`` from every file of litgpt's config hub, unchanged: no weights, data or network, as on a login node.

    python benchmarks/hub_estimates.py --hub ../shared/litgpt_config_hub --out profiles/cpu/hub_estimates.json

Each fine-tuning file runs through the script of its method (lora.yaml and qlora.yaml: finetune/lora.py, full.yaml:
finetune/full.py), each pretraining file through pretrain/pretrain.py, in a process of its own (two at a time). The
result per file: the exit status, the settings the estimate assumed (its second line), the predicted peak and the
seconds the process took; for a failure, its last line.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"lora.yaml": "finetune/lora.py", "qlora.yaml": "finetune/lora.py", "full.yaml": "finetune/full.py"}


def script_for(path: Path) -> str | None:
    if path.parent.name == "pretrain":
        return "pretrain/pretrain.py"
    return SCRIPTS.get(path.name)


def run(hub: Path, path: Path, work: Path) -> dict:
    script = script_for(path)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / script), "--config", str(path), "--estimate", "true"],
                            cwd=work, capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = result.stdout.splitlines()
    entry = {"file": str(path.relative_to(hub)), "script": script, "returncode": result.returncode,
             "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    title = next((i for i, line in enumerate(lines) if line.startswith("Estimate for")), None)
    peak = next((line for line in lines if line.startswith("Predicted peak: ")), None)
    if result.returncode == 0 and title is not None and peak is not None:
        number, unit = peak.split()[2:4]
        entry.update(title=lines[title], settings=lines[title + 1].strip(), predicted=f"{number} {unit}")
    else:
        entry["error"] = (result.stderr.strip().splitlines() or [""])[-1][:300]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hub", type=Path, default=ROOT.parent / "shared" / "litgpt_config_hub")
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/hub_estimates.json")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    if not args.hub.is_dir():
        sys.exit(f"error: --hub {str(args.hub)!r} is not a directory: give litgpt's config_hub folder")
    files = sorted(p for p in args.hub.rglob("*.yaml") if script_for(p) is not None)
    with tempfile.TemporaryDirectory() as work, ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda p: run(args.hub, p, Path(work)), files))
    failed = [r for r in results if r["returncode"]]
    report = {
        "what": "python <script> --config <hub file> --estimate true, each file unchanged, one process each",
        "hub": "litgpt v0.5.13 config_hub",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "files": len(results),
        "failed": len(failed),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{len(results) - len(failed)} of {len(results)} hub files estimated; wrote {args.out}")
    for r in failed:
        print(f"  {r['file']}: {r['error']}")


if __name__ == "__main__":
    main()
