"""Signals from outside, sent for real: a preemption (SIGTERM from SLURM, Kubernetes or a spot instance; SIGUSR1 from
SLURM's --signal) saves the steps taken and ends with the command that continues, which ends with the weights of a
run left alone; a burst of Ctrl-C ends a run in one line, whatever cleanup it lands in."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from conftest import ROOT, WEIGHTS, _runs_a_recipe, offline, run_in_process
from memfit.training.signals import RunSignals

SCRIPTS = {
    "lora": "finetune/lora.py",
    "adapter": "finetune/adapter.py",
    "adapter_v2": "finetune/adapter_v2.py",
    "full": "finetune/full.py",
    "pretrain": "pretrain/pretrain.py",
}
# 24 steps of the embedded default, a checkpoint every 4; no validation before the end
ARGS = [
    "--accelerator",
    "cpu",
    "--precision",
    "32-true",
    "--train.max_steps",
    "24",
    "--train.save_interval",
    "4",
    "--train.log_interval",
    "1",
    "--eval.interval",
    "1000",
    "--eval.final_validation",
    "false",
    "--profile.enabled",
    "false",
    "--logger_name",
    "csv",
]


def _args(script: str) -> list[str]:
    # pretraining's default step is 16 blocks of 128 tokens; a quarter of it keeps the test as fast as the others
    short = ["--train.global_batch_size", "8", "--train.micro_batch_size", "4", "--train.max_seq_length", "64"]
    return ARGS + (short if script == "pretrain" else [])


def _out(script: str) -> str:
    return "out/pretrain" if script == "pretrain" else f"out/finetune/{script}"


def _start(script: str, cwd: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    _runs_a_recipe(SCRIPTS[script])
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **offline(cwd / "network.log"), **(env or {})}
    # SIG_DFL: a shell's background job starts with Ctrl-C ignored, which its children would inherit
    return subprocess.Popen(
        [sys.executable, str(ROOT / SCRIPTS[script]), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared: {process.poll()}"


def _weights(run: Path, script: str) -> dict:
    return torch.load(run / _out(script) / "final" / WEIGHTS[script], weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, signum",
    [
        ("lora", signal.SIGTERM),
        ("adapter", signal.SIGUSR1),
        ("adapter_v2", signal.SIGHUP),  # a closed terminal
        ("full", signal.SIGUSR1),
        ("pretrain", signal.SIGTERM),
        ("lora", signal.SIGINT),  # one Ctrl-C keeps the steps taken, as a preemption does
    ],
)
def test_a_preempted_run_saves_its_steps_and_resume_auto_ends_as_a_run_left_alone(tmp_path, embedded, script, signum):
    """Each script's path; the run left alone, to compare the weights with, for the two whose checkpoints differ most
    (LoRA with dropout's generators, pretraining's whole model on text batches; FSDP's in tests/test_fsdp.py)."""
    exact = script in ("lora", "pretrain")
    if exact:
        straight = run_in_process(SCRIPTS[script], *_args(script), cwd=tmp_path)
        assert straight.returncode == 0, straight.stderr[-2000:]

    run = tmp_path / "preempted"
    process = _start(script, run, *_args(script))
    _wait_for(run / _out(script) / "step-000004", process)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr[-2000:]
    assert "Traceback" not in stderr
    stopped = "Interrupted by Ctrl-C" if signum == signal.SIGINT else f"Preempted by {signal.Signals(signum).name}"
    (line,) = [line for line in stderr.splitlines() if line.startswith(stopped)]
    saved = max((run / _out(script)).glob("step-*"))
    step = int(saved.name.split("-")[1])
    # every step taken is kept: the signal may land before step 5 (step-000004 is then the run's latest) or after
    assert 4 <= step < 24 and not (run / _out(script) / "final").exists(), (step, stderr[-2000:])
    assert line.startswith(
        f"{stopped} after step {step}: saved {Path(_out(script)) / saved.name}; continue with python "
    ), line
    assert line.endswith(" --resume auto"), line
    assert [p.name for p in (run / _out(script)).iterdir() if p.name.startswith(".")] == []  # no .tmp, no lock

    resumed = run_in_process(SCRIPTS[script], *_args(script), "--resume", "auto", cwd=run)
    assert resumed.returncode == 0 and f"at step {step}" in resumed.stdout, resumed.stderr[-2000:]
    # its losses are of the part it trained, and it says so
    assert f" over steps {step + 1}-24 (resumed)" in resumed.stdout, resumed.stdout[-2000:]
    assert (run / _out(script) / "final" / WEIGHTS[script]).is_file()
    if exact:
        a, b = _weights(tmp_path, script), _weights(run, script)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_burst_of_ctrl_c_ends_the_run_in_one_line_with_nothing_half_written(tmp_path, embedded):
    """Ctrl-C stops at once; the presses that follow (an impatient user, a stuck key) land in the cleanup (a
    checkpoint being written, the profiler, the lock) and are ignored, so none of it is cut short in a traceback."""
    process = _start(
        "lora",
        tmp_path,
        "--train.save_interval",
        "1",
        "--train.max_steps",
        "400",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
    )
    out = tmp_path / "out/finetune/lora"
    _wait_for(out / "step-000003", process)
    for _ in range(40):
        process.send_signal(signal.SIGINT)
        time.sleep(0.01)
    _, stderr = process.communicate(timeout=120)
    # the exit status a shell reads as Ctrl-C's, not the signal's own (-2: a press cut the exit short)
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no .tmp, no lock
    assert not (out / "final").exists()
    latest = out / max(p.name for p in out.glob("step-*"))
    # the first press lands mid-step (the second then stops at once) or, by chance, as the step ends (the run saves
    # and stops before a second is read): either way one line, naming the checkpoint to continue from
    ended = [line for line in stderr.splitlines() if line.startswith("Interrupted")]
    assert len(ended) == 1, stderr[-2000:]
    assert ended[0].startswith(("Interrupted after step", "Interrupted by Ctrl-C after step")), ended
    assert str(Path("out/finetune/lora") / latest.name) in ended[0], ended
    assert stderr.rstrip().endswith("--profile.enabled false --logger_name csv --resume auto")


@pytest.mark.slow
def test_ctrl_c_in_an_overwriting_run_keeps_the_run_it_replaces(tmp_path, embedded):
    """--overwrite true over a finished run, interrupted before its own final/ is saved: the finished run is kept,
    whole, in .earlier-run/ (the last line says where), a plain rerun is refused instead of deleting it at its end,
    and the next --overwrite that finishes replaces it."""
    out = tmp_path / "out/finetune/lora"
    first = _start("lora", tmp_path, *ARGS, "--train.max_steps", "2")
    assert first.wait(timeout=240) == 0, first.stderr.read()[-2000:]
    finished = (out / "final/lit_model.pth.lora").read_bytes()
    # no checkpoint of its own before the Ctrl-C: the run set aside is all the out_dir holds
    # steps of 16 micro-batches (a second or more each): both presses land inside one step
    long_steps = ["--train.global_batch_size", "64", "--train.max_steps", "400", "--train.save_interval", "1000"]
    process = _start("lora", tmp_path, *ARGS, "--overwrite", "true", *long_steps)
    _wait_for(out / ".earlier-run", process)
    time.sleep(1)
    # twice, the second before the step in flight ends (where the first press would save): it stops at once. Apart,
    # or the kernel merges the two before Python's handler runs
    process.send_signal(signal.SIGINT)
    time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert (out / ".earlier-run/final/lit_model.pth.lora").read_bytes() == finished
    assert f"the run it replaces is kept, whole, in {Path('out/finetune/lora/.earlier-run')}" in stderr, stderr
    refused = run_in_process("finetune/lora.py", *ARGS, "--train.max_steps", "2", cwd=tmp_path)
    assert refused.returncode == 2 and "holds the run an interrupted --overwrite set aside" in refused.stderr, refused
    again = _start("lora", tmp_path, *ARGS, "--overwrite", "true", "--train.max_steps", "2", "--seed", "7")
    assert again.wait(timeout=240) == 0, again.stderr.read()[-2000:]
    assert not (out / ".earlier-run").exists()
    assert (out / "final/lit_model.pth.lora").read_bytes() != finished


@pytest.mark.slow
def test_a_preemption_while_loading_ends_the_run_at_once(tmp_path, embedded):
    """SIGTERM as the run starts reading its data and model (the line Lightning prints just before): the run stops
    there, exit 143, one line saying so, nothing saved and no traceback; before, the handler only recorded it and
    the run went on loading (minutes for a large checkpoint) into training."""
    process = _start("lora", tmp_path, *ARGS)
    deadline = time.monotonic() + 120
    seen = ""
    while "Seed set" not in seen and process.poll() is None and time.monotonic() < deadline:
        seen += process.stderr.readline()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    stderr = seen + stderr
    assert process.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert "Preempted by SIGTERM before its first step (while loading): nothing to save" in stderr, stderr[-2000:]
    assert not (tmp_path / "out/finetune/lora").exists() or not any(
        p.name.startswith(("step-", "final")) for p in (tmp_path / "out/finetune/lora").iterdir()
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, code, says",
    [
        (signal.SIGTERM, 143, "Preempted by SIGTERM before its first step (while loading): nothing was saved"),
        (signal.SIGINT, 130, "Interrupted (Ctrl-C) before training began: nothing was saved"),
    ],
)
def test_a_signal_during_the_embedded_defaults_first_build_leaves_no_staging_dir(tmp_path, signum, code, says):
    """The first run on a machine builds the embedded default (a minute on 2 cores): SIGTERM there ended the process
    with no word and left the build's staging directory in the cache for good; Ctrl-C ended in a traceback."""
    cache = tmp_path / "cache"
    process = _start("lora", tmp_path, *ARGS, env={"MEMFIT_CACHE": str(cache)})
    deadline = time.monotonic() + 120
    while not any(cache.glob("embedded-v*.*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the staging directory exists: the build has begun
    time.sleep(1.0)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr and says in stderr, stderr[-2000:]
    assert list(cache.iterdir()) == [], list(cache.iterdir())  # no staging dir, and no half-built default


@pytest.mark.slow
def test_the_next_build_removes_the_staging_dir_a_killed_build_left_and_nothing_else(tmp_path):
    """SIGKILL (no handler runs) during the embedded default's first build left its staging directory in the cache
    for good: the next build removes it, and only it: a directory of the user's with a similar name stays."""
    import memfit.training.embedded as embedded_module

    cache = tmp_path / "cache"
    target = cache / "embedded-vtest"
    killed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, memfit.training.embedded as e; e.ensure_embedded(e.Path(sys.argv[1]))",
            str(target),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not any(cache.glob("embedded-vtest.*/*")) and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the staging directory holds something: the build has begun
    killed.kill()
    killed.wait()
    (left,) = cache.glob("embedded-vtest.*")
    users = cache / "embedded-vtest.mine"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    checkpoint_dir, _ = embedded_module.ensure_embedded(target)
    assert (checkpoint_dir / "lit_model.pth").is_file() and not left.exists()
    assert sorted(p.name for p in cache.iterdir()) == ["embedded-vtest", "embedded-vtest.mine"]
    assert (users / "notes.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_the_profiler_writes_its_trace_leaves_nothing_partial(tmp_path, embedded, signum, code):
    """The signal is sent the moment the profiler's trace file appears (torch writes it through a ``.tmp`` file and
    renames it): a preemption still ends in one line after saving the steps taken, Ctrl-C in one line, and neither
    leaves a partial trace, a staging dir or a lock behind."""
    process = _start(
        "lora",
        tmp_path,
        *ARGS,
        "--profile.enabled",
        "true",
        "--profile.record_shapes",
        "true",
        "--profile.active",
        "2",
    )
    deadline = time.monotonic() + 240
    trace = []
    while not trace and process.poll() is None and time.monotonic() < deadline:
        trace = list(tmp_path.glob("out/profiles/*/rank0.*.pt.trace.json*"))
        time.sleep(0.001)
    assert trace, f"no trace was written: {process.poll()}"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    says = "Preempted by SIGTERM after step" if signum == signal.SIGTERM else "Interrupted by Ctrl-C after step"
    assert stderr.count(says) == 1, stderr[-2000:]
    (run_dir,) = (tmp_path / "out" / "profiles").iterdir()
    assert not list(run_dir.glob("*.tmp")), list(run_dir.iterdir())
    out = tmp_path / "out/finetune/lora"
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no staging, no lock
    assert list(out.glob("step-*")), list(out.iterdir())  # either signal saves the steps taken


@pytest.mark.slow
def test_a_preempted_run_keeps_the_ledger_picture_and_page_of_the_step_it_recorded(tmp_path, embedded):
    """The views are why a step was recorded: a run preempted after it writes them, and its summary says it did not
    finish (the ledger names the step: the default window records step 3)."""
    import json

    window_on = ARGS.index("--profile.enabled")
    args = ARGS[:window_on] + ARGS[window_on + 2 :]
    process = _start("lora", tmp_path, *args)
    _wait_for(tmp_path / "out/finetune/lora/step-000004", process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-2000:]
    (run_dir,) = (tmp_path / "out" / "profiles").iterdir()
    for view in ("ledger.json", "memory_step.png", "memory_step.html", "summary.json"):
        assert (run_dir / view).is_file(), (view, stdout[-2000:], stderr[-2000:])
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["step"] == 3 and ledger["complete"], ledger
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"].startswith("SIGTERM after step"), summary
    assert "Stopped by SIGTERM after step" in stdout and "Done:" not in stdout, stdout[-2000:]
    # its speed over the steps it took, as a finished run reports it (it said 0 tokens/s)
    assert summary["train_seconds"] > 0 and summary["tokens_trained"] > 0 and summary["tokens_per_s"] > 0, summary
    assert " 0 tokens/s" not in stdout


@pytest.mark.parametrize("signum, ignored", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_run_ending_on_ctrl_c_ignores_the_presses_that_follow(signum, ignored):
    """A run that stops on a first Ctrl-C (saved at the top of the next step) leaves Ctrl-C ignored to the process's
    end: a press still pending from the burst would otherwise land in the atexit handlers, in a traceback, and the
    process would end with the signal's status instead of 130. A preemption by SIGTERM gives back the handler it
    found, as any run inside another program must."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    previous = signal.getsignal(signal.SIGINT)
    # a handler of the test's own: a run earlier in this worker's process may have ended ignoring Ctrl-C, the state a
    # run hands back to its caller, which would read here as a run leaving Ctrl-C ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with RunSignals() as signals:
            assert signals.requested(fabric) == 0  # training has begun
            os.kill(os.getpid(), signum)
            assert signals.requested(fabric) == signum  # recorded, not raised: the step would save here
        assert signal.getsignal(signal.SIGINT) is (signal.SIG_IGN if ignored else signal.default_int_handler)
        if ignored:
            os.kill(os.getpid(), signal.SIGINT)  # before, the previous handler was back: KeyboardInterrupt here
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, previous)
