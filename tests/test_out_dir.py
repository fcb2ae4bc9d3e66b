"""A run's directories: an earlier run is never replaced silently, concurrent runs do not mix (the out_dir's lock),
and a disk that fills or turns read-only ends the run in one line with nothing half-written."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    ROOT,
    cli_exit,
    load_script,
    lora_run,
    run_in_process,
    run_script,
    tiny_train,
)
from memfit.errors import UserError

lora = load_script("finetune/lora.py")


@pytest.mark.slow
def test_rerun_into_an_existing_out_dir_is_refused_then_overwritten_on_request(tmp_path, embedded):
    lora_run(tmp_path, train=tiny_train(max_steps=4, save_interval=2))
    before = (tmp_path / "out/final/lit_model.pth.lora").read_bytes()
    code, err = cli_exit(
        lora, ["--out_dir", str(tmp_path / "out"), "--profile_dir", str(tmp_path / "p2"), "--train.max_steps", "2"]
    )
    # finished: nothing to continue (a resumed run keeps its settings), so --resume is not offered
    assert code == 2 and "already holds a finished run (final)" in err and "--resume" not in err, err
    assert (tmp_path / "out/final/lit_model.pth.lora").read_bytes() == before and not (tmp_path / "p2").exists()
    shutil.copytree(tmp_path / "out", tmp_path / "unfinished", ignore=shutil.ignore_patterns("final"))
    code, err = cli_exit(
        lora,
        ["--out_dir", str(tmp_path / "unfinished"), "--profile_dir", str(tmp_path / "p2"), "--train.max_steps", "2"],
    )
    assert code == 2 and "already holds an unfinished run (step-000002)" in err and "--resume true" in err, err
    lora_run(tmp_path, train=tiny_train(max_steps=3), overwrite=True, seed=7)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["final"]  # the old step-000002 is gone
    assert (tmp_path / "out/final/lit_model.pth.lora").read_bytes() != before


@pytest.mark.slow
def test_a_held_lock_refuses_a_second_run_and_a_lock_nobody_holds_is_taken_over(tmp_path, embedded):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path;"
            " from memfit.training.out_dir import OutDirLock; lock = OutDirLock(Path(sys.argv[1]));"
            " lock.__enter__(); print('held', flush=True); time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        code, err = cli_exit(
            lora, ["--out_dir", str(out), "--profile_dir", str(tmp_path / "p"), "--train.max_steps", "1"]
        )
        assert code == 2 and f"in use by another run (pid {holder.pid}" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert (out / ".memfit.lock").read_text() == f"{holder.pid}\n"  # left by the killed holder, and free
    lora_run(tmp_path, train=tiny_train(max_steps=1))
    assert (out / "final").is_dir() and not (out / ".memfit.lock").exists()
    # a lock file naming a live process that is not a run (its pid reused after a reboot): free too
    shutil.rmtree(out)
    out.mkdir()
    (out / ".memfit.lock").write_text(f"{os.getppid()}\n")
    lora_run(tmp_path, train=tiny_train(max_steps=1))
    assert (out / "final").is_dir()


def _contend_for_the_lock(out: Path, barrier, held, index: int, rounds: int) -> None:
    from memfit.training.out_dir import OutDirLock

    for round_ in range(rounds):
        barrier.wait()  # all start together
        lock = OutDirLock(out)
        try:
            lock.__enter__()
            held[round_ * 4 + index] = 1
        except UserError:
            lock = None
        barrier.wait()  # every contender has tried while the winner holds it
        if lock is not None:
            lock.__exit__(None, None, None)


def test_four_runs_racing_for_one_out_dir_give_it_to_exactly_one(tmp_path):
    """Four processes take the lock at the same moment, 25 times: each time exactly one holds it (a pid written after
    the file was visible let a second process read it as stale, delete it and take it too)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")  # the contenders use os and fcntl only
    rounds = 25
    barrier, held = context.Barrier(4), context.Array("i", 4 * rounds)
    out = tmp_path / "out"
    out.mkdir()
    contenders = [context.Process(target=_contend_for_the_lock, args=(out, barrier, held, i, rounds)) for i in range(4)]
    for process in contenders:
        process.start()
    for process in contenders:
        process.join(120)
    assert all(process.exitcode == 0 for process in contenders)
    holders = [sum(held[r * 4 : (r + 1) * 4]) for r in range(rounds)]
    assert holders == [1] * rounds, holders


