"""A CPU run on a busy machine: torch's intra-op threads sized to the cores other processes leave free.

torch starts one thread per core. Where other processes keep those cores busy, its threads wait on each other at
every parallel region (OpenMP spins, then sleeps), and a step takes several times as long as on the free cores alone
(``benchmarks/busy_cpu.py``: the quick start with two busy processes on 2 cores trained 4.0x faster on one thread
than on two). So before a CPU run trains, the cores busy in a short sample of ``/proc/stat`` are left out, and the
run says so in one ``warning:`` line. A thread count the user chose (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) is
kept as it is.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

SAMPLE_SECONDS = 0.3
"""How long the CPU's use is sampled before a run: long enough for the scheduler's ticks to average out"""
CHOSEN = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot, from /proc/stat's first line."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """How many cores other processes (and this one, which is idle while it waits) kept busy over ``seconds``."""
    busy_before, total_before = _cpu_times()
    time.sleep(seconds)
    busy_after, total_after = _cpu_times()
    elapsed = total_after - total_before
    return (busy_after - busy_before) / elapsed * (os.cpu_count() or 1) if elapsed else 0.0


def threads_for_free_cores(warn: Callable[[str], None]) -> int:
    """Sizes torch's intra-op threads to the cores left free where that is fewer than it would use, saying so in one
    line; returns the threads it will use. Linux only (elsewhere, and where the user chose a count, nothing
    changes)."""
    threads = torch.get_num_threads()
    if any(os.environ.get(name) for name in CHOSEN) or not os.path.exists("/proc/stat"):
        return threads
    busy = busy_cores()
    cores = os.cpu_count() or 1
    free = max(1, int(cores - busy + 0.5))
    if free >= threads:
        return threads
    torch.set_num_threads(free)
    warn(
        f"warning: the CPU is busy (other processes keep about {busy:.1f} of its {cores} cores in use): torch trains on"
        f" {free} thread(s), not {threads}, whose threads would wait on each other; set OMP_NUM_THREADS to choose"
    )
    return free
