"""Command-line entry: jsonargparse's CLI, with a user's mistake reported in one line instead of a traceback."""

from __future__ import annotations

import sys
from typing import Any, Callable


class UserError(Exception):
    """A bad setting or input the user can fix. The message names the bad value and the fix."""


def CLI(function: Callable, args: list[str] | None = None) -> Any:
    from jsonargparse import CLI as _CLI

    try:
        # as_positional=False: every setting is a named flag, like litgpt's scripts.
        return _CLI(function, as_positional=False, args=args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
