"""Command-line entry: jsonargparse's CLI, with a user's mistake reported in one line instead of a traceback.

Three kinds of mistakes end here, each as ``error: ...`` on stderr and exit status 2, before anything is written:
a flag jsonargparse cannot parse (``--quantize bnb.nf5``), a class it cannot build (``--data JSON`` with a missing
file), and a setting the scripts reject (``UserError``). Errors raised while training are bugs and keep their
traceback.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable


class UserError(Exception):
    """A bad setting or input the user can fix. The message names the bad value and the fix."""


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def one_line(message: str) -> str:
    """jsonargparse's multi-line validation report, reduced to the flag, the value and the reason."""
    key = re.search(r'Parser key "([^"]+)"', message)
    flag = f"--{key.group(1)}" if key else None
    given = re.search(r"Given value: (.*)", message)
    choices = re.search(r"Literal\[([^\]]*)\]", message)
    if flag and given and choices:
        return f"{flag} {given.group(1).strip()!r} is not one of {choices.group(1)}"
    lines = [re.sub(r'^Parser key "[^"]+":\s*', "", line.strip()) for line in message.splitlines()]
    lines = [line for line in lines if line and "NoneType" not in line and "Union of no types" not in line]
    bullets = [line[2:] for line in lines if line.startswith("- ")]
    reason = bullets[-1] if bullets else (lines[0] if lines else message.strip())
    if "expected one argument" in reason:  # argparse reads "-1e-3" as a flag
        reason += " (a value that starts with '-' is written --flag=VALUE)"
    shown = given.group(1).strip() if given else ""
    if shown and len(shown) < 60 and "Namespace(" not in shown and shown not in reason:
        reason += f" (got {shown!r})"
    return f"{flag}: {reason}" if flag and not reason.startswith("--") else reason


def CLI(function: Callable, args: list[str] | None = None) -> Any:
    from jsonargparse import ArgumentError, auto_parser, set_parsing_settings

    # dataclass attribute docstrings (TrainArgs, ProfileArgs, ...) become --help text, as in litgpt
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # as_positional=False: every setting is a named flag, like litgpt's scripts
    parser = auto_parser(function, as_positional=False, exit_on_error=False)
    try:
        config = parser.parse_args(args)
        init = parser.instantiate_classes(config)
    except UserError as error:
        _fail(str(error))
    except (ArgumentError, ValueError, TypeError, FileNotFoundError) as error:
        _fail(one_line(str(error)))
    init.pop("config", None)
    try:
        return function(**init)
    except UserError as error:
        _fail(str(error))