@pytest.mark.slow
def test_two_runs_started_together_get_their_own_profile_dirs(tmp_path, embedded):
    args = [
        "--train.max_steps",
        "2",
        "--train.global_batch_size",
        "4",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        "--profile_dir",
        str(tmp_path / "profiles"),
    ]
    # one thread each: two processes of two threads on two cores spin against each other (7 s became 28 s)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "finetune/lora.py"), *args, "--out_dir", str(tmp_path / f"o{i}")],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
    runs = sorted((tmp_path / "profiles").iterdir())
    assert len(runs) == 2 and all((run / "summary.json").is_file() for run in runs)


@pytest.mark.slow
def test_an_out_dir_turning_read_only_mid_run_ends_in_one_line(tmp_path, embedded, disk):
    """The line was right, then two tracebacks followed from releasing the lock on the read-only out_dir."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "finetune/lora.py"),
            "--out_dir",
            str(disk / "out"),
            "--train.save_interval",
            "1",
            "--train.max_steps",
            "400",
            "--profile.enabled",
            "false",
            "--logger_name",
            "csv",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (disk / "out/step-000002").is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "Read-only file system" in line and "continue with --resume true from" in line, line
    assert not [p for p in (disk / "out").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_a_read_only_memfit_cache_is_one_line(tmp_path, disk, monkeypatch):
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    monkeypatch.setenv("MEMFIT_CACHE", str(disk / "cache"))
    result = run_in_process("finetune/lora.py", "--train.max_steps", "1", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: cannot create the embedded default in {str(disk / 'cache')!r} (Read-only file system); set"
        " MEMFIT_CACHE to a writable directory, or give --checkpoint_dir"
    ), result.stderr


@pytest.mark.slow
def test_a_full_disk_stops_with_one_line_and_nothing_half_written(tmp_path, embedded, small_disk):
    (small_disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 96 * 1024))  # leave about 96 KiB
    result = run_script(
        "finetune/lora.py",
        "--out_dir",
        str(small_disk / "out"),
        "--train.max_steps",
        "4",
        "--train.save_interval",
        "2",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "--resume true" in errors[0], errors
    assert f"could not write {small_disk / 'out'}" in errors[0], errors  # the out_dir, not a staging file in /tmp
    assert "Traceback" not in result.stderr
    left = [p.name for p in (small_disk / "out").iterdir()] if (small_disk / "out").exists() else []
    assert all(not name.startswith(".") for name in left), left  # no .tmp, no lock


@pytest.mark.slow
def test_a_full_profile_disk_costs_the_views_not_the_run_and_leaves_no_half_written_file(
    tmp_path, embedded, small_disk
):
    """The run's metrics and summary go to --profile_dir, its checkpoint to --out_dir: a full profile disk is a
    warning per file, the checkpoint saved, exit 0, and nothing half-written left there (the CSV logger's flush
    left a 0-byte metrics.csv)."""
    (small_disk / "filler").write_bytes(b"\0" * (1024 * 1024))
    result = run_script(
        "finetune/lora.py",
        *("--out_dir", str(tmp_path / "out"), "--profile_dir", str(small_disk / "profiles")),
        *("--train.max_steps", "2", "--profile.enabled", "false", "--logger_name", "csv"),
        cwd=tmp_path,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = result.stdout + result.stderr
    assert "warning: could not flush the logger (OSError: [Errno 28] No space left on device)" in said, said
    assert (tmp_path / "out/final/lit_model.pth.lora").is_file()
    files = [p for p in (small_disk / "profiles").rglob("*") if p.is_file()]
    assert files == [], [(p.name, p.stat().st_size) for p in files]


@pytest.mark.slow
def test_a_tensorboard_log_that_fills_its_disk_mid_run_is_one_warning_and_training_goes_on(
    tmp_path, embedded, small_disk
):
    """TensorBoard writes from a thread of its own: its disk filling mid-run ended the run (exit 1, three tracebacks,
    no checkpoint) where the CSV logger's only warned. Now as every logger: one warning, training goes on to its
    checkpoint, and what TensorBoard wrote before is still read."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (small_disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 16 * 1024))
    result = run_script(
        "finetune/lora.py",
        *("--out_dir", str(tmp_path / "out"), "--profile_dir", str(small_disk / "profiles")),
        *("--train.max_steps", "40", "--train.log_interval", "1", "--profile.enabled", "false"),
        *("--logger_name", "tensorboard"),
        cwd=tmp_path,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).splitlines()
    said = [line for line in lines if "tensorboard log" in line]  # the summary's own warning is the next line
    assert len(said) == 1 and said[0].startswith("warning: could not write the tensorboard log in "), said
    assert said[0].endswith("(No space left on device); training goes on without it, and its checkpoints are saved")
    assert (tmp_path / "out/final/lit_model.pth.lora").is_file()
    (run_dir,) = (small_disk / "profiles").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = [event.step for event in events.Scalars("loss")]
    assert logged[:3] == [1, 2, 3] and len(logged) < 40, logged


