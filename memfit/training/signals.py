"""Preemption and Ctrl-C: the signals that end a run from outside.

SIGTERM is what SLURM, Kubernetes and spot instances send before they kill a job; SIGUSR1 is what SLURM's
``--signal USR1@SECONDS`` sends ahead of a time limit; SIGHUP is what a closed terminal or a dropped ssh session
sends. Each one makes the run save a checkpoint of the steps it has taken and stop (exit 128 + the signal's number:
143, 138, 129), so that ``--resume auto`` continues exactly. Once training
has begun the handler only records the signal: the loop asks at the top of each step (``requested``), where the
model, optimizer and data position are whole, and every rank agrees (one all-reduce of a flag), because a launcher
may signal only some ranks. Before that (the data, the model's load) there is nothing to save: the run stops at once.

Ctrl-C (SIGINT) during training keeps the steps taken, as a preemption does: the run saves at the top of the next
step and stops (exit 130); a second Ctrl-C stops at once, losing the steps since the latest checkpoint, and one after
that, while the run cleans up (a checkpoint's staging directory, the profiler, the out_dir's lock), is ignored, so it
cannot end that half-way. Before training (reading data, loading the model) the first Ctrl-C stops at once.
"""

from __future__ import annotations

import shlex
import signal
import sys

import torch

PREEMPTING = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class Preempted(BaseException):
    """A run stopped on SIGTERM, SIGUSR1 or SIGHUP, after saving the steps it had taken (``step`` None: before its first
    step, while it read the data and loaded the model, with nothing to save). A ``BaseException``, as
    ``KeyboardInterrupt`` is: raised from the handler wherever the run is, no library's ``except Exception`` (a
    logging handler's, say) may swallow it."""

    def __init__(self, signum: int, step: int | None) -> None:
        when = f"after step {step}" if step is not None else "before its first step (while loading)"
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        super().__init__(f"{name} {when}")
        self.signum, self.step = signum, step


class RunSignals:
    """Installs the handlers for a run's duration (the main thread's, as Python requires) and restores the previous
    ones after, so a run inside another program (a test, a notebook) leaves it as it was."""

    def __init__(self) -> None:
        self.received = 0
        self.interrupted = False
        self._training = False  # set at the loop's first question (``requested``)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> RunSignals:
        for signum in PREEMPTING:
            self._previous[signum] = signal.signal(signum, self._preempt)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc) -> None:
        # after a Ctrl-C the process is ending: one more press (pending since the save, or still to come) would cut
        # its exit (atexit handlers) short in a traceback and end it with the signal's status rather than 130
        ending_on_ctrl_c = self.interrupted or self.received == signal.SIGINT
        for signum, handler in self._previous.items():
            if signum == signal.SIGINT and ending_on_ctrl_c:
                ignore_ctrl_c()
            else:
                signal.signal(signum, handler)

    def _preempt(self, signum, frame) -> None:
        self.received = self.received or signum  # the first one is the one reported
        if not self._training:
            # before the loop asks for the first time (reading data, loading a checkpoint: minutes for a 70B
            # model) there is nothing to save: stop now rather than at a first step the scheduler's kill may beat
            raise Preempted(signum, None)

    def _interrupt(self, signum, frame) -> None:
        if self._training and not self.received:
            # the first press: the steps taken are saved at the top of the next step, as a preemption's
            self.received = signum
            print(
                "\nCtrl-C: saving the steps taken at the end of this step, then stopping (Ctrl-C again stops at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        self.interrupted = True
        ignore_ctrl_c()
        raise KeyboardInterrupt

    def requested(self, fabric) -> int:
        """The preempting signal any rank received (0: none); the same answer on every rank. From the first call on,
        a signal waits for the next call (the top of a step, where the run is whole and can be saved)."""
        self._training = True
        if fabric.world_size == 1:
            return self.received
        flag = torch.tensor(float(self.received), device=fabric.device)
        return int(fabric.all_reduce(flag, reduce_op="max"))


def ignore_ctrl_c() -> None:
    """From here to the process's end a Ctrl-C is ignored: the run is ending (saved, or stopped at once) and what
    remains (its last lines, the out_dir's lock, atexit handlers) must not be cut short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def resume_command(world_size: int) -> str:
    """The command that continues this run: the one given, with ``--resume auto`` in place of ``--resume`` and
    ``--overwrite`` (both refused together, and an overwrite would delete what was just saved)."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg in ("--resume", "--overwrite"):
            skip = True
        elif not arg.startswith(("--resume=", "--overwrite=")):
            args.append(arg)
    command = shlex.join(["python", sys.argv[0], *args, "--resume", "auto"])
    return command if world_size == 1 else f"the same launch with: {command}"
