"""A run is either correct and saved, or stopped at once with a reason: each test here failed on the code before
the fix it guards (see issue "Trust")."""

import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, instrumentation_fails_in, load_script, run_in_process, run_script, run_summary, tiny_train
from memfit.errors import UserError

lora = load_script("finetune/lora.py")


def _quiet(**overrides):
    from memfit.profiling import ProfileArgs

    overrides.setdefault("train", tiny_train(max_steps=4))
    overrides.setdefault("profile", ProfileArgs(enabled=False))
    overrides.setdefault("logger_name", "csv")
    return overrides


def _lora(tmp_path: Path, **overrides):
    return lora.setup(out_dir=tmp_path / "out", profile_dir=tmp_path / "profiles", **_quiet(**overrides))


def _cli(script_module, args: list[str]) -> tuple[int, str]:
    from memfit.cli import CLI

    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        CLI(script_module.setup, args)
    return exit_info.value.code, stderr.getvalue()


# 2. Nothing optional stands between the last step and the final checkpoint.


def test_a_broken_trace_costs_the_ledger_not_the_run(tmp_path, embedded, monkeypatch, capsys):
    """The profiler's trace file ends up unparsable (cut short) and a partial ``.json.tmp`` lies beside it: the run
    still saves final/, warns in one line, and lists only finished traces."""
    import memfit.profiling as profiling
    from memfit.profiling import ProfileArgs

    real_handler = profiling.tensorboard_trace_handler

    def handler_then_damage(directory, worker_name):
        write = real_handler(directory, worker_name=worker_name)

        def on_trace_ready(prof):
            write(prof)
            for trace in Path(directory).glob("*.pt.trace.json"):
                trace.write_text(trace.read_text()[: trace.stat().st_size // 2])
                Path(f"{trace}.tmp").write_text('{"traceEvents": [')

        return on_trace_ready

    monkeypatch.setattr(profiling, "tensorboard_trace_handler", handler_then_damage)
    run = _lora(tmp_path, profile=ProfileArgs(wait=1, warmup=0, active=1))
    out = capsys.readouterr().out
    assert (tmp_path / "out/final/lit_model.pth.lora").is_file()
    assert "warning: could not complete the ledger from the profiler trace (JSONDecodeError" in out
    assert run.trace_files and all(p.name.endswith(".json") for p in run.trace_files)
    assert run_summary(tmp_path / "profiles")["checkpoint"].endswith("final")


def test_a_trace_cut_short_between_two_events_is_not_read_as_whole(tmp_path):
    """The event reader stopped without complaint where a cut trace happened to end right after an event (about
    one run in fifty of the test above, which cuts at half the file): the ledger was then built from half a step."""
    import json

    from memfit.profiling import read_trace_events

    events = '{"traceEvents": [\n{"name": "[memory]", "ts": 1, "args": {}},\n{"cat": "cpu_op", "name": "x", "ts": 2}'
    (tmp_path / "whole.json").write_text(events + "\n]}")
    assert len(read_trace_events(tmp_path / "whole.json")) == 2
    (tmp_path / "cut.json").write_text(events + ",\n")
    with pytest.raises(json.JSONDecodeError, match="ends before its list of events"):
        read_trace_events(tmp_path / "cut.json")


def test_frame_names_torch_writes_unescaped_are_escaped_in_the_trace(tmp_path):
    """A Python function whose name and file name hold quotes (a frame of protobuf's, imported by
    TensorBoard's logger on its first write, made a short run's whole trace unreadable), profiled with stacks
    through TensorBoard's trace handler as Memfit's window is: after ``escape_trace_strings`` the file is JSON and
    the frame's event has its name exactly; a trace torch wrote valid is left byte for byte."""
    import types

    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    from memfit.profiling import escape_trace_strings, read_trace_events

    namespace, odd_file = {}, str(tmp_path / 'odd "dir"' / "x.py")
    exec(compile("def work(x):\n    return (x @ x).sum()\n", odd_file, "exec"), namespace)
    odd_name = 'work "q"'  # (torch's tracer writes a backslash as "/" itself)
    work = types.FunctionType(namespace["work"].__code__.replace(co_name=odd_name, co_qualname=odd_name), {})
    for label, function in (("odd", work), ("plain", torch.ones_like)):
        out = tmp_path / label
        with profile(
            activities=[ProfilerActivity.CPU],
            with_stack=True,
            profile_memory=True,
            on_trace_ready=tensorboard_trace_handler(str(out), worker_name="rank0"),
        ):
            function(torch.ones(8, 8))
        (trace,) = out.glob("*.pt.trace.json")
        raw = trace.read_bytes()
        try:
            json.loads(raw)
            written_valid = True
        except ValueError:
            written_valid = False
        escaped = escape_trace_strings(trace)
        events = json.loads(trace.read_text())["traceEvents"]  # valid JSON now, whatever torch wrote
        assert escaped == (0 if written_valid else 1), (label, escaped)
        if written_valid:
            assert trace.read_bytes() == raw
        if label == "odd":
            assert f"{odd_file}(1): {odd_name}" in {e.get("name") for e in events}
            assert any(e["name"].endswith(odd_name) for e in read_trace_events(trace))


def test_a_warm_up_dropped_for_a_short_run_gets_no_warning_from_torch(tmp_path):
    """A run too short for the profiler's warm-up gets a window without one, Memfit's choice: torch's "won't be
    using warmup" warning would blame the user. A warm-up of 0 the user asked for keeps torch's warning."""
    import warnings

    from memfit.profiling import ProfileArgs, ProfilerWindow

    for args, total_steps, warned in ((ProfileArgs(), 1, False), (ProfileArgs(warmup=0), 4, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ProfilerWindow(args, tmp_path / f"w{total_steps}", torch.device("cpu"), total_steps) as window:
                for _ in range(total_steps):
                    torch.ones(4).sum()
                    window.step()
        messages = [str(w.message) for w in caught]
        assert any("won't be using warmup" in m for m in messages) == warned, messages


def test_a_recorded_step_that_fails_under_the_instrumentation_is_taken_again_without_it(
    tmp_path, embedded, monkeypatch
):
    """The recorded step fails half-way through its backward, inside autograd's engine (some of the failed attempt's
    gradients accumulated), as the instrumentation failing would (seen on an H100): the run warns in one line, takes
    the step again without the instrumentation, and ends with the same weights as a run whose recorded step did not
    fail (the same batches in the same order: the window's plan puts the longest one in the recorded step), and with
    no trace or ledger."""
    common = [
        "--train.max_steps",
        "4",
        "--train.micro_batch_size",
        "2",
        "--train.global_batch_size",
        "4",
        "--logger_name",
        "csv",
        "--eval.interval",
        "100",
    ]
    (tmp_path / "failed").mkdir(), (tmp_path / "recorded").mkdir()
    recorded = run_in_process("finetune/full.py", *common, cwd=tmp_path / "recorded")
    instrumentation_fails_in(monkeypatch, "backward")
    failed = run_in_process("finetune/full.py", *common, cwd=tmp_path / "failed")
    assert failed.returncode == 0 and recorded.returncode == 0, failed.stderr[-2000:] + recorded.stderr[-2000:]
    warnings = [line for line in failed.stdout.splitlines() if line.startswith("warning:")]
    assert (
        len(warnings) == 1
        and "the recorded step failed under the memory instrumentation (RuntimeError:"
        " simulated failure of the recorded step in backward"
        in warnings[0]
    ), failed.stdout[-2000:]
    a = torch.load(tmp_path / "failed/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "recorded/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:  # the failed attempt's gradients were dropped: the step counts its batches once
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    summary = run_summary(tmp_path / "failed/profiles")
    assert summary["steps"] == 4 and summary["ledger_peak_bytes"] is None and summary["profile_traces"] == []
    assert not list((tmp_path / "failed/profiles").glob("*/ledger.json"))


def test_a_recorded_step_that_fails_after_its_update_is_not_taken_again(tmp_path, embedded, monkeypatch):
    """The instrumentation fails after optimizer.step() (at the end of zero_grad): taking the step again would apply
    the update twice. The run warns, keeps the one update, and ends with the weights of a run that did not fail."""
    common = [
        "--train.max_steps",
        "4",
        "--train.micro_batch_size",
        "2",
        "--train.global_batch_size",
        "4",
        "--logger_name",
        "csv",
        "--eval.interval",
        "100",
    ]
    (tmp_path / "failed").mkdir(), (tmp_path / "recorded").mkdir()
    recorded = run_in_process("finetune/full.py", *common, cwd=tmp_path / "recorded")
    instrumentation_fails_in(monkeypatch, "zero_grad")
    failed = run_in_process("finetune/full.py", *common, cwd=tmp_path / "failed")
    assert failed.returncode == 0 and recorded.returncode == 0, failed.stderr[-2000:] + recorded.stderr[-2000:]
    warnings = [line for line in failed.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "in zero_grad" in warnings[0] and "after the weights were updated" in warnings[0], (
        failed.stdout[-2000:]
    )
    a = torch.load(tmp_path / "failed/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "recorded/out/finetune/full/final/lit_model.pth", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


# 3. An earlier run is never replaced silently; concurrent runs do not mix.


def test_rerun_into_an_existing_out_dir_is_refused_then_overwritten_on_request(tmp_path, embedded):
    _lora(tmp_path, train=tiny_train(max_steps=4, save_interval=2))
    before = (tmp_path / "out/final/lit_model.pth.lora").read_bytes()
    code, err = _cli(
        lora, ["--out_dir", str(tmp_path / "out"), "--profile_dir", str(tmp_path / "p2"), "--train.max_steps", "2"]
    )
    # finished: nothing to continue (a resumed run keeps its settings), so --resume is not offered
    assert code == 2 and "already holds a finished run (final)" in err and "--resume" not in err, err
    assert (tmp_path / "out/final/lit_model.pth.lora").read_bytes() == before and not (tmp_path / "p2").exists()
    shutil.copytree(tmp_path / "out", tmp_path / "unfinished", ignore=shutil.ignore_patterns("final"))
    code, err = _cli(
        lora,
        ["--out_dir", str(tmp_path / "unfinished"), "--profile_dir", str(tmp_path / "p2"), "--train.max_steps", "2"],
    )
    assert code == 2 and "already holds an unfinished run (step-000002)" in err and "--resume true" in err, err
    _lora(tmp_path, train=tiny_train(max_steps=3), overwrite=True, seed=7)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["final"]  # the old step-000002 is gone
    assert (tmp_path / "out/final/lit_model.pth.lora").read_bytes() != before


def test_a_held_lock_refuses_a_second_run_and_a_lock_nobody_holds_is_taken_over(tmp_path, embedded):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path;"
            " from memfit.checkpoint import OutDirLock; lock = OutDirLock(Path(sys.argv[1]));"
            " lock.__enter__(); print('held', flush=True); time.sleep(60)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        code, err = _cli(lora, ["--out_dir", str(out), "--profile_dir", str(tmp_path / "p"), "--train.max_steps", "1"])
        assert code == 2 and f"in use by another run (pid {holder.pid}" in err, err
    finally:
        holder.kill()
        holder.wait()
    assert (out / ".memfit.lock").read_text() == f"{holder.pid}\n"  # left by the killed holder, and free
    _lora(tmp_path, train=tiny_train(max_steps=1))
    assert (out / "final").is_dir() and not (out / ".memfit.lock").exists()
    # a lock file naming a live process that is not a run (its pid reused after a reboot): free too
    shutil.rmtree(out)
    out.mkdir()
    (out / ".memfit.lock").write_text(f"{os.getppid()}\n")
    _lora(tmp_path, train=tiny_train(max_steps=1))
    assert (out / "final").is_dir()


def _contend_for_the_lock(out: Path, barrier, held, index: int, rounds: int) -> None:
    from memfit.checkpoint import OutDirLock
    from memfit.errors import UserError

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


# 4. Divergence stops the run; it is never saved as a success.


def test_divergence_stops_at_that_step_and_keeps_the_last_good_checkpoint(tmp_path, embedded):
    result = run_script(
        "finetune/lora.py",
        "--train.lr",
        "1e6",
        "--train.save_interval",
        "1",
        "--train.max_steps",
        "20",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        cwd=tmp_path,
    )
    assert result.returncode == 4, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "non-finite" in error[0] and "--train.lr 1000000.0 is too high" in error[0], error
    step = int(error[0].split(" at step ")[1].split(":")[0])
    out = tmp_path / "out/finetune/lora"
    assert not (out / "final").exists()
    saved = sorted(p.name for p in out.glob("step-*"))
    assert saved == [f"step-{s:06d}" for s in range(1, step)]  # every good step, nothing from the bad one
    for name in saved:
        weights = torch.load(out / name / "lit_model.pth.lora", weights_only=True)["model"]
        assert all(torch.isfinite(v).all() for v in weights.values()), name
    assert f"the latest checkpoint is {Path('out/finetune/lora') / saved[-1]}" in result.stderr


def test_nan_in_the_base_weights_is_named_at_step_one(tmp_path, embedded):
    source, _ = embedded
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    state = torch.load(ckpt / "lit_model.pth", weights_only=True)
    state["transformer.h.2.mlp.fc_1.weight"][3, 5] = float("nan")
    torch.save(state, ckpt / "lit_model.pth")
    from memfit.data import embedded_data

    with pytest.raises(SystemExit) as exit_info, redirect_stderr(io.StringIO()) as err:
        _lora(tmp_path, checkpoint_dir=ckpt, data=embedded_data(embedded[1]))
    assert exit_info.value.code == 4
    assert "at step 1: the weights hold inf/NaN (transformer.h.2.mlp.fc_1." in err.getvalue(), err.getvalue()
    assert err.getvalue().rstrip().endswith("Nothing was saved for that step; no checkpoint was written before it.")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# 5. A checkpoint missing weights is refused (only the method's own parameters may be missing).


@pytest.mark.parametrize(
    "script, new",
    [
        ("finetune/lora.py", "lora_A"),
        ("finetune/adapter.py", "adapter_wte"),
        ("finetune/adapter_v2.py", "adapter_scale"),
        ("finetune/full.py", None),
    ],
)
def test_only_the_methods_own_parameters_may_be_missing(embedded, script, new):
    from memfit.errors import UserError
    from memfit.loading import load_model

    litgpt_module = {
        "lora": "litgpt.lora",
        "adapter": "litgpt.adapter",
        "adapter_v2": "litgpt.adapter_v2",
        "full": "litgpt.model",
    }[Path(script).stem]
    import importlib

    gpt = importlib.import_module(litgpt_module)
    source, _ = embedded
    config = gpt.Config.from_file(
        source / "model_config.yaml", **({"lora_r": 4, "lora_query": True} if new == "lora_A" else {})
    )
    allowed = {
        "lora_A": ("lora_A", "lora_B"),
        "adapter_wte": ("adapter_wte", "gating_factor"),
        "adapter_scale": ("adapter_wte", "gating_factor", "adapter_bias", "adapter_scale"),
        None: (),
    }[new]
    # the scripts declare the same names the loader is given here
    assert all(f'"{name}"' in Path(ROOT / script).read_text() for name in allowed)
    model = load_model(
        gpt.GPT,
        config,
        source / "lit_model.pth",
        dtype=torch.float32,
        device=torch.device("cpu"),
        new_parameters=allowed,
    )
    if new is not None:
        assert any(new in n for n, _ in model.named_parameters())
    state = torch.load(source / "lit_model.pth", weights_only=True)
    del state["transformer.h.0.norm_1.weight"]
    broken = Path(str(source) + "-broken.pth")
    torch.save(state, broken)
    try:
        with pytest.raises(
            UserError, match=r"lacks 1 of the model's weights \(such as 'transformer.h.0.norm_1.weight'\)"
        ):
            load_model(gpt.GPT, config, broken, dtype=torch.float32, device=torch.device("cpu"), new_parameters=allowed)
    finally:
        broken.unlink()


# 6. Settings are applied or refused, never ignored or recorded falsely.


def test_resume_with_a_changed_setting_is_refused(tmp_path, embedded):
    _lora(tmp_path, train=tiny_train(max_steps=4, save_interval=2))
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    for args, key in [
        (["--train.lr", "0.1"], "--train.lr is 0.1 here but 0.003"),
        (["--lora_r", "4"], "--lora_r is 4"),
    ]:
        code, err = _cli(
            lora,
            [
                "--out_dir",
                str(tmp_path / "out"),
                "--profile_dir",
                str(tmp_path / "p"),
                "--resume",
                "true",
                "--train.max_steps",
                "4",
                "--train.save_interval",
                "2",
                "--train.global_batch_size",
                "8",
                "--train.micro_batch_size",
                "4",
                "--train.lr_warmup_steps",
                "2",
                "--train.lr",
                "3e-3",
                "--train.min_lr",
                "3e-4",
                "--logger_name",
                "csv",
                "--profile.enabled",
                "false",
                *args,
            ],
        )
        assert code == 2 and key in err, err
    hparams = yaml.safe_load((tmp_path / "out/step-000002/hyperparameters.yaml").read_text())
    assert hparams["train"]["lr"] == 3e-3


def test_resume_may_change_how_the_data_is_read_but_not_what_it_is(tmp_path, embedded):
    """The loader's worker count does not change a step (Memfit's sampler orders the data), so a resumed run may
    change it, e.g. after workers ran out of memory; a data module's field that changes the samples is refused by
    its own flag, as the user types it."""
    _, json_path = embedded
    common = [
        "--out_dir",
        str(tmp_path / "out"),
        "--profile_dir",
        str(tmp_path / "p"),
        "--data",
        "JSON",
        "--data.json_path",
        str(json_path),
        "--data.mask_prompt",
        "true",
        "--train.global_batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.lr_warmup_steps",
        "2",
        "--train.save_interval",
        "2",
        "--train.lr",
        "3e-3",
        "--train.min_lr",
        "3e-4",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    first = run_in_process(
        "finetune/lora.py", *common, "--data.num_workers", "0", "--train.max_steps", "4", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    changed = run_in_process(
        "finetune/lora.py",
        *common,
        "--data.val_split_fraction",
        "0.2",
        "--train.max_steps",
        "4",
        "--resume",
        "true",
        cwd=tmp_path,
    )
    assert changed.returncode == 2, changed.stderr[-2000:]
    assert "--data.val_split_fraction is 0.2 here but 0.05 in the run being resumed" in changed.stderr, changed.stderr
    resumed = run_in_process(
        "finetune/lora.py",
        *common,
        "--data.num_workers",
        "1",
        "--train.max_steps",
        "4",
        "--resume",
        "true",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and (tmp_path / "out/final").is_dir()


def test_resume_onto_rewritten_data_is_refused_unless_the_flag_accepts_it(tmp_path, embedded):
    """The data file rewritten between the parts of a run (400 records became 50, every answer changed) resumed
    silently with another epoch; the checkpoint's fingerprint of the training samples now names the change."""
    import json

    records = json.loads(embedded[1].read_text())
    data = tmp_path / "data.json"
    data.write_text(json.dumps(records[:80]))
    common = [
        "--out_dir",
        str(tmp_path / "out"),
        "--profile_dir",
        str(tmp_path / "p"),
        "--data",
        "JSON",
        "--data.json_path",
        str(data),
        "--data.val_split_fraction",
        "0.1",
        "--train.global_batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.save_interval",
        "2",
        "--train.max_steps",
        "4",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    first = run_in_process("finetune/lora.py", *common, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    data.write_text(json.dumps([{**r, "output": r["output"][::-1]} for r in records[:50]]))
    refused = run_in_process("finetune/lora.py", *common, "--resume", "true", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in refused.stderr and not list((tmp_path / "out").glob(".*"))  # no lock, no staging
    assert (
        line.startswith(
            f"error: --resume: --data JSON ({data}) is not the training data of the checkpoint being"
            " resumed (45 samples"
        )
        and "the checkpoint's: 72 samples" in line
    ), line
    assert line.endswith("add --resume_with_changed_data true to go on with this data from the same position"), line
    accepted = run_in_process(
        "finetune/lora.py", *common, "--resume", "true", "--resume_with_changed_data", "true", cwd=tmp_path
    )
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    assert "warning: --data JSON" in accepted.stdout and (tmp_path / "out/final").is_dir()
    refused = run_in_process(
        "finetune/lora.py", *common, "--overwrite", "true", "--resume_with_changed_data", "true", cwd=tmp_path
    )
    assert refused.stderr.strip() == (
        "error: --resume_with_changed_data true applies to a resumed run: add --resume, or drop it"
    )


def test_a_lora_checkpoint_holding_a_whole_model_is_refused(tmp_path, embedded):
    """A lit_model.pth.lora that holds a whole model (0 LoRA tensors) resumed silently, its base weights replacing
    the run's own."""
    _lora(tmp_path, train=tiny_train(max_steps=2, save_interval=1))
    shutil.rmtree(tmp_path / "out/final")
    base = torch.load(embedded[0] / "lit_model.pth", weights_only=True)
    torch.save({"model": base}, tmp_path / "out/step-000001/lit_model.pth.lora")
    with pytest.raises(UserError) as refused:
        _lora(tmp_path, train=tiny_train(max_steps=2, save_interval=1), resume=True)
    assert str(refused.value).startswith(
        f"--resume: {tmp_path / 'out/step-000001/lit_model.pth.lora'} holds 0 of the"
    ), refused.value
    assert "it is not this run's checkpoint" in str(refused.value)


def test_resume_in_less_memory_gives_the_uninterrupted_runs_weights(tmp_path, embedded):
    """What the out-of-memory explanation suggests, a smaller micro-batch (same global batch), activation
    checkpointing and another AdamW kernel, is the same training: a run resumed with all three changed ends with the
    weights of the uninterrupted one (no dropout: its masks follow the micro-batches' shapes)."""
    common = [
        "--lora_dropout",
        "0",
        "--train.global_batch_size",
        "8",
        "--train.lr_warmup_steps",
        "2",
        "--train.save_interval",
        "2",
        "--train.max_steps",
        "4",
        "--train.lr",
        "3e-3",
        "--train.min_lr",
        "3e-4",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    whole = run_in_process(
        "finetune/lora.py", *common, "--out_dir", "whole", "--train.micro_batch_size", "4", cwd=tmp_path
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = run_in_process(
        "finetune/lora.py", *common, "--out_dir", "parts", "--train.micro_batch_size", "4", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.rmtree(tmp_path / "parts/final")  # as if it ran out of memory in step 3
    resumed = run_in_process(
        "finetune/lora.py",
        *common,
        "--out_dir",
        "parts",
        "--resume",
        "true",
        "--train.micro_batch_size",
        "2",
        "--activation_checkpointing",
        "true",
        "--optimizer",
        "AdamW-foreach",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "x 4 micro-batch(es) of 2 per step" in resumed.stdout
    expected = torch.load(tmp_path / "whole/final/lit_model.pth.lora", weights_only=True)["model"]
    got = torch.load(tmp_path / "parts/final/lit_model.pth.lora", weights_only=True)["model"]
    started = torch.load(tmp_path / "parts/step-000002/lit_model.pth.lora", weights_only=True)["model"]
    assert expected.keys() == got.keys()
    assert all(not torch.equal(expected[name], started[name]) for name in expected)  # steps 3 and 4 moved them all
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)
    hparams = yaml.safe_load((tmp_path / "parts/final/hyperparameters.yaml").read_text())
    assert hparams["train"]["micro_batch_size"] == 2 and hparams["optimizer"] == "AdamW-foreach"  # what ran


def test_resume_from_another_methods_checkpoint_is_refused(tmp_path, embedded):
    adapter = load_script("finetune/adapter.py")
    adapter.setup(
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        **_quiet(train=tiny_train(max_steps=2, save_interval=2, lr=1e-2, min_lr=1e-3)),
    )
    shutil.move(tmp_path / "out/final", tmp_path / "out/step-000003")
    # the settings of a LoRA run, so that only the weights are another method's
    lora.setup(out_dir=tmp_path / "lora", profile_dir=tmp_path / "profiles", **_quiet(train=tiny_train(max_steps=1)))
    shutil.copy(tmp_path / "lora/final/hyperparameters.yaml", tmp_path / "out/step-000003")
    with pytest.raises(UserError, match="holds no lit_model.pth.lora but lit_model.pth.adapter"):
        _lora(tmp_path, train=tiny_train(max_steps=1), resume=True)


def test_warmup_fraction_max_tokens_and_initial_validation_are_applied(tmp_path, embedded, capsys):
    """litgpt's meanings: max_tokens sets the horizon over full-length steps; lr_warmup_fraction is a fraction of an
    epoch (the embedded data's 1,800 training samples make 225 steps of 8), not of the run."""
    from litgpt.args import EvalArgs

    _lora(
        tmp_path,
        train=tiny_train(max_steps=None, max_tokens=4000, lr_warmup_steps=0, lr_warmup_fraction=0.02, log_interval=1),
        eval=EvalArgs(interval=100, max_iters=2, initial_validation=True),
    )
    out = capsys.readouterr().out
    assert "Initial validation: loss" in out
    # litgpt's horizon: max_tokens over full-length steps (the longest sample, global batch 8)
    longest = int(out.split("(longest sample ")[1].split(",")[0])
    max_steps = int(out.split(" steps (")[0].rsplit("| ", 1)[1])
    assert max_steps == 4000 // (8 * longest) < 12
    assert run_summary(tmp_path / "profiles")["steps"] == max_steps
    import csv

    (metrics,) = (tmp_path / "profiles").glob("*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    lrs = [float(r["learning_rate"]) for r in rows if r.get("learning_rate")]
    warmup = math.ceil(0.02 * (2000 - 200) / 8)  # 5 of the run's 6 steps; a fraction of the run would give 0
    assert warmup < max_steps and "warm-up 5)" in out
    assert lrs[:warmup] == pytest.approx([3e-3 * i / warmup for i in range(warmup)])  # litgpt's: from 0
    assert lrs[warmup] == pytest.approx(3e-3)  # the peak, then the cosine
    assert any(r.get("val_loss") and int(r["step"]) == 0 for r in rows)  # the initial validation, logged at step 0


def test_a_warm_up_as_long_as_the_run_is_pointed_out(tmp_path, embedded):
    """litgpt warns when lr_warmup_steps is not below max_steps; the run's first line says it (the scripts' own
    default warm-up of 8 steps with a short run is the common case)."""
    result = run_in_process(
        "finetune/lora.py", "--train.max_steps", "3", "--profile.enabled", "false", "--logger_name", "csv", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| 3 steps (225 an epoch, warm-up 8, the whole run: --train.lr is never reached)" in result.stdout


# 7. Resume: every generator restored; the old final/ survives a failed save.


def test_a_failed_save_keeps_the_previous_final_and_leaves_no_tmp(tmp_path, embedded):
    import lightning as L

    from memfit.checkpoint import save_checkpoint

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(2, 2)
    save_checkpoint(fabric, tmp_path, "final", "w.pth", model, {"step": 1}, {"a": 1})
    first = (tmp_path / "final/w.pth").read_bytes()
    with torch.no_grad():
        model.weight.add_(1)
    with pytest.raises(Exception):
        save_checkpoint(fabric, tmp_path, "final", "w.pth", model, {"step": 2, "bad": lambda: 0}, {"a": 2})
    assert (tmp_path / "final/w.pth").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    save_checkpoint(fabric, tmp_path, "final", "w.pth", model, {"step": 2}, {"a": 2})
    assert (tmp_path / "final/w.pth").read_bytes() != first and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_resume_falls_back_from_a_damaged_latest_checkpoint(tmp_path, embedded, capsys):
    _lora(tmp_path, train=tiny_train(max_steps=6, save_interval=2))
    shutil.rmtree(tmp_path / "out/final")
    weights = tmp_path / "out/step-000004/lit_model.pth.lora"
    weights.write_bytes(weights.read_bytes()[:100])
    shutil.rmtree(tmp_path / "profiles")
    _lora(tmp_path, train=tiny_train(max_steps=6, save_interval=2), resume=True)
    out = capsys.readouterr().out
    assert "step-000004 is damaged" in out and "Resumed from" in out and "step-000002 at step 2" in out
    assert run_summary(tmp_path / "profiles")["steps"] == 6


def test_resume_falls_back_from_a_latest_checkpoint_whose_settings_are_damaged(tmp_path, embedded, capsys):
    """A garbled hyperparameters.yaml was a YAML traceback; a deleted one let changed settings through. Either way
    the checkpoint is passed over for the previous one, with a warning, and that one's settings are checked."""
    _lora(tmp_path, train=tiny_train(max_steps=6, save_interval=2))
    shutil.rmtree(tmp_path / "out/final")
    settings = tmp_path / "out/step-000004/hyperparameters.yaml"
    settings.write_text("train: {max_steps: [6\n")  # garbled
    with pytest.raises(UserError, match="--train.lr is 0.1 here but 0.003 in the run being resumed"):
        _lora(tmp_path, train=tiny_train(max_steps=6, save_interval=2, lr=0.1), resume=True)
    assert f"warning: {settings} cannot be read" in capsys.readouterr().out
    settings.unlink()  # deleted
    shutil.rmtree(tmp_path / "profiles", ignore_errors=True)
    _lora(tmp_path, train=tiny_train(max_steps=6, save_interval=2), resume=True)
    out = capsys.readouterr().out
    assert f"warning: {settings} cannot be read (it is missing)" in out and "trying the previous checkpoint" in out
    assert "step-000002 at step 2" in out and run_summary(tmp_path / "profiles")["steps"] == 6


# 8. Accumulation weighs every target token equally: tests/test_train_step.py, on every script.


# 9. --estimate needs neither data nor the embedded default.


def test_estimate_with_a_checkpoint_dir_and_no_data(tmp_path, embedded):
    source, _ = embedded
    shutil.copytree(source, tmp_path / "ckpt")  # a checkpoint of the user's (the embedded one brings its data)
    result = run_script(
        "finetune/lora.py", "--checkpoint_dir", str(tmp_path / "ckpt"), "--estimate", "true", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tokens per sample (the model's context" in result.stdout and "Predicted peak" in result.stdout


def test_estimate_from_a_model_name_does_not_build_the_embedded_default(tmp_path):
    env_cache = tmp_path / "cache"
    env = {**os.environ, "MEMFIT_CACHE": str(env_cache)}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "finetune/lora.py"),
            "--model_name",
            "pythia-14m",
            "--estimate",
            "true",
            "--train.max_seq_length",
            "64",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Predicted peak" in result.stdout
    assert not env_cache.exists() or not any(env_cache.iterdir())


def _mount_tmpfs(mount: Path, options: str) -> Path:
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): the test needs a real disk that is full or read-only")
    return mount


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real full disk (needs the rights to mount, as root in CI has)."""
    yield _mount_tmpfs(tmp_path / "small", "size=1m")
    subprocess.run(["umount", "-l", str(tmp_path / "small")], check=False)


@pytest.fixture
def disk(tmp_path):
    """A 64 MiB tmpfs that a test may remount read-only, as a failing disk is."""
    yield _mount_tmpfs(tmp_path / "disk", "size=64m")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)


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


def test_a_read_only_memfit_cache_is_one_line(tmp_path, disk, monkeypatch):
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    monkeypatch.setenv("MEMFIT_CACHE", str(disk / "cache"))
    result = run_in_process("finetune/lora.py", "--train.max_steps", "1", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: cannot create the embedded default in {str(disk / 'cache')!r} (Read-only file system); set"
        " MEMFIT_CACHE to a writable directory, or give --checkpoint_dir"
    ), result.stderr


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


def test_resume_keeps_the_data_order_when_the_profiler_window_changes(tmp_path, embedded):
    """The longest sample's place follows the profiler window; a resumed run (here without profiling, a setting
    resume may change) must keep the order its first part used, or it would not be exact."""
    from memfit.profiling import ProfileArgs

    _lora(
        tmp_path / "straight",
        train=tiny_train(max_steps=8, save_interval=2),
        profile=ProfileArgs(wait=2, warmup=1, active=1),
    )
    state = torch.load(tmp_path / "straight/out/final/training_state.pth", weights_only=False)
    assert state["data"]["longest_position"] == 3 * 2 * 4 + 4  # last micro-batch of step 4
    resumed_dir = tmp_path / "resumed"
    _lora(resumed_dir, train=tiny_train(max_steps=8, save_interval=2), profile=ProfileArgs(wait=2, warmup=1, active=1))
    for name in ("step-000006", "final"):
        shutil.rmtree(resumed_dir / "out" / name)
    shutil.rmtree(resumed_dir / "profiles")
    _lora(resumed_dir, train=tiny_train(max_steps=8, save_interval=2), resume=True)  # profiling off this time
    a = torch.load(tmp_path / "straight/out/final/lit_model.pth.lora", weights_only=True)["model"]
    b = torch.load(resumed_dir / "out/final/lit_model.pth.lora", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7)


def test_bitsandbytes_is_imported_without_fetching_a_kernel_from_the_hub(tmp_path):
    """No network at run time: on CPUs with AVX512-BF16 bitsandbytes' import asks Hugging Face's `kernels` package
    for a kernel from the Hub and, without it, prints "Failed to load CPU gemm_4bit_forward from kernels-community".
    With a stand-in `kernels` that writes its calls down, Memfit's import makes none and prints nothing of it, and
    4-bit layers still compute (with the kernel bitsandbytes ships). A plain import on such a CPU shows the stand-in
    is reached where the guard is missing."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'tests' / 'with_hub_kernels'}{os.pathsep}{ROOT}",
        "MEMFIT_TEST_KERNEL_CALLS": str(tmp_path / "calls"),
    }
    memfit_import = """
import torch
from memfit.quantize import import_bitsandbytes
bnb = import_bitsandbytes()
layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
w = torch.randn(32, 64, dtype=torch.bfloat16)
layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")._quantize("cpu")
x = torch.randn(3, 64, dtype=torch.bfloat16)
dequantized = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
torch.testing.assert_close(layer(x), x @ dequantized.t(), rtol=2e-2, atol=2e-2)
print(bnb.functional.has_avx512bf16())
"""
    result = subprocess.run([sys.executable, "-c", memfit_import], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (tmp_path / "calls").exists()
    assert "kernels-community" not in result.stderr
    if result.stdout.strip() == "True":  # this CPU takes the path that asks the Hub
        plain = subprocess.run(
            [sys.executable, "-c", "import bitsandbytes"], env=env, capture_output=True, text=True, timeout=120
        )
        assert plain.returncode == 0, plain.stderr[-2000:]
        assert (tmp_path / "calls").read_text().split() == ["kernels-community/quantization-bitsandbytes"]


def test_16_bit_precision_on_a_cpu_without_16_bit_instructions_is_called_slow(monkeypatch):
    """A CPU without AVX512-BF16 or AMX emulates 16-bit matmuls: a run there says so (and suggests 32-true), and where
    it says so the claim holds on this very CPU. Both CPU families' answers are checked, not only this one's."""
    from memfit.precision import cpu_description
    from memfit.precision import slow_half_precision_on_this_cpu as note

    if note("bf16-true", "cpu"):  # measured, the embedded model's MLP shape: emulated bf16 must really be slower
        a, b = torch.randn(512, 128), torch.randn(128, 384)

        def seconds(dtype: torch.dtype) -> float:
            x, y = a.to(dtype), b.to(dtype)
            x @ y
            start = time.perf_counter()
            for _ in range(20):
                x @ y
            return time.perf_counter() - start

        assert seconds(torch.bfloat16) > 3 * seconds(torch.float32)
    assert note("32-true", "cpu") is None and note("bf16-true", "cuda") is None
    for bf16, amx in [(True, False), (False, True), (False, False)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        for precision in ("bf16-true", "bf16-mixed", "16-true"):
            said = note(precision, "cpu")
            assert (said is None) == (bf16 or amx), (precision, bf16, amx)
            assert said is None or f"--precision {precision}" in said and "32-true" in said
        # and the benchmarks' record of the machine says which family their 16-bit figures come from
        assert ("none (bf16 and float16 emulated)" in cpu_description()) == (not bf16 and not amx)


def test_taking_the_lock_clears_what_a_save_killed_mid_way_left(tmp_path):
    """A run killed inside a save leaves its staging directory, or (killed between the two renames of a final save)
    the previous final/ moved aside: the next run in the out_dir removes the first and puts the second back."""
    from memfit.checkpoint import OutDirLock

    out = tmp_path / "out"
    for name in (".step-000015.tmp", ".final.old", "step-000010", ".step-000010.old"):
        (out / name).mkdir(parents=True)
        (out / name / "lit_model.pth.lora").write_text(name)
    with OutDirLock(out):
        assert sorted(p.name for p in out.iterdir()) == [".memfit.lock", "final", "step-000010"]
    assert (out / "final/lit_model.pth.lora").read_text() == ".final.old"
    assert (out / "step-000010/lit_model.pth.lora").read_text() == "step-000010"


def test_overwrite_never_deletes_the_checkpoint_the_run_starts_from(tmp_path, embedded):
    """The README calls a full fine-tune's final/ a base for the next run; --overwrite of that out_dir would delete it
    before loading it. Refused in one line, and the model is still there; a LoRA run reading it too."""
    out = tmp_path / "out"
    shutil.copytree(embedded[0], out / "final")  # a finished run's final/: a whole model with its config and tokenizer
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


def test_checkpoints_are_written_beside_their_destination_not_in_tmpdir(tmp_path, embedded, small_disk):
    """Lightning's writer staged every checkpoint file in $TMPDIR: with a small /tmp (here a 1 MiB disk, smaller than
    the 4 MiB weights) the first save failed, reported as /tmp's, however much room the out_dir had."""
    result = run_script(
        "finetune/full.py",
        "--train.max_steps",
        "1",
        "--eval.final_validation",
        "false",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        cwd=tmp_path,
        env={"TMPDIR": str(small_disk)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "out/finetune/full/final/lit_model.pth").is_file()
    assert list(small_disk.rglob("*")) == []


def test_resume_takes_the_runs_own_settings_and_a_finished_run_says_so(tmp_path, embedded):
    """After Ctrl-C the hint said --resume true, and doing just that was refused ("--precision is ... here but ...:
    drop --precision", a flag never given): the flags not given again are now the run's own; one given differently is
    still refused by name. A finished run says it is finished instead of naming a setting."""
    out = ["--out_dir", str(tmp_path / "out"), "--profile_dir", str(tmp_path / "p")]
    first = run_in_process(
        "finetune/lora.py",
        *out,
        "--lora_r",
        "4",
        "--train.lr",
        "0.002",
        "--train.max_steps",
        "4",
        "--train.save_interval",
        "2",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        "--eval.final_validation",
        "false",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    finished = run_in_process("finetune/lora.py", *out, "--resume", "true", cwd=tmp_path)
    assert finished.returncode == 2 and finished.stderr.strip() == (
        f"error: --resume true: the run in --out_dir {str(tmp_path / 'out')!r} is finished (final); nothing to"
        " continue: replace it with --overwrite true, or choose a fresh --out_dir"
    ), finished.stderr
    shutil.rmtree(tmp_path / "out/final")  # as if stopped after step 2
    changed = run_in_process("finetune/lora.py", *out, "--resume", "true", "--lora_r", "8", cwd=tmp_path)
    assert changed.returncode == 2 and "--lora_r is 8 here but 4 in the run being resumed" in changed.stderr
    resumed = run_in_process("finetune/lora.py", *out, "--resume", "true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    settings = yaml.safe_load((tmp_path / "out/final/hyperparameters.yaml").read_text())
    assert settings["lora_r"] == 4 and settings["train"]["lr"] == 0.002 and settings["logger_name"] == "csv"
