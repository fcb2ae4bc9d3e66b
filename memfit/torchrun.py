"""torchrun itself, ending in one line: ``python -m memfit.torchrun`` takes torchrun's arguments unchanged.

torchrun (``torch.distributed.run``) reports the end of a run it did not expect as its own failure: a SIGTERM it
passes on to the ranks (a scheduler's preemption) ends in its ``SignalException`` traceback and exit 1, and a rank
that ended on a refused setting (exit 2, its one line printed) in a ``ChildFailedError`` block and exit 1, after the
ranks' own lines. This runs torchrun's own ``run`` (the same agent, rendezvous and restarts: nothing is launched
differently) and ends as one process of the run would: torchrun's failure report as one line, and the ranks' status
(2 for a refused setting, 143 for a SIGTERM, ...), so a job script or a scheduler's requeue reads the run's status.
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run


def main(argv: list[str] | None = None) -> int:
    parser = get_args_parser()
    parser.prog = "python -m memfit.torchrun"  # torch's own says torchrun.py
    args = parser.parse_args(argv)
    # the agent's own error log repeats what the ranks said, with a pointer to a traceback there is none of
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        status = failure.exitcode
        if status < 0:  # killed by a signal
            print(f"torchrun: rank {rank} was ended by {signal.Signals(-status).name}", file=sys.stderr)
            return 128 - status
        print(f"torchrun: rank {rank} ended with exit {status}; the ranks' lines above say why", file=sys.stderr)
        return status
    except SignalException as error:
        name = signal.Signals(error.sigval).name
        print(f"torchrun: {name} passed on to every rank; the ranks' lines above say what they saved", file=sys.stderr)
        return 128 + error.sigval
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
