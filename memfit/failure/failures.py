"""How a run that cannot go on ends: a few lines and an exit status, never a traceback or a half-written file.

- out of memory (exit 3): where it ran out, what held the memory, and which settings would fit;
- a non-finite loss or gradient, or a loss over 3x a uniform guess's (exit 4): the step and the likely cause, and
  the latest checkpoint;
- a full disk, a quota or a read-only out_dir (exit 1): what could not be written, and how to continue;
- SIGTERM, SIGUSR1 or SIGHUP, a preemption (exit 143, 138 or 129): the checkpoint just saved, and the command that
continues;
- Ctrl-C (exit 130): the step reached, and how to continue.
"""

from __future__ import annotations

import dataclasses
import errno
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memfit.errors import line_to_stderr
from memfit.failure.oom import explain_oom
from memfit.memory import is_out_of_memory
from memfit.observatory.phases import PhaseMemory
from memfit.prediction.estimate import plan_of
from memfit.settings.run import Run, ScriptStep
from memfit.training.loop_parts import Counters, TrainingDiverged
from memfit.training.out_dir import EARLIER_RUN, OutDirLock, latest_checkpoint, remove_earlier_run
from memfit.training.signals import Preempted, RunSignals, ignore_ctrl_c, resume_command

WRITE_FAILURES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space in your quota",
    errno.EROFS: "give a writable --out_dir",
    errno.EACCES: "fix the permissions",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or give an --out_dir on a filesystem that takes larger files",
}
"""The errors of a write that the user can fix, and how: the run ends in one line naming the file"""


@contextmanager
def guarded_run(fabric, run: Run, script: ScriptStep, counters: Counters, memory: PhaseMemory) -> Iterator[RunSignals]:
    """Around everything a run does once launched: one run per ``--out_dir`` at a time (its lock, taken by rank 0 for
    every rank; with ``--overwrite``, the earlier run set aside only once it is held), and a few lines, never a
    traceback, for how it ends: out of memory, divergence, a full disk, a preemption (SIGTERM, SIGUSR1, SIGHUP: the
    steps taken saved first) or Ctrl-C (``ends_cleanly``). Yields the signals the loop asks at each step."""
    with (
        RunSignals() as signals,
        OutDirLock(run.out_dir, fabric),
        ends_cleanly(fabric, run, script, counters, memory),
    ):
        if run.overwrite and fabric.global_rank == 0:
            remove_earlier_run(run.out_dir)
        yield signals


@contextmanager
def ends_cleanly(
    fabric,
    run: Run,
    script: ScriptStep,
    counters: Counters,
    memory: PhaseMemory,
):
    """Around a run's work. The run's settings and the ``script``'s step are what the out-of-memory explanation plans
    with; ``counters`` and ``memory`` say where the run was."""
    out_dir = run.out_dir
    try:
        yield
    except RuntimeError as error:  # CUDA's OutOfMemoryError is one; the CPU allocator's failure is a plain one
        if fabric.world_size > 1 and _peer_lost(error):
            latest = latest_checkpoint(out_dir)
            line_to_stderr(  # every rank says it, on one shared stderr
                f"error: another process of this run ended (rank {fabric.global_rank} lost it in a collective:"
                f" {(str(error).splitlines() or [''])[0][:160]}); this one stops too. "
                + (
                    f"The latest checkpoint is {latest}: continue with {resume_command(fabric.world_size)}"
                    if latest
                    else "No checkpoint was written yet."
                )
            )
            raise SystemExit(_exit_status(fabric, 1)) from None
        if not is_out_of_memory(error):
            raise
        explain_oom(
            error,
            counters.step + 1,
            fabric.device,
            memory,
            script,
            # on a CPU the profiler window's host memory comes out of the memory that ran out; a --memory_budget is
            # planned against the ledger's tensor peak, as --estimate plans it (Estimate.must_fit)
            dataclasses.replace(plan_of(run), profiled=run.profile.enabled and not run.memory_budget),
            run.memory_budget,
            latest_checkpoint(out_dir),
            fabric.loggers,  # their writers are made only once the failed step is let go
        )
        raise SystemExit(3) from None
    except TrainingDiverged as error:
        latest = latest_checkpoint(out_dir)
        print(
            f"error: {error}\nNothing was saved for that step; "
            + (f"the latest checkpoint is {latest}." if latest else "no checkpoint was written before it."),
            file=sys.stderr,
        )
        raise SystemExit(4) from None
    except OSError as error:
        if error.errno not in WRITE_FAILURES:
            raise
        latest = latest_checkpoint(out_dir)
        if fabric.global_rank != 0:  # every rank of a sharded save fails with it: rank 0 says it once
            raise SystemExit(_exit_status(fabric, 1)) from None
        print(
            f"error: could not write {error.filename or out_dir}: {error.strerror}; {WRITE_FAILURES[error.errno]}"
            " and continue with --resume true"
            + (f" from {latest}" if latest else ", or start again with --overwrite true")
            + _kept_aside(out_dir),
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    except Preempted as error:
        ignore_ctrl_c()  # the steps are saved: a press still to come has nothing left to stop
        latest = latest_checkpoint(out_dir)
        if fabric.global_rank == 0:
            if error.step is None:  # stopped while loading
                saved = f"nothing new to save (the latest checkpoint is {latest})" if latest else "nothing to save"
            else:
                saved = f"saved {latest}" if latest else "no step was taken, so nothing was saved"
            stopped = "Interrupted by" if error.signum == signal.SIGINT else "Preempted by"
            print(
                f"{stopped} {error}: {saved}; continue with {resume_command(fabric.world_size)}{_kept_aside(out_dir)}",
                file=sys.stderr,
            )
        raise SystemExit(_exit_status(fabric, 128 + error.signum)) from None
    except KeyboardInterrupt:
        latest = latest_checkpoint(out_dir)  # the handler that raised it ignores Ctrl-C from then on
        where = (
            f"continue from {latest} with: {resume_command(fabric.world_size)}{_kept_aside(out_dir)}"
            if latest
            else f"no checkpoint was written yet; start again with --overwrite true{_kept_aside(out_dir)}."
        )
        print(f"\nInterrupted after step {counters.step}: nothing partial was saved; {where}", file=sys.stderr)
        raise SystemExit(130) from None


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "pair closure")


def _peer_lost(error: BaseException) -> bool:
    """A collective failed because another rank's process is gone (killed, out of host memory): gloo's and NCCL's
    words for it. The surviving ranks printed gloo's raw traceback."""
    return any(words in str(error) for words in _PEER_LOST)


def _exit_status(fabric, status: int) -> int:
    """``status``, except on the ranks Fabric's own launcher started: it watches them and SIGKILLs rank 0 when one
    exits non-zero (its _ChildProcessObserver), so they exit 0 and the run's status is rank 0's."""
    return 0 if fabric.local_rank != 0 and launched_by_fabric(fabric) else status


def _kept_aside(out_dir: Path) -> str:
    """Where the run that ``--overwrite true`` replaces waits, while this one has not finished."""
    aside = out_dir / EARLIER_RUN
    if not aside.is_dir():
        return ""
    return f" (the run it replaces is kept, whole, in {aside} until a run there finishes: move it back to keep it)"


def launched_by_fabric(fabric) -> bool:
    """Whether Fabric started this node's processes itself (no torchrun or SLURM)."""
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    return isinstance(getattr(fabric.strategy, "launcher", None), _SubprocessScriptLauncher)
