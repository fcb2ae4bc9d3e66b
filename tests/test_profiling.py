"""The profiler window never costs a run its memory: a recorded step of many micro-batches is traced from its last
micro-batch on (memfit.observatory.profiling.ProfilerWindow.record_from_here; the earlier ones in the profiler's
warm-up, which keeps nothing), so the window's host memory is one micro-batch's whatever the accumulation, and the
ledger of the step still finds its peak, with source lines."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, lora_run, run_summary
from memfit.trace_events import trace_text


def _peak_rss_wrapper() -> str:
    """The Python code that runs a script and prints its own peak RSS, as benchmarks/profiler_window_host.py measures
    the window: one measurement for the benchmark's record and these tests."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profiler_window_host", ROOT / "benchmarks/profiler_window_host.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark.MEASURED


MEASURED = _peak_rss_wrapper()


def profiled_run(
    cwd, micro_batches: int, profiled: bool = True, with_stack: bool = True
) -> tuple[float, dict, str, int]:
    """``(peak RSS in MiB, the ledger, stderr, the trace's memory events)`` of a LoRA run whose recorded step has
    ``micro_batches``, Python frames recorded unless ``with_stack`` is False (the window's largest host memory, and the
    ledger's source lines)."""
    cwd.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", MEASURED, str(ROOT / "finetune/lora.py"), "--train.micro_batch_size", "2",
         "--train.global_batch_size", str(2 * micro_batches), "--train.max_steps", "2", "--precision", "32-true",
         "--train.max_seq_length", "64", "--eval.final_validation", "false", "--logger_name", "csv",
         "--profile.enabled", str(profiled).lower(), "--profile.with_stack", str(with_stack).lower()],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    pages, page_size = map(int, result.stdout.split("peak_rss_pages")[1].split()[:2])
    if not profiled:
        return pages * page_size / 2**20, {}, result.stderr, 0
    (ledger_file,) = (cwd / "out" / "profiles").glob("*/ledger.json")
    (trace,) = (cwd / "out" / "profiles").glob("*/*.pt.trace.json.gz")
    events = json.loads(trace_text(trace))["traceEvents"]
    memory_events = sum(event.get("name") == "[memory]" for event in events)
    return pages * page_size / 2**20, json.loads(ledger_file.read_text()), result.stderr, memory_events


@pytest.fixture(scope="module")
def four_micro_batches(tmp_path_factory, embedded):
    return profiled_run(tmp_path_factory.mktemp("profiled") / "4", 4)


@pytest.fixture(scope="module")
def sixty_four_micro_batches(tmp_path_factory, embedded):
    return profiled_run(tmp_path_factory.mktemp("profiled") / "64", 64)


@pytest.mark.slow
def test_a_64_micro_batch_step_is_profiled_in_the_memory_of_a_4_micro_batch_one(
    four_micro_batches, sixty_four_micro_batches
):
    """The window's host memory grew with the micro-batches of the recorded step (RSS 1.9 / 4.0 / 8.3 GB at 4 / 8 / 16
    micro-batches of the embedded model; 2.77 GB at 64 with these settings): litgpt's tinyllama.yaml, 128 a step, was
    killed in its first step. With operators paused in the middle micro-batches it still grew by about 1 KiB an
    allocation event (memory events are not paused). Traced from its last micro-batch, 64 micro-batches record no more
    memory events than 4 traced whole, peak no higher, and the ledger of the step still finds its peak's tensors,
    the accumulated gradients among them, and names their source lines."""
    few, few_ledger, _, few_events = four_micro_batches
    many, ledger, _, many_events = sixty_four_micro_batches
    print(
        f"peak RSS: {few:.0f} MiB at 4 micro-batches, {many:.0f} MiB at 64; memory events {few_events}, {many_events}"
    )
    assert many_events <= few_events, (few_events, many_events)
    assert many < few + 32, (few, many)
    forward = ledger["phases"]["forward"]
    assert forward["not_found_bytes"] <= 0.05 * forward["peak_bytes"], forward
    found = forward["found_at_peak_bytes"]
    assert found["gradients"] == few_ledger["phases"]["forward"]["found_at_peak_bytes"]["gradients"] > 0, found
    assert found["activations"] > found["unattributed"], found
    assert any("memfit/training/loss.py" in entry["source"] for entry in forward["biggest_at_peak"]), forward[
        "biggest_at_peak"
    ]


