"""Memory readings and per-phase peaks, on CUDA (allocator statistics) and on CPU (process RSS).

On CUDA the figures are the caching allocator's: ``allocated``, ``reserved`` and the peak of ``allocated`` since
the last reset. On CPU there is no allocator to ask, so the figures are the process's resident set size (RSS,
which includes Python and the libraries) and its high-water mark (VmHWM), which Linux lets a process reset by
writing "5" to /proc/self/clear_refs. Every reading says which of the two it is.
"""

from __future__ import annotations

import re
import resource

import numpy
import torch

_STATUS_FIELD = re.compile(r"^(\w+):\s+(\d+) kB", re.M)


def proc_status() -> dict[str, int]:
    """/proc/self/status memory fields in bytes (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    with open("/proc/self/status") as f:
        return {k: int(v) * 1024 for k, v in _STATUS_FIELD.findall(f.read())}


def address_space_limited() -> bool:
    """Whether the host refuses allocations before its RAM is used up: an address-space limit (``ulimit -v``) or the
    kernel's strict overcommit (``vm.overcommit_memory`` 2)."""
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            strict = f.read().strip() == "2"
    except OSError:
        strict = False
    return limit != resource.RLIM_INFINITY or strict


def reserve_blas_buffers() -> None:
    """Makes numpy's BLAS (OpenBLAS, in numpy's wheels) take its buffers now, while the process has room.

    OpenBLAS maps a buffer for each of its threads at its first matrix product and keeps it. Where the host refuses
    allocations (``address_space_limited``), a first product late in a run (the failure's picture, the planner's
    arithmetic after an out-of-memory) finds no room, and OpenBLAS prints "Memory allocation still failed after 10
    retries" and ends the process itself (``exit(1)``), where nothing can explain the failure. One small product at
    the start reserves them, inside the address space the run starts with."""
    square = numpy.ones((256, 256))
    square @ square


class MemoryProbe:
    """Reads current and peak memory of one device; ``kind`` says what the numbers measure."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.kind = "cuda_allocated" if self.cuda else "cpu_rss"
        if not self.cuda and address_space_limited():
            reserve_blas_buffers()
        self.address_space_at_start = 0 if self.cuda else proc_status().get("VmSize", 0)
        """CPU: the process's virtual size before the run's model and data (``ulimit -v`` limits it)"""
        self.earlier_peak = 0
        """The highest peak before the last reset: each phase resets the device's peak to measure its own, so the
        run's peak is the largest of these and the current one"""

    def reset_peak(self) -> None:
        self.earlier_peak = max(self.earlier_peak, self.peak_and_current()[0])
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:  # not Linux, or not permitted: peaks then span the whole run
                pass

    def peak_and_current(self) -> tuple[int, int]:
        """Both readings at once: on CPU one read of /proc/self/status instead of two, every phase."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        status = proc_status()
        return status.get("VmHWM", 0), status.get("VmRSS", 0)

    def allocated(self) -> int:
        """Tensor memory now: the CUDA allocator's; on CPU unknown here (the ledger takes it from the profiler)."""
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def run_peak(self) -> int:
        """The peak since the run started (``max_memory_allocated`` or VmHWM alone is the last phase's)."""
        return max(self.earlier_peak, self.peak_and_current()[0])

    def host_peak(self) -> int:
        """The process's peak RSS over the run (VmHWM): on CPU the phases reset it to measure their own, so the run's
        is the largest of theirs; on CUDA nothing resets it. RSS counts the pages of the libraries and of the
        memory-mapped checkpoint it touched beside its own (anonymous) memory."""
        return self.run_peak() if not self.cuda else proc_status().get("VmHWM", 0)

    def scalars(self) -> dict[str, float]:
        """Per-step memory scalars in GiB, named by what they measure; the peaks are the run's so far."""
        gib = 2**30
        if self.cuda:
            return {
                "memory/cuda_allocated_gib": torch.cuda.memory_allocated(self.device) / gib,
                "memory/cuda_reserved_gib": torch.cuda.memory_reserved(self.device) / gib,
                "memory/cuda_peak_allocated_gib": self.run_peak() / gib,
            }
        status = proc_status()
        return {
            "memory/cpu_rss_gib": status.get("VmRSS", 0) / gib,
            "memory/cpu_rss_anon_gib": status.get("RssAnon", 0) / gib,
            "memory/cpu_peak_rss_gib": max(self.earlier_peak, status.get("VmHWM", 0)) / gib,
        }


def is_out_of_memory(error: BaseException) -> bool:
    """The device ran out: CUDA's ``OutOfMemoryError``, or, on CPU, the allocator's failure, which torch raises as a
    plain ``RuntimeError`` (the host refused the allocation: ``ulimit -v``, overcommit off, or one larger than RAM
    and swap)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error)
    )


def release_freed_heap() -> None:
    """Returns freed heap pages to the OS (glibc only).

    glibc keeps freed pages in the heap, so a process that freed a lot (each CPU quantization's temporaries, the
    profiler's window) would otherwise go on holding it: RSS is what a host OOM killer and the benchmarks see.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
