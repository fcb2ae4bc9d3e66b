"""Writes a CUDA allocator snapshot taken by torch on a real GPU, with what was known to be alive when it was taken, for
the tests of Memfit's snapshot reading (``tests/test_cuda_snapshot.py``), which run on any machine.

    python benchmarks/cuda_snapshot_fixture.py --out tests/data/cuda_snapshot

Writes ``segments.pickle`` (``torch.cuda.memory_snapshot()`` as torch returned it, pickled as torch's own
``_dump_snapshot`` does) and ``expected.json``: the data pointer and byte size of every tensor the script holds, the
allocator's own ``memory_allocated()`` and ``memory_reserved()`` at the same moment, and the cuBLAS workspaces' sizes
as the allocator's statistics count them (bytes allocated before and after ``_cuda_clearCublasWorkspaces``). These are
read from torch's counters and the tensors themselves, not from the snapshot, so a test of the snapshot reader can
disagree with them.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import sys
from pathlib import Path


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: this script reads the CUDA caching allocator; run it on a GPU machine")
    device = torch.device("cuda", 0)
    generator = torch.Generator(device).manual_seed(0)
    held = {}
    # sizes on both sides of the allocator's small/large pool split (1 MiB) and of its 2 MiB small segments; some
    # freed again, so the snapshot also holds inactive blocks between live ones
    for name, numel in [
        ("small_a", 1000),
        ("small_b", 300_000),
        ("large_a", 3 * 2**20),
        ("large_b", 5_000_000),
        ("freed_small", 200_000),
        ("freed_large", 4 * 2**20),
        ("after", 2**20 + 7),
    ]:
        held[name] = torch.empty(numel, device=device, dtype=torch.float32)
    del held["freed_small"], held["freed_large"]
    # a bf16 matmul on this thread and a backward on autograd's device thread: each takes a cuBLAS workspace
    weight = torch.randn(512, 512, device=device, dtype=torch.bfloat16, generator=generator, requires_grad=True)
    (weight @ weight).sum().backward()
    held["weight"], held["weight.grad"] = weight.detach(), weight.grad
    torch.cuda.synchronize(device)

    segments = torch.cuda.memory_snapshot()
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    clear = torch._C._cuda_clearCublasWorkspaces
    clear()
    workspaces_bytes = allocated - torch.cuda.memory_allocated(device)

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "segments.pickle", "wb") as f:
        pickle.dump(segments, f)
    expected = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/cuda_snapshot_fixture.py " + " ".join(sys.argv[1:]),
        "measures": "memory_allocated()/memory_reserved() when the snapshot was taken; tensors' data_ptr and nbytes",
        "memory_allocated": allocated,
        "memory_reserved": reserved,
        "cublas_workspaces_bytes": workspaces_bytes,
        "tensors": {
            name: {"address": t.untyped_storage().data_ptr(), "bytes": t.untyped_storage().nbytes()}
            for name, t in held.items()
        },
    }
    (args.out / "expected.json").write_text(json.dumps(expected, indent=1))
    print(json.dumps({k: v for k, v in expected.items() if k != "tensors"}))


if __name__ == "__main__":
    main()
