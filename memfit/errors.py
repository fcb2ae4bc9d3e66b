"""The error every check raises for a user's mistake, and the one-line write that says it on stderr (the command
line, ``memfit.settings.cli``, prints a refusal so and exits 2)."""

import sys


class UserError(Exception):
    """A bad setting or input the user can fix. The message names the bad value and the fix."""


def line_to_stderr(text: str) -> None:
    """``text`` and its newline on stderr in one write: the ranks of a launch share one stderr, and print's separate
    write of the newline let two ranks' lines run together ("...--out_direrror: ...")."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()
