"""What torch's DDP holds while it rebuilds its gradient buckets at the second step, in a plain DDP loop.

    python benchmarks/ddp_first_bucket.py --out profiles/cpu/ddp_first_bucket.json

torch's reducer trains the first step with every gradient in one bucket and rebuilds the buckets in the order
backward made the gradients at the second step's forward (``_rebuild_buckets``). Two CPU processes over gloo train
eight 512 x 512 linear layers with AdamW for six steps under the profiler with memory, started before DDP wraps the
model (the CPU profiler reports no free of a block made before it started), each step in a ``record_function``. For
each step: its net bytes (allocations less frees inside it: what it leaves alive) and its highest bytes alive above
what it started with (from the trace's running total). Run for ``gradient_as_bucket_view`` on with zero_grad in place
and to None, as Memfit's scripts choose, and off.
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
sys.path.insert(0, str(ROOT))  # memfit, when run from anywhere
STEPS = 6


ZERO_GRAD = ("in place", "to None", "memfit")
"""How a step's zero_grad treats the gradients: zeroed in place, freed, or as
``memfit.training.strategy.keeps_gradient_buckets`` chooses (the scripts' zero_grad)"""


def train(rank: int, cases: list[tuple[bool, str]], out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = [_train_one(rank, view, zero_grad, Path(out)) for view, zero_grad in cases]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _train_one(rank: int, view: bool, zero_grad: str, out: Path) -> dict:
    from types import SimpleNamespace

    from lightning.fabric.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, record_function

    from memfit.training.strategy import keeps_gradient_buckets

    torch.manual_seed(0)
    # the profiler starts before DDP makes its first bucket: it reports no free of a block made before it started
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        with record_function("wrap"):
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=view)
        optimizer = torch.optim.AdamW(ddp.parameters())
        # what the scripts' zero_grad reads: Fabric's strategy, and its module around the DDP one
        fabric, wrapped = SimpleNamespace(strategy=DDPStrategy()), SimpleNamespace(_forward_module=ddp)
        for step in range(1, STEPS + 1):
            with record_function(f"step {step}"):
                ddp(torch.randn(4, 512)).square().mean().backward()
                optimizer.step()
                if zero_grad == "memfit":
                    optimizer.zero_grad(set_to_none=not keeps_gradient_buckets(fabric, wrapped, micro_batches=1))
                else:
                    optimizer.zero_grad(set_to_none=zero_grad == "to None")
    if rank != 0:
        return {}
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
    weights = [p.detach().double().sum().item() for p in model.parameters()]
    trace.unlink()
    return {"net": net, "highest_above_start": rise, "weights": weights}


def measure(cases: list[tuple[bool, str]]) -> list[dict]:
    """Plain DDP runs on 2 CPU processes, one a case (``gradient_as_bucket_view``, zero_grad), one after the other in
    the same processes: each step's net bytes, its highest bytes above its start (rank 0), and the weights' sums
    after the last step."""
    import socket

    with socket.socket() as free:  # a port nothing else listens on (tests run beside each other)
        free.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(free.getsockname()[1])
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        torch.multiprocessing.spawn(train, args=(cases, result.name), nprocs=2)
        return json.loads(Path(result.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/ddp_first_bucket.json")
    args = parser.parse_args()
    gradient_bytes = 8 * (512 * 512 + 512) * 4
    cases = []
    settings = [(True, "in place"), (True, "to None"), (True, "memfit"), (False, "in place")]
    for (view, zero_grad), measured in zip(settings, measure(settings), strict=True):
        net, rise = measured["net"], measured["highest_above_start"]
        case = {
            "gradient_as_bucket_view": view,
            "zero_grad": zero_grad,
            "net_bytes_by_step": net,
            "highest_bytes_above_the_step_start": rise,
            # the first bucket freed in the rebuild: nothing more left alive by step 2
            "first_bucket_freed": net["step 2"] < gradient_bytes // 100,
            "step_2_rise_over_step_3": rise["step 2"] - rise["step 3"],
            "weights_sums": measured["weights"],
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
