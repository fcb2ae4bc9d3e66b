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
    return {key: value for key, value in os.environ.items() if key not in before}


def run_child(request: dict, set_by_imports: dict[str, str], responses) -> None:
    """In the forked child: become `python SCRIPT ARGS` in ``cwd`` with ``env``, then exit as that would."""
    responses.close()  # the server's; stdin (the requests) is replaced below
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], 0), (2, request["stderr"], 0)):
        opened = os.open(path, flags or os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if "sitecustomize" in sys.modules:  # the offline guard read its log's path at the server's start
        sys.modules["sitecustomize"]._log = request["env"].get("MEMFIT_TEST_NETWORK_LOG")
    script = str(ROOT / request["script"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    except KeyboardInterrupt:  # as the interpreter does: the traceback, then end by the signal itself
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:  # noqa: BLE001  (an uncaught error: printed and exit 1, as the interpreter does)
        traceback.print_exc()
        code = 1
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
