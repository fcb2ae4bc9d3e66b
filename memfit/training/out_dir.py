"""An --out_dir as runs share it: one run at a time (its lock), the checkpoints in it, and what a run may remove.

An out_dir may be a folder that holds other things. Every directory a run makes there (a checkpoint, its staging
directory, the run ``--overwrite`` sets aside) carries Memfit's mark (``memfit.files.MARK``), and a run removes,
moves or replaces only directories that carry it: a user's ``.cache.tmp`` or ``final/`` is left as it is, or, where a
run would replace it, refused before the run starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from pathlib import Path

from memfit.errors import UserError
from memfit.files import MARK, carries_mark, mark_as_written_by_memfit, special_kind

STEP_DIR = re.compile(r"^step-(\d+)$")

SHARDED_DIR = "sharded"  # a sharded step-* checkpoint's weights and optimizer state: one file per rank (torch DCP)


def step_checkpoints(out_dir: Path) -> list[Path]:
    """The complete ``step-N`` directories, newest first; in-progress (``.tmp``) directories are never returned."""
    steps = [(int(m.group(1)), p) for p in out_dir.glob("step-*") if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The highest ``step-N`` directory."""
    steps = step_checkpoints(out_dir)
    return steps[0] if steps else None


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and each of its parents that does not exist yet, deepest first: what creating it would create."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_if_empty(directories: list[Path]) -> None:
    """Removes these directories, deepest first, up to the first that is not empty (or gone)."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            break


class OutDirLock:
    """``out_dir/.memfit.lock``, so two runs never write one ``--out_dir`` at once.

    The lock is the kernel's (``fcntl.flock`` on the file): taking it is atomic, and it ends with its process however
    that process ends, so a lock file left by a killed run, or naming a pid that now belongs to another program, is
    free. The file holds the owner's pid for the refusal to name. On release it is removed, and so are ``out_dir`` and
    its parents where this run created them and left nothing in them (a run that stopped on a bad input leaves no
    trace); so are the staging directories of saves a killed run left (``.step-*.tmp``).
    """

    def __init__(self, out_dir: Path, fabric=None) -> None:
        self.out_dir = out_dir
        self.path = out_dir / ".memfit.lock"
        self.fabric = fabric
        """Several ranks: rank 0 takes the lock, and every rank ends on its refusal"""
        self.created_dirs: list[Path] = []
        self._fd: int | None = None

    def __enter__(self) -> OutDirLock:
        refusal = None
        if self.fabric is None or self.fabric.global_rank == 0:
            try:
                self._take()
            except UserError as error:
                refusal = str(error)
        if self.fabric is not None and self.fabric.world_size > 1:
            # rank 0 alone ending on the refusal left the others failing in their next collective, with tracebacks
            refusal = self.fabric.broadcast(refusal)
        if refusal:
            raise UserError(refusal)
        return self

    def _take(self) -> None:
        self.created_dirs = missing_dirs(self.out_dir)  # out_dir, then each parent this run creates (out/finetune)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        kind = "symbolic link" if self.path.is_symlink() else special_kind(self.path)
        if kind:  # a link would have the pid written into its target; a FIFO blocks the open forever
            raise UserError(
                f"--out_dir {str(self.out_dir)!r}: {self.path} is a {kind}, not Memfit's lock file; remove it (a run"
                " makes the file itself) or choose another --out_dir"
            )
        foreign = not_written_by_memfit(self.out_dir)
        if foreign:  # checked before the run too (check_run_dirs); here as well, for a directory filled since
            raise UserError(not_memfits_message(self.out_dir, foreign))
        for _ in range(10):
            # read-only: an open file being written would keep its filesystem from being remounted read-only (a
            # disk failing) until this process ends; flock needs no write access. O_NOFOLLOW: a link planted since
            # the check above fails here (ELOOP) rather than being followed
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as error:
                raise UserError(
                    f"--out_dir {str(self.out_dir)!r}: cannot open the lock file {self.path} ({error.strerror}); remove"
                    " it (a run makes the file itself) or choose another --out_dir"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UserError(
                    f"--out_dir {str(self.out_dir)!r} is in use by another run (pid {self._owner() or 'unknown'},"
                    f" lock file {self.path}); wait for it to finish, or choose another --out_dir"
                ) from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # its owner removed it on release while this process opened it: take the new one
                os.close(fd)
                continue
            held = os.read(fd, 64)
            if held.strip() and not held.strip().isdigit():  # a file of the user's that happens to have this name
                os.close(fd)
                raise UserError(
                    f"--out_dir {str(self.out_dir)!r}: {self.path} is not Memfit's lock file (it holds no pid); move"
                    " it, or choose another --out_dir"
                )
            self._write_pid()  # another open file: the lock stays with ``fd``
            self._fd = fd
            remove_staging(self.out_dir)
            return
        raise UserError(f"--out_dir {str(self.out_dir)!r}: could not take the lock {self.path}; try again")

    def _write_pid(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)

    def _owner(self) -> int | None:
        try:
            return int(self.path.read_text().strip())
        except (OSError, ValueError):
            return None

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        # best effort: an out_dir that turned read-only has already been reported, and the kernel frees the lock
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still held, so that no other run takes the file being removed
        os.close(self._fd)
        self._fd = None
        remove_if_empty(self.created_dirs)


def not_memfits_message(out_dir: Path, names: list[str]) -> str:
    return (
        f"--out_dir {str(out_dir)!r} holds {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}, which Memfit did"
        f" not write (no {MARK} in it) and a run would replace or remove; move it out of the way, or choose another"
        " --out_dir"
    )


def remove_staging(out_dir: Path) -> None:
    """What saves that a killed run interrupted left behind (``save_checkpoint``): a staging ``.step-000015.tmp``
    goes; a previous ``.final.old`` goes where the new ``final/`` is in place, else it is put back. Only directories
    with Memfit's staging names that carry its mark are touched: a user's ``.cache.tmp`` or ``.venv.old`` is not."""
    for path in sorted(out_dir.iterdir()):
        # the names first: an out_dir may be a large folder of the user's, whose other entries need no look inside
        if not (_STAGED.match(path.name) or _MOVED_ASIDE.match(path.name)) or not written_by_memfit(path):
            continue
        if _STAGED.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
        elif moved_aside := _MOVED_ASIDE.match(path.name):
            checkpoint = out_dir / moved_aside.group(1)
            if checkpoint.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:  # killed between moving it aside and renaming the new one into place
                os.replace(path, checkpoint)


EARLIER_RUN = ".earlier-run"
"""Where ``--overwrite true`` keeps the run it replaces until the new one has saved its ``final/``"""


def remove_earlier_run(out_dir: Path) -> None:
    """``--overwrite true``: the earlier run's checkpoints leave ``out_dir`` (none can be resumed by mistake) for
    ``out_dir/.earlier-run/``, deleted only when this run's ``final/`` is in place (``save_checkpoint``): a run
    interrupted before that has lost nothing. Where an interrupted ``--overwrite`` already set a run aside and never
    finished, that run stays aside and the interrupted one's checkpoints go; a finished ``final/`` replaces it. Only
    checkpoints Memfit wrote move (``written_by_memfit``): a directory of the user's named ``final`` is refused before
    the run starts (``memfit.settings.run_dirs.check_run_dirs``) and left as it is here."""
    aside = out_dir / EARLIER_RUN
    current = [path for path in [*step_checkpoints(out_dir), out_dir / "final"] if written_by_memfit(path)]
    if written_by_memfit(aside) and not written_by_memfit(out_dir / "final"):
        for path in current:  # an interrupted overwrite's steps: the run set aside is the one worth keeping
            shutil.rmtree(path)
        return
    if not current:
        return
    staging = out_dir / f"{EARLIER_RUN}.tmp"
    remove_own(staging)
    staging.mkdir()
    mark_as_written_by_memfit(staging)
    for path in current:
        os.replace(path, staging / path.name)
    remove_own(aside)
    os.replace(staging, aside)


_STAGED = re.compile(r"^\.(step-\d+|final|earlier-run)\.tmp$")  # a save's, or an overwrite's, staging directory
_MOVED_ASIDE = re.compile(r"^\.(step-\d+|final)\.old$")  # the checkpoint a save replaces, until the new one is in
_CHECKPOINT = re.compile(r"^(final|step-\d+|\.earlier-run)$")


def written_by_memfit(path: Path) -> bool:
    """Whether ``path`` is a directory a Memfit run wrote: it holds ``MARK``, or, written before the mark was, it is a
    whole checkpoint in Memfit's layout (settings and training state), or a run set aside that holds only those."""
    if path.is_symlink() or not path.is_dir():
        return False
    if carries_mark(path):
        return True
    if path.name == EARLIER_RUN:
        held = list(path.iterdir())
        return bool(held) and all(written_by_memfit(checkpoint) for checkpoint in held)
    has_state = (path / "training_state.pth").is_file() or (path / SHARDED_DIR).is_dir()
    return (path / "hyperparameters.yaml").is_file() and has_state


def remove_own(path: Path) -> None:
    """Removes ``path`` where it is a directory Memfit wrote; anything else of that name stays as it is."""
    if written_by_memfit(path):
        shutil.rmtree(path, ignore_errors=True)


def not_written_by_memfit(out_dir: Path) -> list[str]:
    """The entries of ``out_dir`` that have a name a run writes (``final``, ``step-000020``, ``.final.tmp``, ...) but
    that Memfit did not write: a run would replace or remove them, so it is refused before it starts."""
    if not out_dir.is_dir():
        return []
    names = (_CHECKPOINT, _STAGED, _MOVED_ASIDE)
    return sorted(p.name for p in out_dir.iterdir() if any(n.match(p.name) for n in names) and not written_by_memfit(p))
