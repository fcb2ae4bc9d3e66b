"""Three ways to load a litgpt checkpoint of over 1 GB, each in a fresh process, alternated in one run.

    python benchmarks/loading.py --model pythia-1b --repeats 2 --out profiles/cpu/loading.json

- ``plain``: what most code does: build the model in memory, ``torch.load`` the whole file, ``load_state_dict``.
- ``memfit``: ``memfit.training.loading.load_model``: built on the meta device, the file memory-mapped
  (``torch.load(mmap=True, weights_only=True)``) and assigned (``load_state_dict(assign=True)``).
- ``memfit_nf4``: the same with ``--quantize bnb.nf4``, each layer quantized as it loads.

The checkpoint is the named litgpt architecture with random weights in bf16 (loading cost does not depend on the
values). Each mode reports, relative to the process just before loading: the peak growth of anonymous memory
(``RssAnon``: private pages; a memory-mapped file's pages are ``RssFile``, which the kernel can drop), the peak growth
of the whole RSS (``VmHWM``, reset before loading), and the time to a loaded model (then one forward pass checks it
works, timed apart); on a GPU
(``--device cuda``) also ``torch.cuda.max_memory_allocated``. Goals (issue 10): Memfit adds under 0.1x the file to
anonymous memory unquantized, under 0.4x with nf4.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODES = ("plain", "memfit", "memfit_nf4")


def probe(mode: str, checkpoint_dir: Path, device: str) -> dict:
    """Runs in its own process: loads one way and measures it."""
    from litgpt import GPT, Config

    from memfit.memory import proc_status
    from memfit.training.loading import load_model
    from memfit.training.quantizers import QUANTIZERS

    config = Config.from_file(checkpoint_dir / "model_config.yaml")
    path = checkpoint_dir / "lit_model.pth"
    target = torch.device(device)
    if mode == "memfit_nf4":
        from memfit.training.bitsandbytes_layers import import_bitsandbytes

        import_bitsandbytes()  # its import is not loading cost
    if target.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so the peak below is the loading's
    baseline = proc_status()
    peak_anon = baseline["RssAnon"]
    done = threading.Event()

    def sample() -> None:  # RssAnon has no high-water mark of its own
        nonlocal peak_anon
        while not done.is_set():
            peak_anon = max(peak_anon, proc_status()["RssAnon"])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    if mode == "plain":
        with target:
            torch.set_default_dtype(torch.bfloat16)
            model = GPT(config)
        model.load_state_dict(torch.load(path, weights_only=True, map_location=target))
    else:
        model = load_model(
            GPT,
            config,
            path,
            dtype=torch.bfloat16,
            device=target,
            quantize=QUANTIZERS["bnb.nf4"] if mode == "memfit_nf4" else None,
        )
        # load_model fills the model where its checkpoint lies (memory-mapped on the host) and the recipes' fabric.setup
        # moves it to the device (bitsandbytes quantizes there): loading ends with the model on the device
        model = model.to(target)
    if target.type == "cuda":
        torch.cuda.synchronize()
        loaded_peak = torch.cuda.max_memory_allocated()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    end = proc_status()
    result = {
        "anon_added_peak_bytes": max(peak_anon, end["RssAnon"]) - baseline["RssAnon"],
        "rss_added_peak_bytes": end["VmHWM"] - baseline["VmRSS"],
        "seconds": seconds,
    }
    started = time.perf_counter()
    with torch.no_grad():  # the model is usable: one forward pass (after the measurement: its activations and
        model.max_seq_length = 16  # dequantized weights are not loading's)
        model(torch.randint(0, 100, (1, 16), device=target))
    result["first_forward_seconds"] = time.perf_counter() - started
    if target.type == "cuda":
        result["cuda_max_allocated_bytes"] = loaded_peak  # loading's, before the forward's activations
        result["cuda_max_allocated_with_forward_bytes"] = torch.cuda.max_memory_allocated()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="pythia-1b", help="a litgpt architecture name (weights are random)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=None,
        help="where random-weight checkpoints are made, and reused by later benchmarks (default: a temporary dir)",
    )
    parser.add_argument("--probe", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe[0], Path(args.probe[1]), args.device)))
        return

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA GPU is visible")
    from memfit.training.random_checkpoints import random_checkpoint
    from memfit.units import fmt_bytes

    with tempfile.TemporaryDirectory() as work:
        checkpoint = random_checkpoint(args.model, args.checkpoints or Path(work))
        size = (checkpoint / "lit_model.pth").stat().st_size
        runs = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:  # alternated, so drift in the machine's state spreads over every mode
                child = subprocess.run(
                    [sys.executable, __file__, "--device", args.device, "--probe", mode, str(checkpoint)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs[mode].append(json.loads(child.stdout.strip().splitlines()[-1]))
    median = {
        mode: {key: statistics.median(r[key] for r in results) for key in results[0]} for mode, results in runs.items()
    }
    for mode in MODES:
        m = median[mode]
        print(
            f"{mode:11s} RssAnon +{fmt_bytes(m['anon_added_peak_bytes'])} ({m['anon_added_peak_bytes'] / size:.1%} of"
            f" the file)  RSS +{fmt_bytes(m['rss_added_peak_bytes'])}  {m['seconds']:.1f} s"
            + (f"  CUDA {fmt_bytes(m['cuda_max_allocated_bytes'])}" if "cuda_max_allocated_bytes" in m else "")
        )
    from memfit.training.precision import (
        cpu_description,  # here, not at the top: the probes' processes measure their imports
    )

    result = {
        "what": "loading a litgpt checkpoint three ways, each in a fresh process, alternated",
        "device": (torch.cuda.get_device_name() if args.device == "cuda" else cpu_description()),
        "measures": "peak growth over the process just before loading: RssAnon (sampled every 2 ms), VmHWM-VmRSS"
        " (whole RSS, file pages included), while loading; seconds to a loaded model, and to its first"
        " forward pass apart",
        "versions": {name: importlib.metadata.version(name) for name in ("torch", "litgpt", "bitsandbytes")}
        | {"python": platform.python_version()},
        "command": " ".join(["python", "benchmarks/loading.py", *sys.argv[1:]]),
        "date": date.today().isoformat(),
        "model": args.model,
        "file_bytes": size,
        "runs": runs,
        "median": median,
        "anon_added_over_file": {mode: median[mode]["anon_added_peak_bytes"] / size for mode in MODES},
        "goals": {"memfit": "< 0.1", "memfit_nf4": "< 0.4"},
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
