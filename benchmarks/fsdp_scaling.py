"""What one rank of FSDP holds, against the ideal 1/N share and against ``--estimate``, for N = 1, 2 and 4 processes.

    python benchmarks/fsdp_scaling.py --out profiles/cpu/fsdp_scaling.json

Two architectures with random weights (a Llama made small): ``blocks``, 16 blocks holding 96% of the parameters
(n_embd 256, a 1,024-token vocabulary: 14.1 M parameters), and ``llama``, a Llama-3.2-1B-like share of embedding
and head (8 blocks, a 4,096-token vocabulary untied: 25% of 8.4 M parameters outside the blocks). Each is fine-tuned
in full and with LoRA, 32-true and AdamW, on N CPU processes over gloo (``--strategy fsdp``; one process is the
plain script), with 1 and 4 micro-batches of 2 per rank, on data whose every sample is exactly 32 tokens long (so
every micro-batch has the shape the estimate assumes). Each run is a fresh process. ``--architectures
large_vocabulary`` (not in the default table) is a model whose embedding and head each outweigh a block five times,
as a real model's vocabulary does; ``deep_blocks`` is the blocks model with 32 blocks. ``--reestimate REPORT`` re-runs
only the estimates against a report's measured peaks (a change to the estimate, checked against every row in a minute).

Figures per configuration, all rank 0's: ``measured`` is the ledger's peak (the profiler's count of live tensor
bytes in the profiled step, the highest phase); ``ideal`` is the model's weights, gradients and AdamW state over N
(for LoRA: the frozen base and the LoRA weights with their gradients and state, over N); ``predicted`` is what
``--estimate`` prints for the same flags; ``peer`` is rank 0's peak in the same configuration with
torch's FSDP2 driven as torchtitan drives it and no Memfit code in the loop (``benchmarks/fsdp_peer.py``), measured
the same way. The report gives measured / ideal, measured / peer and predicted / measured.

The ideal leaves out what data parallelism does not shard and every FSDP holds: a micro-batch's activations, the
units gathered around their use (the block computing and the one prefetched), the gradients of the block being
reduce-scattered. Where those are large beside a rank's share (small models, many processes) measured / ideal is
well above 1 for the peer too; measured / peer says whether Memfit holds more than the reference does.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from estimate_accuracy import fixed_length_records  # noqa: E402  (after the path)

from memfit.training.precision import cpu_description  # noqa: E402

ARCHITECTURES = {
    "blocks": dict(n_layer=16, n_embd=256, n_head=8, n_query_groups=8, intermediate_size=768, vocab_size=1024),
    "llama": dict(n_layer=8, n_embd=256, n_head=8, n_query_groups=8, intermediate_size=688, vocab_size=4096),
    # twice the blocks model's depth: a gathered block is half as large a part of a rank's share; not in the default
    # table
    "deep_blocks": dict(n_layer=32, n_embd=256, n_head=8, n_query_groups=8, intermediate_size=768, vocab_size=1024),
    # the embedding and the head each outweigh a block five times (16 MiB against 3 MiB), as a real model's
    # vocabulary does (Llama-3-8B: 1.0 GB against 0.44 GB in bf16); not in the default table
    "large_vocabulary": dict(
        n_layer=4, n_embd=256, n_head=8, n_query_groups=8, intermediate_size=688, vocab_size=16384
    ),
}
SEQUENCE_LENGTH = 32
MICRO_BATCH = 2


def make_checkpoint(name: str, parent: Path) -> Path:
    import torch
    from litgpt import Config

    from memfit.training.random_checkpoints import write_random_checkpoint

    fields = ARCHITECTURES[name]
    head_size = fields["n_embd"] // fields["n_head"]
    config = Config.from_name("Llama-3.2-1B", **fields, padded_vocab_size=fields["vocab_size"], head_size=head_size)
    config.name = f"fsdp-scaling-{name}"
    return write_random_checkpoint(config, parent / name, dtype=torch.float32)


def parameter_counts(checkpoint: Path, method: str) -> tuple[int, int]:
    """(all parameters, trained ones) of the model the script builds (LoRA: lora.py's defaults, query and value)."""
    import torch
    from litgpt import lora
    from litgpt.model import GPT

    path = checkpoint / "model_config.yaml"
    with torch.device("meta"):
        if method == "lora":
            model = lora.GPT(lora.Config.from_file(path, lora_r=8, lora_alpha=16, lora_query=True, lora_value=True))
            lora.mark_only_lora_as_trainable(model)
        else:
            model = GPT(lora.Config.from_file(path))
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


def run(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as stopped:
        return subprocess.CompletedProcess(command, 124, stdout="", stderr=f"stopped after {stopped.timeout:.0f} s")


def printed_bytes(text: str) -> float:
    """Bytes from the first figure of ``text`` as the estimate prints figures ("1,234.56 MiB")."""
    value, unit = text.split()[:2]
    return float(value.replace(",", "")) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[unit]


def predicted_bytes(stdout: str) -> float:
    return printed_bytes(stdout.split("Predicted peak: ")[1])


def gloo_bytes(stdout: str) -> float:
    """What the estimate says gloo's own copies may add to the peak (0 on one process)."""
    return printed_bytes(stdout.split("plus up to ")[1]) if "under gloo" in stdout else 0.0


def within_range(entry: dict) -> bool:
    """The measured peak lies between the estimate and the estimate plus gloo's copies, 3% either side."""
    measured, low = entry["measured_bytes"], entry["predicted_bytes"]
    return low - 0.03 * measured <= measured <= low + entry["gloo_bytes"] + 0.03 * measured


def blocks_checkpointed(text: str) -> bool | int:
    """``--activation_checkpointing`` as the scripts take it: true (every block), false, or a number of blocks."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return int(text)


def checkpointed_suffix(setting: bool | int) -> str:
    """A run's name's mark of what it checkpoints: every block, a number of them, or none."""
    if setting is True:
        return "-checkpointed"
    return f"-{setting}-checkpointed" if setting else ""


def script_command(
    method: str,
    checkpoint: Path,
    json_path: Path,
    world_size: int,
    micro_batches: int,
    fsdp: list[str],
    activation_checkpointing: bool | int,
) -> list[str]:
    """The script's command line for one configuration, without ``--estimate`` or the run's own flags."""
    strategy = ["--devices", str(world_size)]
    strategy += ["--strategy", "fsdp", *fsdp] if world_size > 1 else []
    command = [
        sys.executable,
        str(ROOT / f"finetune/{method}.py"),
        "--checkpoint_dir",
        str(checkpoint),
        "--accelerator",
        "cpu",
        "--precision",
        "32-true",
        *strategy,
        "--data",
        "JSON",
        "--data.json_path",
        str(json_path),
        "--data.val_split_fraction",
        "0.05",
        "--data.mask_prompt",
        "false",
        "--data.num_workers",
        "0",
        "--train.max_seq_length",
        str(SEQUENCE_LENGTH),
        "--train.micro_batch_size",
        str(MICRO_BATCH),
        "--train.global_batch_size",
        str(MICRO_BATCH * micro_batches * world_size),
        "--profile.wait",
        "1",
        "--profile.warmup",
        "1",
        "--profile.active",
        "1",
    ]
    if method == "lora":
        command += ["--lora_dropout", "0"]
    if activation_checkpointing:  # true (every block) or a number of blocks
        command += ["--activation_checkpointing", str(activation_checkpointing).lower()]
    return command


def three_steps(run_dir: Path) -> list[str]:
    """The measured run's own flags: 3 steps, no validation, its profile and checkpoints under ``run_dir``."""
    return [
        "--train.max_steps",
        "3",
        "--eval.final_validation",
        "false",
        "--eval.interval",
        "1000",
        "--logger_name",
        "csv",
        "--profile_dir",
        str(run_dir),
        "--out_dir",
        str(run_dir / "out"),
    ]


def reestimate(report_path: Path, out: Path, timeout: float) -> None:
    """Today's ``--estimate`` against a report's measured peaks, re-measuring nothing: a change to the estimate is
    checked against every configuration in a minute instead of the benchmark's twenty."""
    report = json.loads(report_path.read_text())
    work = Path(tempfile.mkdtemp(prefix="memfit-fsdp-reestimate-"))
    json_path = work / "fixed_length.json"
    json_path.write_text(json.dumps(fixed_length_records(256, 2 * SEQUENCE_LENGTH)))
    checkpoints: dict[str, Path] = {}
    for entry in report["results"]:
        if "measured_bytes" not in entry:
            continue
        architecture = entry["architecture"]
        if architecture not in checkpoints:
            checkpoints[architecture] = make_checkpoint(architecture, work)
        command = script_command(
            entry["method"],
            checkpoints[architecture],
            json_path,
            entry["world_size"],
            entry["micro_batches_per_rank"],
            report.get("fsdp_flags", []),
            entry.get("activation_checkpointing", False),
        )
        estimate = run([*command, "--estimate", "true"], work, timeout)
        if estimate.returncode:
            raise SystemExit(f"{entry['name']}: the estimate failed: {estimate.stderr[-1500:]}")
        entry["predicted_bytes"] = predicted_bytes(estimate.stdout)
        entry["gloo_bytes"] = gloo_bytes(estimate.stdout)
        entry["predicted_over_measured"] = round(entry["predicted_bytes"] / entry["measured_bytes"], 3)
        entry["within_estimates_range"] = within_range(entry)
        print(json.dumps({k: entry[k] for k in ("name", "predicted_over_measured")}), flush=True)
    report["reestimated"] = time.strftime("%Y-%m-%d") + ": the estimates only, against the measured peaks above"
    report["command"] += "; then the estimates: python benchmarks/fsdp_scaling.py " + " ".join(sys.argv[1:])
    out.write_text(json.dumps(report, indent=2))
    print(table(report["results"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/fsdp_scaling.json")
    parser.add_argument("--architectures", nargs="*", default=["blocks", "llama"], choices=list(ARCHITECTURES))
    parser.add_argument("--methods", nargs="*", default=["full", "lora"])
    parser.add_argument("--world_sizes", nargs="*", type=int, default=[1, 2, 4])
    parser.add_argument("--micro_batches", nargs="*", type=int, default=[1, 4], help="micro-batches per rank")
    parser.add_argument("--fsdp", nargs="*", default=[], help="more --fsdp.* flags for every FSDP run")
    parser.add_argument(
        "--activation_checkpointing",
        type=blocks_checkpointed,
        default=False,
        help="true, false or a number of blocks every run (the peer's too) checkpoints, spread from the first",
    )
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--table", type=Path, help="print the table of a report this wrote, and run nothing")
    parser.add_argument(
        "--reestimate", type=Path, help="a report this wrote: today's estimates against its measured peaks, to --out"
    )
    args = parser.parse_args()
    if args.reestimate:
        reestimate(args.reestimate, args.out, args.timeout)
        return
    if args.table:
        print(table(json.loads(args.table.read_text())["results"]))
        return

    work = Path(tempfile.mkdtemp(prefix="memfit-fsdp-scaling-"))
    json_path = work / "fixed_length.json"
    json_path.write_text(json.dumps(fixed_length_records(256, 2 * SEQUENCE_LENGTH)))
    results = []
    report = {
        "machine": cpu_description(),
        "versions": {
            "torch": importlib.metadata.version("torch"),
            "python": platform.python_version(),
            **{m: importlib.metadata.version(m) for m in ("lightning", "litgpt")},
        },
        "measures": "rank 0's peak of live tensor bytes in the profiled step (CPU, the ledger), 32-true, AdamW",
        "command": "python benchmarks/fsdp_scaling.py " + " ".join(sys.argv[1:]),
        "fsdp_flags": args.fsdp,
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for architecture in args.architectures:
        checkpoint = make_checkpoint(architecture, work)
        for method in args.methods:
            parameters, trained = parameter_counts(checkpoint, method)
            for world_size in args.world_sizes:
                for micro_batches in args.micro_batches:
                    name = f"{architecture}-{method}-x{world_size}-mb{micro_batches}"
                    name += checkpointed_suffix(args.activation_checkpointing)
                    common = script_command(
                        method,
                        checkpoint,
                        json_path,
                        world_size,
                        micro_batches,
                        args.fsdp,
                        args.activation_checkpointing,
                    )
                    started = time.time()
                    estimate = run([*common, "--estimate", "true"], work, args.timeout)
                    trained_run = run([*common, *three_steps(work / name)], work, args.timeout)
                    ideal = (parameters * 4 + trained * 4 * 3) / world_size  # float32 weights, gradients, 2 moments
                    entry = {
                        "name": name,
                        "architecture": architecture,
                        "method": method,
                        "world_size": world_size,
                        "micro_batches_per_rank": micro_batches,
                        "activation_checkpointing": args.activation_checkpointing,
                        "parameters": parameters,
                        "trained": trained,
                        "ideal_bytes": ideal,
                        "seconds": round(time.time() - started, 1),
                    }
                    # the peer's FSDP, driven as torchtitan drives it (benchmarks/fsdp_peer.py)
                    peer_out = work / name / "peer.json"
                    peer_run = run(
                        [
                            sys.executable,
                            "-m",
                            "torch.distributed.run",
                            "--standalone",
                            "--nproc_per_node",
                            str(world_size),
                            str(ROOT / "benchmarks/fsdp_peer.py"),
                            "--method",
                            method,
                            "--checkpoint_dir",
                            str(checkpoint),
                            "--micro_batches",
                            str(micro_batches),
                            "--micro_batch_size",
                            str(MICRO_BATCH),
                            "--sequence_length",
                            str(SEQUENCE_LENGTH),
                            "--out",
                            str(peer_out),
                            *(
                                ["--activation_checkpointing", str(args.activation_checkpointing).lower()]
                                if args.activation_checkpointing
                                else []
                            ),
                        ],
                        work,
                        args.timeout,
                    )
                    if peer_run.returncode:
                        entry["peer_error"] = peer_run.stderr[-1500:].strip()
                    else:
                        entry["peer_bytes"] = json.loads(peer_out.read_text())["peak_bytes"]
                    if estimate.returncode or trained_run.returncode:
                        entry["error"] = (estimate.stderr[-1500:] + trained_run.stderr[-1500:]).strip()
                    else:
                        (ledger_file,) = (work / name).glob("*/ledger.json")
                        ledger = json.loads(ledger_file.read_text())
                        phase, peak = max(ledger["phases"].items(), key=lambda item: item[1]["peak_bytes"])
                        entry.update(
                            measured_bytes=peak["peak_bytes"],
                            measured_phase=phase,
                            found_at_peak_bytes=peak["found_at_peak_bytes"],
                            not_found_bytes=peak.get("not_found_bytes", 0),
                            predicted_bytes=predicted_bytes(estimate.stdout),
                            gloo_bytes=gloo_bytes(estimate.stdout),
                        )
                        entry["within_estimates_range"] = within_range(entry)
                        entry["measured_over_ideal"] = round(entry["measured_bytes"] / ideal, 3)
                        entry["predicted_over_measured"] = round(entry["predicted_bytes"] / entry["measured_bytes"], 3)
                        if "peer_bytes" in entry:
                            entry["measured_over_peer"] = round(entry["measured_bytes"] / entry["peer_bytes"], 3)
                    results.append(entry)
                    print(
                        json.dumps(
                            {
                                k: entry.get(k)
                                for k in (
                                    "name",
                                    "measured_over_ideal",
                                    "measured_over_peer",
                                    "predicted_over_measured",
                                    "error",
                                )
                            }
                        ),
                        flush=True,
                    )
                    args.out.write_text(json.dumps(report, indent=2))  # after each, so a stopped run keeps its part
    print(table(results))


def table(results: list[dict]) -> str:
    """The report as a markdown table: what rank 0 held at its peak beside its ideal share, by role."""
    lines = [
        "| model | method | N | micro-batches a rank | measured MiB | ideal MiB | measured / ideal | gathered |"
        " activations | reduce-scatter input and not found | estimate MiB | estimate / measured | gloo may add MiB |"
        " in the estimate's range | peer MiB | measured / peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = lambda n: f"{n / 2**20:.1f}"
    for r in results:
        model = r["architecture"] + checkpointed_suffix(r.get("activation_checkpointing", False)).replace("-", ", ", 1)
        head = f"| {model} | {r['method']} | {r['world_size']} | {r['micro_batches_per_rank']} |"
        if "error" in r:
            lines.append(f"{head} failed | | | | | | | | | | | |")
            continue
        found = r["found_at_peak_bytes"]
        lines.append(
            f"{head} {mib(r['measured_bytes'])} | {mib(r['ideal_bytes'])} | {r['measured_over_ideal']:.2f} |"
            f" {mib(found.get('gathered_params', 0))} | {mib(found.get('activations', 0))} |"
            f" {mib(found.get('unattributed', 0) + r['not_found_bytes'])} | {mib(r['predicted_bytes'])} |"
            f" {r['predicted_over_measured']:.3f} | {mib(r.get('gloo_bytes', 0))} |"
            f" {'yes' if r.get('within_estimates_range') else 'no'} |"
            + (f" {mib(r['peer_bytes'])} | {r['measured_over_peer']:.3f} |" if "peer_bytes" in r else " | |")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
