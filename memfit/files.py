"""Files a run writes for people to read (the ledger, the summary, the pictures): whole or not at all.

Each is written beside its final name and renamed into place, so a full disk or a kill mid-write leaves the earlier
file or none, never a truncated one that a reader would take for the run's (a 0-byte ``summary.json`` is not JSON).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """Yields the path to write to; on success it becomes ``path``, on any failure it is removed."""
    partial = path.with_name(f".{path.name}.partial")
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