@pytest.mark.slow
def test_torchs_profiler_lines_do_not_run_into_the_progress_bar(four_micro_batches):
    """torch's profiler prints "USDT: ... profiler_start" / "profiler_stop" on stderr where the training bar is drawn;
    as a terminal shows stderr (the text after each line's last carriage return), each is on a line of its own."""
    _, _, stderr, _ = four_micro_batches
    shown = [line.split("\r")[-1] for line in stderr.split("\n")]
    usdt = [line for line in shown if "USDT" in line]
    # the pinned torch prints them at the window's start and stop; a torch that stops printing them fails here, to be
    # looked at, rather than passing unchecked
    assert len(usdt) >= 2, stderr[-2000:]
    assert not [line for line in usdt if "%|" in line or "step/s" in line], usdt


@pytest.mark.slow
def test_a_step_of_4_micro_batches_keeps_every_phases_roles(four_micro_batches):
    """Up to 4 micro-batches the step is traced whole, so every micro-batch's phase has its range in the trace and its
    map of roles: the forward peak's saved tensors are found as activations (skipping the middle micro-batches' maps
    while their ranges were in the trace put 0.66 of 4.9 MB there and the rest in unattributed)."""
    _, ledger, _, _ = four_micro_batches
    found = ledger["phases"]["forward"]["found_at_peak_bytes"]
    assert found["activations"] > found["unattributed"], found


