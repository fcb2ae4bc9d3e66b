"""What torch's DDP holds while it rebuilds its gradient buckets at the second step, in a plain DDP loop without Memfit.

    python benchmarks/ddp_first_bucket.py --out profiles/cpu/ddp_first_bucket.json

torch's reducer trains the first step with every gradient in one bucket and rebuilds the buckets in the order
backward made the gradients at the second step's forward (``_rebuild_buckets``). Two CPU processes over gloo train
eight 512 x 512 linear layers with AdamW for six steps under the profiler with memory, started before DDP wraps the
model (the CPU profiler reports no free of a block made before it started), each step in a ``record_function``. For
each step: its net bytes (allocations less frees inside it: what it leaves alive) and its highest bytes alive above
what it started with (from the trace's running total). Run for ``gradient_as_bucket_view`` on with zero_grad in place
(Memfit's DDP) and to None, and off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def train(rank: int, view: bool, to_none: bool, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    # the profiler starts before DDP makes its first bucket: it reports no free of a block made before it started
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        with record_function("wrap"):
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=view)
        optimizer = torch.optim.AdamW(ddp.parameters())
        for step in range(1, STEPS + 1):
            with record_function(f"step {step}"):
                ddp(torch.randn(4, 512)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=to_none)
    if rank == 0:
        net = {e.name: e.cpu_memory_usage for e in profiler.events() if e.name.startswith(("step ", "wrap"))}
        # each step's highest bytes alive above what it started with, from the trace's running total
        trace = Path(out).with_suffix(".trace.json")
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        steps = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("step ")}
        memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
        rise = {}
        for name, (start, end) in steps.items():
            before = [total for ts, total in memory if ts < start]
            inside = [total for ts, total in memory if start <= ts <= end]
            rise[name] = max(inside) - (before[-1] if before else 0)
        Path(out).write_text(json.dumps({"net": net, "highest_above_start": rise}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/ddp_first_bucket.json")
    args = parser.parse_args()
    gradient_bytes = 8 * (512 * 512 + 512) * 4
    cases = []
    for view, to_none in ((True, False), (True, True), (False, False)):
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            torch.multiprocessing.spawn(train, args=(view, to_none, result.name), nprocs=2)
            measured = json.loads(Path(result.name).read_text())
        net, rise = measured["net"], measured["highest_above_start"]
        case = {
            "gradient_as_bucket_view": view,
            "zero_grad_set_to_none": to_none,
            "net_bytes_by_step": net,
            "highest_bytes_above_the_step_start": rise,
            # the first bucket freed in the rebuild (nothing left alive by step 2), the new ones made before it was
            "first_bucket_freed": net["step 2"] == 0,
            "step_2_rise_over_step_3": rise["step 2"] - rise["step 3"],
        }
        print(json.dumps(case), flush=True)
        cases.append(case)
    document = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": f"{platform.machine()}, {os.cpu_count()} cores, 2 processes over gloo",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join(["python", "benchmarks/ddp_first_bucket.py", *sys.argv[1:]]),
        "measures": (
            "each step's net bytes (allocations less frees inside its record_function, the profiler's memory events) on"
            f" rank 0, {STEPS} steps of a plain DDP loop; the gradients are {gradient_bytes} bytes"
        ),
        "gradient_bytes": gradient_bytes,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
