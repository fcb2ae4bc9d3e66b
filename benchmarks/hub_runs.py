"""A short real run of every file of litgpt's config hub, the file unchanged, with only the model and the data
swapped for local ones (no weights or data can be downloaded here, and a 7B model does not train on 2 CPU cores).

    python benchmarks/hub_runs.py --hub ../shared/litgpt_config_hub --out profiles/cpu/hub_runs.json

What is swapped, and nothing else:
- the checkpoint (fine-tuning) or the architecture (pretraining): a random-weight model of the file's own architecture
  made small (``memfit.training.random_checkpoints.same_architecture_small``: its MLP and norm classes, rotary fraction,
  sliding windows, soft-capping and grouped-query layout kept; two blocks, 64 wide, the embedded tokenizer);
- the data: the hub's fine-tuning files read Hugging Face's ``mhenrichsen/alpaca_2k_test`` through ``datasets``;
  here litgpt's ``JSON`` module reads ``../shared/data/alpaca_5000.json`` with the file's own data settings
  (validation fraction, prompt style, masking, seed), in the training process (no DataLoader workers). The pretraining
  files' litdata streams become Memfit's ``PlainText`` on ``tinyshakespeare.txt``, and their tokenizer dir the small
  checkpoint's.
- the length: ``--train.max_steps 2 --eval.max_iters 2`` (each file trains for an epoch or for billions of tokens).

Everything else is the file's: precision, quantization, devices (several processes, as litgpt starts them), batch
sizes (so ``pretrain/tinyllama.yaml`` accumulates 128 micro-batches of 4 x 2048 tokens a step), sequence length,
LoRA settings, optimizer, schedule. The run's memory profiler is on, as by default. Each file runs in a process of
its own; the result per file: the exit status, the seconds, the steps trained and their losses, the peak RSS of the
process tree (``resource.getrusage(RUSAGE_CHILDREN)`` of a runner process per file), or the failure's last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"lora.yaml": "finetune/lora.py", "qlora.yaml": "finetune/lora.py", "full.yaml": "finetune/full.py"}
# the settings of litgpt's instruction modules that litgpt.data.JSON also takes
TIMEOUT_S = 900
JSON_SETTINGS = ("mask_prompt", "val_split_fraction", "prompt_style", "ignore_index", "seed", "num_workers")


def script_for(path: Path) -> str | None:
    if path.parent.name == "pretrain":
        return "pretrain/pretrain.py"
    return SCRIPTS.get(path.name)


def small_config(settings: dict):
    """The file's architecture, small: from its model_config block, its model_name, or its checkpoint dir's name."""
    from litgpt import Config

    from memfit.training.random_checkpoints import same_architecture_small

    if settings.get("model_config"):
        block = {k: v for k, v in settings["model_config"].items() if k != "hf_config"}
        config = Config(**block)
        return Config(**{**block, **same_architecture_small(config)})
    name = settings.get("model_name") or Path(settings["checkpoint_dir"]).name
    return Config.from_name(name, **same_architecture_small(Config.from_name(name)))


def small_checkpoint(path: Path, work: Path):
    """The small random-weight checkpoint of the file's architecture under ``work`` (written unless it is there), and
    its config."""
    from memfit.training.random_checkpoints import write_random_checkpoint

    config = small_config(yaml.safe_load(path.read_text()))
    checkpoint = work / "checkpoints" / f"{config.name}-small"
    if not (checkpoint / "lit_model.pth").is_file():
        write_random_checkpoint(config, checkpoint, name=f"{config.name}-small")
    return checkpoint, config


def swapped_args(path: Path, work: Path, data_dir: Path) -> list[str]:
    """The command line after the script: the file, then only the swaps and the length (see the module's text)."""
    settings = yaml.safe_load(path.read_text())
    checkpoint, config = small_checkpoint(path, work)
    args = ["--config", str(path), "--out_dir", str(work / "out" / path.parent.name / path.stem)]
    args += ["--profile_dir", str(work / "profiles" / path.parent.name / path.stem)]
    args += ["--train.max_steps", "2", "--eval.max_iters", "2"]
    if script_for(path) == "pretrain/pretrain.py":
        model_config = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        model_config.pop("hf_config", None)
        args += ["--model_config", json.dumps(model_config), "--tokenizer_dir", str(checkpoint)]
        args += ["--data", "PlainText", "--data.path", str(data_dir / "tinyshakespeare.txt")]
    else:
        init_args = (settings.get("data") or {}).get("init_args") or {}
        json_data = {k: v for k, v in init_args.items() if k in JSON_SETTINGS}
        json_data["json_path"] = str(data_dir / "alpaca_5000.json")
        # the file's 4 DataLoader workers a process would be 16 processes for a 4-device file on 2 cores, each
        # importing torch, to read records already in memory: the data is read in the training process
        json_data["num_workers"] = 0
        args += ["--checkpoint_dir", str(checkpoint)]
        args += ["--data", json.dumps({"class_path": "litgpt.data.JSON", "init_args": json_data})]
    return args


def run(hub: Path, path: Path, work: Path, data_dir: Path) -> dict:
    script = script_for(path)
    args = [sys.executable, str(ROOT / script), *swapped_args(path, work, data_dir)]
    started = time.perf_counter()
    # a runner process per file, so RUSAGE_CHILDREN is this run's process tree alone (the scripts start their own
    # processes for devices > 1)
    runner = (
        "import resource, subprocess, sys, json; r = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
        " print(json.dumps({'rc': r.returncode, 'stdout': r.stdout, 'stderr': r.stderr,"
        " 'maxrss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", runner, *args], cwd=work, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        result = json.loads(done.stdout)
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as error:  # a hung or killed run is a result too
        result = {"rc": -1, "stdout": "", "stderr": f"{type(error).__name__}: {error}", "maxrss_kib": 0}
    entry = {
        "file": str(path.relative_to(hub)),
        "script": script,
        "returncode": result["rc"],
        "seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mib_largest_process": round(result["maxrss_kib"] / 1024),
    }
    summaries = sorted((work / "profiles" / path.parent.name / path.stem).glob("*/summary.json"))
    if result["rc"] == 0 and summaries:
        summary = json.loads(summaries[-1].read_text())
        entry["settings"] = next((line.strip() for line in result["stdout"].splitlines() if "precision" in line), "")
        entry["steps"] = summary["steps"]
        entry["first_loss"], entry["last_loss"] = summary["first_loss"], summary["last_loss"]
        entry["val_loss"] = summary["val_loss"]
        entry["ledger_peak_bytes"] = summary["ledger_peak_bytes"]
    else:
        entry["error"] = (result["stderr"].strip().splitlines() or [""])[-1][:300]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hub", type=Path, default=ROOT.parent / "shared" / "litgpt_config_hub")
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/hub_runs.json")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="files relative to --hub (default: all)")
    args = parser.parse_args()
    if not args.hub.is_dir():
        sys.exit(f"error: --hub {str(args.hub)!r} is not a directory: give litgpt's config_hub folder")
    files = sorted(p for p in args.hub.rglob("*.yaml") if script_for(p) is not None)
    if args.only:
        files = [p for p in files if str(p.relative_to(args.hub)) in args.only]
    with tempfile.TemporaryDirectory() as work:
        # the checkpoints first, from this thread alone (lora.yaml and qlora.yaml share one), then the runs
        for path in files:
            small_checkpoint(path, Path(work))
        results = []
        with ThreadPoolExecutor(args.jobs) as pool:
            for result in pool.map(lambda p: run(args.hub, p, Path(work), args.data), files):
                results.append(result)
                write(args.out, results)  # as each finishes: a long benchmark keeps what it has measured
                print(f"{result['file']}: exit {result['returncode']} in {result['seconds']} s", flush=True)
    failed = write(args.out, results)
    print(f"{len(results) - len(failed)} of {len(results)} hub files trained; wrote {args.out}")
    for r in failed:
        print(f"  {r['file']}: {r['error']}")


def write(out: Path, results: list[dict]) -> list[dict]:
    failed = [r for r in results if r["returncode"]]
    report = {
        "what": "python <script> --config <hub file> with the model and data swapped for local ones, 2 steps",
        "hub": "litgpt v0.5.13 config_hub",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "files": len(results),
        "failed": len(failed),
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return failed


if __name__ == "__main__":
    main()
