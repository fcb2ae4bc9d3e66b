"""Each rank's host memory (peak RSS) against the range ``--estimate`` gives for it, on 1, 2 and 4 CPU processes.

    python benchmarks/host_memory.py --out profiles/cpu/host_memory.json

The models and data of ``benchmarks/fsdp_scaling.py`` (random weights, every sample 32 tokens), fine-tuned for 3 steps
with the profiler off (its window holds host memory of its own, which ``--estimate`` states on a line apart). Figures
per configuration: every rank's peak RSS and anonymous memory at the end, as the run reports them (``host_per_rank``
in its summary), and the estimate's "Host memory" line for the same flags: the tensors' peak, the runtime beside it
(``memfit.prediction.estimate.CPU_RUNTIME_RSS_BYTES``) and, over gloo, up to ``GLOO_HEAP_RSS_BYTES`` more.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from estimate_accuracy import fixed_length_records  # noqa: E402  (after the path)
from fsdp_scaling import (  # noqa: E402
    SEQUENCE_LENGTH,
    make_checkpoint,
    printed_bytes,
    run,
    script_command,
    three_steps,
)

from memfit.training.precision import cpu_description  # noqa: E402

CONFIGURATIONS = [
    # (architecture, method, processes)
    ("blocks", "full", 1),
    ("blocks", "full", 2),
    ("blocks", "full", 4),
    ("blocks", "lora", 2),
    ("llama", "lora", 1),
    ("llama", "lora", 2),
    ("llama", "full", 2),
    ("llama", "full", 4),
]
MIB = 2**20


def host_range(stdout: str) -> tuple[float, float]:
    """(low, high) in bytes from the estimate's "Host memory ..." line (one figure on one process: both the same)."""
    line = next(line for line in stdout.splitlines() if line.startswith("Host memory"))
    figures = line.split("(peak RSS): ")[1].split(": ")[0].removeprefix("about ").split(" to ")
    return printed_bytes(figures[0]), printed_bytes(figures[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/host_memory.json")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="memfit-host-memory-"))
    json_path = work / "fixed_length.json"
    json_path.write_text(json.dumps(fixed_length_records(256, 2 * SEQUENCE_LENGTH)))
    results = []
    report = {
        "machine": cpu_description(),
        "versions": {m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt")},
        "measures": "each rank's peak RSS (VmHWM) over a 3-step run, profiler off; the estimate's host memory range",
        "command": "python benchmarks/host_memory.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    checkpoints = {}
    for architecture, method, processes in CONFIGURATIONS:
        if architecture not in checkpoints:
            checkpoints[architecture] = make_checkpoint(architecture, work)
        name = f"{architecture}-{method}-x{processes}"
        # the profiler off (given after the window's flags, it wins): its window holds host memory of its own
        command = script_command(method, checkpoints[architecture], json_path, processes, 1, [], False)
        common = [*command, "--profile.enabled", "false"]
        estimate = run([*common, "--estimate", "true"], work, args.timeout)
        trained = run([*common, *three_steps(work / name)], work, args.timeout)
        entry = {"name": name, "architecture": architecture, "method": method, "processes": processes}
        if estimate.returncode or trained.returncode:
            entry["error"] = (estimate.stderr[-1500:] + trained.stderr[-1500:]).strip()
        else:
            (summary_file,) = (work / name).glob("*/summary.json")
            summary = json.loads(summary_file.read_text())
            low, high = host_range(estimate.stdout)
            hosts = summary["host_per_rank"]
            entry.update(
                predicted_low_bytes=low,
                predicted_high_bytes=high,
                peak_rss_bytes=[rank["peak_rss"] for rank in hosts],
                anonymous_at_end_bytes=[rank["anonymous"] for rank in hosts],
                within=all(0.95 * low <= rank["peak_rss"] <= 1.05 * high for rank in hosts),
            )
        results.append(entry)
        print(json.dumps({k: entry.get(k) for k in ("name", "within", "error")}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(table(results))


def table(results: list[dict]) -> str:
    lines = [
        "| model | method | N | peak RSS per rank MiB | estimate MiB | within 5% |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        head = f"| {r['architecture']} | {r['method']} | {r['processes']} |"
        if "error" in r:
            lines.append(f"{head} failed | | |")
            continue
        ranks = ", ".join(f"{b / MIB:.0f}" for b in r["peak_rss_bytes"])
        low, high = r["predicted_low_bytes"] / MIB, r["predicted_high_bytes"] / MIB
        predicted = f"{low:.0f}" if low == high else f"{low:.0f}-{high:.0f}"
        lines.append(f"{head} {ranks} | {predicted} | {'yes' if r['within'] else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
