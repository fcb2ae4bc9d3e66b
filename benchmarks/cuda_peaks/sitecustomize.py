"""On PYTHONPATH (benchmarks/compare_litgpt.py --device cuda puts it there for every process it starts, Memfit's and
litgpt's alike): at exit, writes the process's CUDA allocator peaks to $MEMFIT_BENCH_CUDA_PEAKS, so both tools are
measured by the same code rather than by their own reports.

The peak is the whole process's: Memfit resets the allocator's peak at every phase of a step (to measure each
phase's own), so ``max_memory_allocated`` at exit would be its last phase's. ``torch.cuda.reset_peak_memory_stats``
is wrapped, as soon as ``torch.cuda`` is imported, to keep the highest peak it is about to forget."""

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys

_forgotten = {"max_allocated_bytes": 0, "max_reserved_bytes": 0}


def _readings(cuda) -> dict:
    return {
        "max_allocated_bytes": cuda.max_memory_allocated(0),
        "max_reserved_bytes": cuda.max_memory_reserved(0),
    }


def _keep_peaks_across_resets(cuda) -> None:
    reset = cuda.reset_peak_memory_stats

    def reset_peak_memory_stats(device=None):
        if cuda.is_initialized():
            for key, value in _readings(cuda).items():
                _forgotten[key] = max(_forgotten[key], value)
        return reset(device)

    reset_peak_memory_stats.__wrapped__ = reset
    cuda.reset_peak_memory_stats = reset_peak_memory_stats


class _WrapWhenImported(importlib.abc.MetaPathFinder):
    """Finds ``torch.cuda`` the usual way and wraps its reset once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cuda":
            return None
        sys.meta_path.remove(self)  # the usual finders from here on (and no recursion into this one)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _keep_peaks_across_resets(module)

        spec.loader.exec_module = exec_module
        return spec


def _write() -> None:
    torch = sys.modules.get("torch")
    path = os.environ.get("MEMFIT_BENCH_CUDA_PEAKS")
    if path and torch is not None and torch.cuda.is_initialized():
        peaks = {key: max(value, _forgotten[key]) for key, value in _readings(torch.cuda).items()}
        with open(path, "w") as f:
            json.dump(peaks, f)


sys.meta_path.insert(0, _WrapWhenImported())
atexit.register(_write)
