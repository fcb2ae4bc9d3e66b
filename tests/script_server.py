"""A process that has imported what the recipes import, and forks one child per script run (``run_script`` in
tests/conftest.py): each run is still its own process, as `python finetune/lora.py ...` is (its own pid, exit status,
signals, atexit, the processes it launches), but skips the ~6.6 s of CPU a fresh interpreter spends importing torch,
Lightning and litgpt, most of the suite's time before this existed.

Requests come as JSON lines on stdin; for each, the server forks, answers ``{"pid": ...}`` on the response pipe, waits
for the child and answers ``{"returncode": ...}`` (negative: the signal that ended it, as ``subprocess`` reports it).
It ends when stdin closes (its pytest worker ended)."""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = (
    "finetune/lora.py",
    "finetune/adapter.py",
    "finetune/adapter_v2.py",
    "finetune/full.py",
    "pretrain/pretrain.py",
)


def preload() -> dict[str, str]:
    """Imports every recipe's imports (each recipe as a module, not run); returns the variables those imports set
    in the environment (a child's environment is the request's, plus these, as a fresh process's would be)."""
    import importlib.util

    before = dict(os.environ)
    for relative in SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"preloaded_{Path(relative).stem}", ROOT / relative)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    # bitsandbytes too, as a quantized run imports it (memfit.training.bitsandbytes_layers): 2.5 s of CPU each quantized
    # run paid again, in about a third of the suite's runs. A run that emulates another CPU (``env``) starts a new
    # interpreter.
    from memfit.training.bitsandbytes_layers import import_bitsandbytes

    import_bitsandbytes()
    return {key: value for key, value in os.environ.items() if key not in before}


class ForkedRank:
    """What Fabric's launcher keeps of a rank it started (``subprocess.Popen``'s ``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``kill``), for a rank forked by ``fork_ranks_here``."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return self.wait(block=False)

    def wait(self, timeout: float | None = None, block: bool = True) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:  # reaped already
                return self.returncode
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def fork_ranks_here() -> None:
    """Fabric's launcher starts ranks 1..N-1 as `python SCRIPT ARGS` (``subprocess.Popen`` in
    ``lightning.fabric.strategies.launchers.subprocess_script``), each a new interpreter paying the imports again:
    here each is forked from rank 0 instead, at that moment (Fabric launches before the model, the data or the
    process group exist), and runs the same command from its top with the launcher's environment. torchrun's and
    SLURM's ranks, and a run given ``env``, still start as new interpreters."""
    from lightning.fabric.strategies.launchers import subprocess_script

    real = subprocess_script.subprocess

    class Subprocess:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def Popen(command, env=None, cwd=None, **kwargs):  # noqa: N802  (subprocess's name)
            if kwargs or list(command[:2]) != [sys.executable, os.path.abspath(sys.argv[0])] or _threaded():
                return real.Popen(command, env=env, cwd=cwd, **kwargs)
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = run_script(command[1], list(command[2:]), cwd or os.getcwd(), env or dict(os.environ))
                finally:  # never back into rank 0's frames: their cleanup is rank 0's
                    os._exit(exit_status(code))
            return ForkedRank(pid)

    subprocess_script.subprocess = Subprocess()


def _threaded() -> bool:
    """Whether this process runs threads beside its main one: a fork copies only the calling thread, so a rank forked
    from it would wait forever on the others. OpenMP's workers are such threads: a run that had computed in parallel
    before Fabric launched (pretraining pythia-14m's architecture resolves its 50k-token vocabulary first) forked a
    rank that hung in OpenMP's barrier at its first large copy. Such a rank starts as a new interpreter instead."""
    return len(os.listdir("/proc/self/task")) > 1


def exit_status(code) -> int:
    """The status the interpreter exits with for ``SystemExit(code)``: None 0, an int itself, anything else printed
    and 1; atexit handlers run first, as at an interpreter's end."""
    import atexit

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    return code or 0


def run_script(script: str, args: list[str], cwd: str, env: dict[str, str]):
    """Runs ``script`` as `python SCRIPT ARGS` would in ``cwd`` with ``env``; returns its exit code (SystemExit's)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "sitecustomize" in sys.modules:  # the offline guard read its log's path at the server's start
        sys.modules["sitecustomize"]._log = env.get("MEMFIT_TEST_NETWORK_LOG")
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        return exit_.code
    except KeyboardInterrupt:  # as the interpreter does: the traceback, then end by the signal itself
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:  # noqa: BLE001  (an uncaught error: printed and exit 1, as the interpreter does)
        traceback.print_exc()
        return 1
    return 0


def run_child(request: dict, set_by_imports: dict[str, str], responses) -> None:
    """In the forked child: become `python SCRIPT ARGS` in ``cwd`` with ``env``, then exit as that would."""
    responses.close()  # the server's; stdin (the requests) is replaced below
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], 0), (2, request["stderr"], 0)):
        opened = os.open(path, flags or os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fork_ranks_here()
    script = str(ROOT / request["script"])
    code = run_script(script, request["args"], request["cwd"], {**set_by_imports, **request["env"]})
    raise SystemExit(code)  # unwinds to the top: the interpreter's own shutdown (threads joined, atexit) follows


def main() -> None:
    responses = int(sys.argv[1])
    set_by_imports = preload()
    out = os.fdopen(responses, "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request, set_by_imports, out)
        out.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    main()
