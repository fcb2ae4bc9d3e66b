"""Progress for the waits outside the training loop, drawn with tqdm as training's bar is, on stderr.

A wait that has steps to count (a checkpoint's layers loaded and quantized) gets a bar of them; an indivisible one
(the profiler processing its window's events, the trace parsed for the ledger and the pictures) a line that counts
its seconds. Both appear only once the wait has lasted ``SHOWN_AFTER_S``: a short wait prints nothing."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from tqdm import tqdm

SHOWN_AFTER_S = 2.0


def quiet_bars():
    """Clears the progress bars around a call, and draws them again after it: torch's profiler prints its
    "USDT: ... profiler_start" and "profiler_stop" lines on stderr as it starts and stops recording, and they ran on
    into the training bar's line."""
    return tqdm.external_write_mode()


@contextmanager
def waiting(what: str, enabled: bool = True, every: float = 0.5) -> Iterator[None]:
    """``what: 00:12`` on stderr, redrawn every ``every`` seconds while the block runs (from a thread: the block is one
    call that reports nothing), once it has run ``SHOWN_AFTER_S``; cleared when it ends.

    Written to stderr directly, not as a tqdm bar: a bar takes tqdm's lock when it is made, and the profiler's step is
    taken with that lock held (``quiet_bars`` clears the training bar around it), so a bar made there
    waited for the lock while the step waited for the bar: the run hung."""
    if not enabled:
        yield
        return
    done = threading.Event()
    started = time.monotonic()
    shown = [0]

    def count_seconds() -> None:
        if done.wait(SHOWN_AFTER_S):
            return
        while True:
            line = f"{what}: {tqdm.format_interval(time.monotonic() - started)}"
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
            shown[0] = len(line)
            if done.wait(every):
                return

    ticker = threading.Thread(target=count_seconds, name="memfit-waiting", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        if shown[0]:
            sys.stderr.write("\r" + " " * shown[0] + "\r")
            sys.stderr.flush()


@contextmanager
def layers_loaded(model: nn.Module, what: str, enabled: bool = True) -> Iterator[None]:
    """A bar of the model's layers as ``load_state_dict`` fills them (each module that holds parameters of its own,
    counted by a load pre-hook), shown once loading has lasted ``SHOWN_AFTER_S``: a memory-mapped load adopts the
    tensors at once and shows none; quantizing layer by layer, or reading a checkpoint that cannot be mapped, does."""
    if not enabled:
        yield
        return
    layers = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    with tqdm(total=len(layers), desc=what, unit="layer", delay=SHOWN_AFTER_S, leave=False) as bar:
        handles = [m._register_load_state_dict_pre_hook(lambda *_: bar.update()) for m in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            if bar._time() - bar.start_t >= SHOWN_AFTER_S:  # the bar is up: draw its last count before it goes
                bar.refresh()
