"""Files a run writes for people to read (the ledger, the summary, the pictures): whole or not at all.

Each is written beside its final name and renamed into place, so a full disk or a kill mid-write leaves the earlier
file or none, never a truncated one that a reader would take for the run's (a 0-byte ``summary.json`` is not JSON). And
the mark Memfit leaves in each directory it makes among a user's files, so that it only ever removes its own.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """Yields the path to write to; on success it becomes ``path``, on any failure it is removed. The partial file has
    a name no other file has (made with ``O_EXCL``): a user's file, or a link planted beside ``path``, is never
    written through; the rename replaces a link at ``path`` itself, not its target."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))  # the umask applies
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text_whole(path: Path, text: str) -> None:
    with written_whole(path) as partial:
        partial.write_text(text)


def special_kind(path) -> str | None:
    """What ``path`` names where it exists and is not a regular file: "directory", "named pipe (FIFO)", "socket",
    "device"; None where it is a regular file (or a link to one), absent or unreadable (said by whoever opens it). A
    FIFO blocks whoever opens it to read until a writer comes."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: not a path at all (an embedded NUL)
        return None
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket"))
    for test, kind in (*kinds, (stat.S_ISCHR, "device"), (stat.S_ISBLK, "device")):
        if test(mode):
            return kind
    return None


MARK = ".memfit-run"
"""The file Memfit writes into every directory it makes among a user's files (a checkpoint, its staging directory,
the run ``--overwrite`` sets aside, the embedded default's build): what a later run may replace or remove is what
holds it, never a user's directory that only has a name like one of Memfit's"""


def mark_as_written_by_memfit(directory: Path) -> None:
    # O_EXCL | O_NOFOLLOW: the directory was just made by this run, so nothing may be there to follow or overwrite
    fd = os.open(directory / MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, b"Written by a Memfit run: a later run may replace or remove this directory.\n")
    finally:
        os.close(fd)


def carries_mark(directory: Path) -> bool:
    """Whether ``directory`` (itself no link) holds Memfit's ``MARK`` as a regular file."""
    mark = directory / MARK
    return not directory.is_symlink() and directory.is_dir() and mark.is_file() and not mark.is_symlink()
