"""The checks of the directories a run writes: writable, names the file system can hold, and an ``--out_dir`` that
holds no earlier run (or one Memfit did not write) unless told what to do with it.
"""

from __future__ import annotations

import os
from pathlib import Path

from memfit.errors import UserError
from memfit.training.out_dir import EARLIER_RUN, STEP_DIR, missing_dirs, not_memfits_message, not_written_by_memfit


def check_run_dirs(
    out_dir: Path,
    profile_dir: Path,
    resume_from: Path | None,
    overwrite: bool,
    estimate: bool,
    reads: dict[str, Path] | None = None,
) -> None:
    """Writable directories, and an out_dir that holds no earlier run unless told what to do with it; ``--overwrite``
    never deletes what the run ``reads`` (``run_inputs``): a merged ``final/`` is the base of the next run."""
    if not estimate:
        check_writable("--out_dir", Path(out_dir))
        check_writable("--profile_dir", Path(profile_dir))
    earlier = earlier_run(Path(out_dir))
    foreign = not_written_by_memfit(Path(out_dir))
    if foreign and not estimate:
        raise UserError(not_memfits_message(Path(out_dir), foreign))
    if overwrite and not estimate:
        for name in earlier:
            deleted = (Path(out_dir) / name).resolve()
            for flag, path in (reads or {}).items():
                if path.resolve() == deleted or deleted in path.resolve().parents:
                    raise UserError(
                        f"--overwrite true would delete {str(Path(out_dir) / name)!r}, which {flag} {str(path)!r}"
                        " reads; choose another --out_dir (or move that checkpoint out of it first)"
                    )
    if earlier and not (resume_from or overwrite or estimate):
        if "final" in earlier:  # nothing to continue: a resumed run keeps its settings, --train.max_steps included
            raise UserError(
                f"--out_dir {str(out_dir)!r} already holds a finished run (final); choose a fresh"
                " --out_dir, or replace it with --overwrite true"
            )
        if earlier == [EARLIER_RUN]:
            raise UserError(
                f"--out_dir {str(out_dir)!r} holds the run an interrupted --overwrite set aside ({EARLIER_RUN});"
                " move it back to keep it, choose a fresh --out_dir, or replace it with --overwrite true"
            )
        raise UserError(
            f"--out_dir {str(out_dir)!r} already holds an unfinished run ({', '.join(earlier[:3])}); continue it with"
            " --resume true, choose a fresh --out_dir, or replace it with --overwrite true"
        )


def check_writable(flag: str, path: Path) -> None:
    """Refuses a directory that cannot be created or written, before any work (not at the first save)."""
    check_name_lengths(flag, path)
    missing = missing_dirs(path)
    for link in missing:
        if link.is_symlink():  # a link whose target is gone: creating the directory would fail on the link
            raise UserError(
                f"{flag} {str(path)!r} cannot be created: {str(link)!r} is a link to"
                f" {os.readlink(link)!r}, which does not exist; create that, or remove the link"
            )
    existing = missing[-1].parent if missing else path  # the nearest directory (or file) that is there
    if not existing.is_dir():
        raise UserError(f"{flag} {str(path)!r} cannot be created: {str(existing)!r} is a file; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {str(path)!r} is not writable (no write permission on {str(existing)!r})")


def check_name_lengths(flag: str, path: Path) -> None:
    """Each name in ``path`` within what its file system takes (255 bytes on most): a longer one failed with
    ENAMETOOLONG where it was first made, for the profile dir after training had started."""
    nearest = next((p for p in (Path(path).absolute(), *Path(path).absolute().parents) if _is_dir(p)), Path("/"))
    try:
        most = os.pathconf(nearest, "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    for name in Path(path).parts:
        if len(os.fsencode(name)) > most:
            raise UserError(
                f"{flag}: the name {name[:40]!r}... is {len(os.fsencode(name))} bytes long, past the {most} its file"
                " system takes for one name; shorten it"
            )
    total = len(os.fsencode(str(Path(path).absolute())))
    if total > 3800:  # PATH_MAX is 4096, and a run adds its own names below (the profile dir's run, a checkpoint)
        raise UserError(f"{flag}: the path is {total} bytes long, past what a run can write under; shorten it")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # ENAMETOOLONG: a name in it is too long to ask about
        return False


def earlier_run(out_dir: Path) -> list[str]:
    """The checkpoint directories an earlier run left in ``out_dir``."""
    if not out_dir.is_dir():
        return []
    # a run set aside by an --overwrite that never finished counts: a fresh run here would delete it when it ends
    kept = (EARLIER_RUN,)
    return sorted(
        (
            p.name
            for p in out_dir.iterdir()
            if p.is_dir() and (p.name == "final" or STEP_DIR.match(p.name) or p.name in kept)
        ),
        reverse=True,
    )
