"""On PYTHONPATH (benchmarks/compare_litgpt.py --device cuda puts it there for every process it starts, Memfit's and
litgpt's alike): at exit, writes the process's CUDA allocator peaks to $MEMFIT_BENCH_CUDA_PEAKS, so both tools are
measured by the same code rather than by their own reports."""

import atexit
import json
import os


def _write() -> None:
    import sys

    torch = sys.modules.get("torch")
    path = os.environ.get("MEMFIT_BENCH_CUDA_PEAKS")
    if path and torch is not None and torch.cuda.is_initialized():
        with open(path, "w") as f:
            json.dump(
                {
                    "max_allocated_bytes": torch.cuda.max_memory_allocated(0),
                    "max_reserved_bytes": torch.cuda.max_memory_reserved(0),
                },
                f,
            )


atexit.register(_write)