@pytest.mark.slow
def test_a_save_past_the_file_size_limit_stops_with_one_line(tmp_path, embedded):
    """``ulimit -f`` (RLIMIT_FSIZE, SIGXFSZ ignored as a batch system's shell may): the checkpoint's write fails with
    EFBIG, "File too large", which ended in tracebacks; now one line naming the file and the fix, nothing partial."""
    import subprocess
    import sys

    from conftest import ROOT

    launcher = (
        "import resource, runpy, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, resource.RLIM_INFINITY))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    flags = ["--train.max_steps", "2", "--train.save_interval", "1", "--profile.enabled", "false"]
    result = subprocess.run(
        [sys.executable, "-c", launcher, str(ROOT / "finetune/full.py"), *flags, "--logger_name", "csv"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "File too large" in errors[0] and "ulimit -f" in errors[0], errors
    out = tmp_path / "out/finetune/full"
    assert not out.exists() or all(not p.name.startswith(".") for p in out.iterdir()), list(out.iterdir())


@pytest.mark.slow
def test_a_sharded_save_on_a_full_disk_stops_with_one_line(tmp_path, embedded, small_disk):
    """FSDP on 2 processes: torch's distributed checkpoint gathers each rank's write error into one exception; the
    run ends as the one-process save does: one line naming the checkpoint, the reason and how to continue, exit 1,
    no traceback, nothing half-written."""
    (small_disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 160 * 1024))  # room for the lock, not a checkpoint
    result = run_script(
        "finetune/lora.py",
        *("--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp", "--out_dir", str(small_disk / "out")),
        *("--train.max_steps", "4", "--train.save_interval", "1", "--profile.enabled", "false"),
        *("--logger_name", "csv"),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "--resume true" in errors[0], errors
    assert f"could not write {small_disk / 'out' / 'step-000001'}" in errors[0], errors
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    left = [p.name for p in (small_disk / "out").iterdir()] if (small_disk / "out").exists() else []
    assert all(not name.startswith(".") for name in left), left


def _users_files(directory: Path) -> dict:
    """A user's files in ``directory``, each name with what it is: its bytes, or where a link points."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(directory))] = ("link", os.readlink(path))
        elif path.is_file():
            found[str(path.relative_to(directory))] = ("file", path.read_bytes())
        else:
            found[str(path.relative_to(directory))] = ("dir", None)
    return found


def _plant_users_files(directory: Path) -> dict:
    """Names a careless cleanup takes for its own (``.*.tmp``, ``.*.old``, ``step-*``) on a user's files."""
    for name in (".cache.tmp", ".venv.old", ".step.tmp", "step-notes", ".final.tmp.bak"):
        (directory / name).mkdir(parents=True)
        (directory / name / "kept.txt").write_text(f"the user's {name}")
    (directory / ".config.old").write_text("a file of the user's")
    (directory / "config").mkdir()  # a directory named like .config.old without its suffix
    (directory / "notes.txt").write_text("notes")
    (directory / "to-notes").symlink_to("notes.txt")
    return _users_files(directory)


def test_taking_the_lock_clears_what_a_save_killed_mid_way_left(tmp_path):
    """A run killed inside a save leaves its staging directory, or (killed between the two renames of a final save)
    the previous final/ moved aside: the next run in the out_dir removes the first and puts the second back. Only
    Memfit's own, which carry its mark: the user's files beside them stay, byte for byte."""
    from memfit.files import mark_as_written_by_memfit
    from memfit.training.out_dir import OutDirLock

    out = tmp_path / "out"
    users = _plant_users_files(out)
    for name in (".step-000015.tmp", ".final.old", "step-000010", ".step-000010.old", ".earlier-run.tmp"):
        (out / name).mkdir(parents=True)
        mark_as_written_by_memfit(out / name)
        (out / name / "lit_model.pth.lora").write_text(name)
    with OutDirLock(out):
        memfits = [name for name in os.listdir(out) if name.split("/")[0] not in {n.split("/")[0] for n in users}]
        assert sorted(memfits) == [".memfit.lock", "final", "step-000010"]
    assert (out / "final/lit_model.pth.lora").read_text() == ".final.old"
    assert (out / "step-000010/lit_model.pth.lora").read_text() == "step-000010"
    for name in ("final", "step-000010"):
        shutil.rmtree(out / name)
    assert _users_files(out) == users


def test_a_lock_file_that_is_a_link_or_a_users_file_is_refused_and_left_alone(tmp_path):
    """``.memfit.lock`` as a link to a user's file had the pid written into that file; a user's file of that name
    would have been overwritten. Both are refused in one line, and nothing changes."""
    from memfit.training.out_dir import OutDirLock

    out = tmp_path / "out"
    out.mkdir()
    precious = tmp_path / "thesis.tex"
    precious.write_text("\\chapter{Results}")
    (out / ".memfit.lock").symlink_to(precious)
    with pytest.raises(UserError, match=r"\.memfit\.lock is a symbolic link, not Memfit's lock file; remove it"):
        OutDirLock(out).__enter__()
    assert precious.read_text() == "\\chapter{Results}" and os.readlink(out / ".memfit.lock") == str(precious)
    (out / ".memfit.lock").unlink()
    (out / ".memfit.lock").write_text("my lock notes\n")
    with pytest.raises(UserError, match="is not Memfit's lock file \\(it holds no pid\\); move it"):
        OutDirLock(out).__enter__()
    assert (out / ".memfit.lock").read_text() == "my lock notes\n"
    (out / ".memfit.lock").write_text("12345\n")  # a killed run's lock: taken over, and removed on release
    with OutDirLock(out):
        assert (out / ".memfit.lock").read_text() == f"{os.getpid()}\n"
    assert not (out / ".memfit.lock").exists()


def test_a_file_written_whole_replaces_a_link_in_its_place_and_never_writes_through_it(tmp_path):
    from memfit.files import write_text_whole

    precious = tmp_path / "precious.txt"
    precious.write_text("kept")
    (tmp_path / "summary.json").symlink_to(precious)
    write_text_whole(tmp_path / "summary.json", "{}")
    assert precious.read_text() == "kept" and (tmp_path / "summary.json").read_text() == "{}"
    assert not (tmp_path / "summary.json").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt", "summary.json"]


@pytest.mark.slow
def test_a_run_a_killed_run_its_resume_and_an_overwrite_leave_a_users_files_as_they_were(tmp_path, embedded):
    """--out_dir a folder of the user's: every byte, name and link of theirs is unchanged after a run killed
    mid-save-interval (SIGKILL: no cleanup of its own), its resume, and an --overwrite true run."""
    out = tmp_path / "out"
    users = _plant_users_files(out)
    args = ["--out_dir", str(out), "--data", "JSON", "--data.json_path", str(embedded[1])]
    args += ["--data.val_split_fraction", "0.1", "--train.save_interval", "2", "--train.max_steps", "6"]
    args += ["--train.global_batch_size", "8", "--train.micro_batch_size", "4", "--profile.enabled", "false"]
    killed = subprocess.Popen(
        [sys.executable, str(ROOT / "finetune/lora.py"), *args, "--profile_dir", str(tmp_path / "p1")],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # killed with its data loader's workers, as a scheduler kills a job
    )
    deadline = time.monotonic() + 240
    while not (out / "step-000002").exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert (out / "step-000002").is_dir(), killed.stderr.read()[-2000:]
    assert _users_files(out) == {**users, **{k: v for k, v in _users_files(out).items() if k not in users}}
    resumed = run_in_process(
        "finetune/lora.py", *args, "--profile_dir", str(tmp_path / "p2"), "--resume", "auto", cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    overwritten = run_in_process(
        "finetune/lora.py", *args, "--profile_dir", str(tmp_path / "p3"), "--overwrite", "true", cwd=tmp_path
    )
    assert overwritten.returncode == 0, overwritten.stderr[-2000:]
    assert (out / "final").is_dir() and not (out / ".earlier-run").exists()
    left = {k: v for k, v in _users_files(out).items() if k.split("/")[0] in {n.split("/")[0] for n in users}}
    assert left == users


@pytest.mark.slow
def test_a_users_directory_named_like_a_checkpoint_is_refused_before_the_run(tmp_path, embedded):
    """A user's ``final/`` or ``.final.tmp/`` (no Memfit mark, not a checkpoint's layout) would be replaced or
    removed by a run, --overwrite true included: refused in one line, the directory as it was."""
    for name in ("final", ".step-000002.tmp"):
        out = tmp_path / name.strip(".") / "out"
        (out / name).mkdir(parents=True)
        (out / name / "draft.md").write_text("mine")
        for extra in ([], ["--overwrite", "true"]):
            result = run_in_process(
                "finetune/lora.py",
                *["--out_dir", str(out), "--profile_dir", str(tmp_path / "p"), *extra],
                *["--data", "JSON", "--data.json_path", str(embedded[1]), "--data.val_split_fraction", "0.1"],
                cwd=tmp_path,
            )
            assert result.returncode == 2, result.stderr[-2000:]
            assert result.stderr.strip().splitlines() == [
                f"error: --out_dir {str(out)!r} holds {name}, which Memfit did not write (no .memfit-run in it) and a"
                " run would replace or remove; move it out of the way, or choose another --out_dir"
            ]
            assert sorted(p.name for p in out.iterdir()) == [name] and (out / name / "draft.md").read_text() == "mine"


@pytest.mark.slow
def test_overwrite_never_deletes_the_checkpoint_the_run_starts_from(tmp_path, embedded):
    """The README calls a full fine-tune's final/ a base for the next run; --overwrite of that out_dir would delete it
    before loading it. Refused in one line, and the model is still there; a LoRA run reading it too."""
    out = tmp_path / "out"
    from memfit.files import mark_as_written_by_memfit

    shutil.copytree(embedded[0], out / "final")  # a finished run's final/: a whole model with its config and tokenizer
    mark_as_written_by_memfit(out / "final")
    before = (out / "final/lit_model.pth").read_bytes()
    for script in ("finetune/full.py", "finetune/lora.py"):
        result = run_in_process(
            script,
            "--checkpoint_dir",
            str(out / "final"),
            "--out_dir",
            str(out),
            "--data",
            "JSON",
            "--data.json_path",
            str(embedded[1]),
            "--data.val_split_fraction",
            "0.1",
            "--overwrite",
            "true",
            "--train.max_steps",
            "1",
            cwd=tmp_path,
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip().splitlines() == [
            f"error: --overwrite true would delete {str(out / 'final')!r}, which --checkpoint_dir"
            f" {str(out / 'final')!r} reads; choose another --out_dir (or move that checkpoint out of it first)"
        ]
        assert (out / "final/lit_model.pth").read_bytes() == before


@pytest.mark.slow
def test_views_on_a_full_disk_are_whole_or_absent_and_the_run_still_ends_with_its_lines(tmp_path, embedded):
    """--profile_dir on a 2 MiB disk: the trace, the page (plotly's library alone is over 4 MiB), the picture, the
    ledger and the summary cannot all fit. Each view is written whole or not at all (a reader never meets a
    truncated ledger.json), a failure is a warning naming the file, no partial file is left, and the run still exits
    0 with its closing lines and the checkpoint saved."""
    import json

    from conftest import _mount_tmpfs

    disk = _mount_tmpfs(tmp_path / "views", "size=2m")
    try:
        result = run_script(
            "finetune/lora.py",
            *("--accelerator", "cpu", "--precision", "32-true", "--train.max_steps", "3"),
            *("--profile.enabled", "true", "--profile_dir", str(disk / "profiles"), "--logger_name", "csv"),
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        out = result.stdout + result.stderr
        assert "Checkpoint: out/finetune/lora/final" in out and "could not write" in out, out[-3000:]
        files = [p for p in (disk / "profiles").rglob("*") if p.is_file()]
        assert not [p for p in files if p.name.endswith((".tmp", ".partial"))], files
        for view in (p for p in files if p.suffix == ".json"):
            json.loads(view.read_text())  # whole, or not there
        assert (tmp_path / "out/finetune/lora/final/lit_model.pth.lora").is_file()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_runs_started_together_on_a_fresh_machine_build_the_embedded_default_once(tmp_path, embedded):
    """The first run builds the embedded default (a minute on 2 cores) holding a lock on the cache directory; a run
    started beside it waits and takes its copy instead of building its own."""
    import fcntl
    import os
    import shutil
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    cache.mkdir()
    builder = os.open(cache, os.O_RDONLY)
    fcntl.flock(builder, fcntl.LOCK_EX)  # as the first run holds it while it builds
    waiting = subprocess.Popen(
        [sys.executable, "-c", "from memfit.training.embedded import ensure_embedded; print(ensure_embedded()[0])"],
        env={**os.environ, "MEMFIT_CACHE": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(8)
    assert waiting.poll() is None, waiting.communicate()  # it waits for the builder
    shutil.copytree(embedded[0].parent, cache / embedded[0].parent.name)  # the builder's copy, renamed into place
    os.close(builder)
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0 and "building the embedded default" not in err, err[-2000:]
    assert out.strip() == str(cache / embedded[0].parent.name / "checkpoint")