@pytest.mark.slow
def test_the_estimate_predicts_the_windows_host_memory(tmp_path, four_micro_batches, sixty_four_micro_batches):
    """The estimate's "Profiler window" line against the window's measured cost: the process's peak RSS with the
    window on less with it off, at 4 micro-batches (traced whole) and 64 (traced from the last) with Python stacks,
    and at 4 without them (the default: a twentieth of the stacks' bytes an allocation; the estimate had priced every
    window as the stacks' and said 173 MiB for a window of 40). The prediction is made from the fake trace's
    allocations; the measurement from /proc of real runs."""
    import re

    from conftest import run_in_process

    def predicted(micro_batches: int, with_stack: bool) -> float:
        result = run_in_process(
            "finetune/lora.py", "--train.micro_batch_size", "2", "--train.global_batch_size", str(2 * micro_batches),
            "--train.max_seq_length", "64", "--precision", "32-true", "--accelerator", "cpu", "--estimate", "true",
            "--profile.with_stack", str(with_stack).lower(), cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        number, unit = re.search(r"Profiler window: about ([0-9.]+) (MiB|GiB)", result.stdout).groups()
        return float(number) * (1024 if unit == "GiB" else 1)

    off, _, _, _ = profiled_run(tmp_path / "off", 4, profiled=False)
    plain, _, _, _ = profiled_run(tmp_path / "plain", 4, with_stack=False)
    few, _, _, _ = four_micro_batches
    many, _, _, _ = sixty_four_micro_batches
    for micro_batches, with_stack, measured in ((4, True, few - off), (64, True, many - off), (4, False, plain - off)):
        want = predicted(micro_batches, with_stack)
        print(
            f"{micro_batches} micro-batches, stacks {with_stack}: window measured +{measured:.0f} MiB, predicted {want}"
        )
        assert abs(want - measured) <= 0.3 * measured, (micro_batches, with_stack, measured, want)


@pytest.mark.slow
def test_record_shapes_puts_input_shapes_in_the_trace(tmp_path):
    from conftest import load_script, tiny_train
    from memfit.args import ProfileArgs

    load_script("finetune/lora.py").setup(
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        logger_name="csv",
        train=tiny_train(max_steps=2),
        profile=ProfileArgs(wait=1, warmup=0, active=1, record_shapes=True),
    )
    (trace,) = (tmp_path / "profiles").glob("*/*.pt.trace.json.gz")
    assert '"Input Dims"' in trace_text(trace)


@pytest.mark.slow
def test_a_broken_trace_costs_the_ledger_not_the_run(tmp_path, embedded, monkeypatch, capsys):
    """The profiler's trace file ends up unparsable (cut short) and a partial ``.json.tmp`` lies beside it: the run
    still saves final/, warns in one line, and lists only finished traces."""
    import gzip

    import memfit.observatory.profiling as profiling
    from memfit.args import ProfileArgs

    real_writer = profiling.write_gzipped_trace

    def write_then_damage(prof, run_dir, worker):
        trace = real_writer(prof, run_dir, worker)
        text = trace_text(trace)
        trace.write_bytes(gzip.compress(text[: len(text) // 2].encode()))
        Path(f"{str(trace).removesuffix('.gz')}.tmp").write_text('{"traceEvents": [')
        return trace

    monkeypatch.setattr(profiling, "write_gzipped_trace", write_then_damage)
    run = lora_run(tmp_path, profile=ProfileArgs(wait=1, warmup=0, active=1))
    out = capsys.readouterr().out
    assert (tmp_path / "out/final/lit_model.pth.lora").is_file()
    assert "warning: could not complete the ledger from the profiler trace (JSONDecodeError" in out
    assert run.trace_files and all(p.name.endswith(".pt.trace.json.gz") for p in run.trace_files)
    assert run_summary(tmp_path / "profiles")["checkpoint"].endswith("final")


def test_a_trace_cut_short_between_two_events_is_not_read_as_whole(tmp_path):
    """The event reader stopped without complaint where a cut trace happened to end right after an event (about
    one run in fifty of the test above, which cuts at half the file): the ledger was then built from half a step."""
    import json

    from memfit.trace_events import read_trace_events

    events = '{"traceEvents": [\n{"name": "[memory]", "ts": 1, "args": {}},\n{"cat": "cpu_op", "name": "x", "ts": 2}'
    (tmp_path / "whole.json").write_text(events + "\n]}")
    assert len(read_trace_events(tmp_path / "whole.json")) == 2
    (tmp_path / "cut.json").write_text(events + ",\n")
    with pytest.raises(json.JSONDecodeError, match="ends before its list of events"):
        read_trace_events(tmp_path / "cut.json")


def test_frame_names_torch_writes_unescaped_are_escaped_in_the_trace(tmp_path):
    """A Python function whose name and file name hold quotes (a frame of protobuf's, imported by
    TensorBoard's logger on its first write, made a short run's whole trace unreadable), profiled with stacks
    through torch's own trace handler (Memfit's writer escapes the same file before compressing it): after
    ``escape_trace_strings`` the file is JSON and the frame's event has its name exactly; a trace torch wrote valid is
    left byte for byte."""
    import types

    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    from memfit.trace_events import escape_trace_strings, read_trace_events

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

    from memfit.args import ProfileArgs
    from memfit.observatory.profiling import ProfilerWindow

    for args, total_steps, warned in ((ProfileArgs(), 1, False), (ProfileArgs(warmup=0), 4, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ProfilerWindow(args, tmp_path / f"w{total_steps}", torch.device("cpu"), total_steps) as window:
                for _ in range(total_steps):
                    torch.ones(4).sum()
                    window.step()
        messages = [str(w.message) for w in caught]
        assert any("won't be using warmup" in m for m in messages) == warned, messages


def test_cuda_memory_history_covers_the_ledgers_step_only(tmp_path, monkeypatch):
    """With --profile.active 2 or more, the allocator's history stops after the ledger's step: only that step runs
    with checkpointing's early stop off and the retry guard (torch 2.11 failed in backward with checkpointed regions
    recomputing while history was recorded). CUDA's history calls cannot run on this CPU: they are recorded instead."""
    from memfit.args import ProfileArgs
    from memfit.observatory.profiling import ProfilerWindow

    calls = []
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda enabled="all", **kw: calls.append(("history", enabled))
    )
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", Path(path).name)))
    args = ProfileArgs(wait=1, warmup=1, active=3)
    window = ProfilerWindow(args, tmp_path, torch.device("cpu"), total_steps=6)
    with window:
        window.cuda = True  # from here on the window acts as on a GPU (its profiler was started for the CPU)
        for step in range(1, 7):
            if window.recording:
                calls.append(("ledger step", step))
            torch.ones(4).sum()
            window.step()
            calls.append(("after step", step))
    assert calls == [
        ("after step", 1),
        ("history", "all"),  # at the end of step 2 = wait + warmup: the ledger's step is the next
        ("after step", 2),
        ("ledger step", 3),
        ("dump", "memory_snapshot.pickle"),
        ("history", None),  # and off before step 4, which the window still traces
        ("after step", 3),
        ("after step", 4),
        ("after step", 5),
        ("after step", 6),
    ], calls
