"""Every wait of more than a couple of seconds shows progress on stderr, as training's bar does: the layers of a
checkpoint loaded and quantized, and the indivisible waits after a run (the trace parsed for the ledger and the
pictures) as a line counting their seconds. A short wait prints nothing."""

import time

import lightning as L  # imported here, not under capsys: Lightning's log handler keeps the stderr it is made with
import pytest
import torch

import memfit.progress as progress
from memfit.progress import layers_loaded, waiting


def test_a_long_wait_counts_its_seconds_and_a_short_one_prints_nothing(capsys, monkeypatch):
    monkeypatch.setattr(progress, "SHOWN_AFTER_S", 0.3)
    with waiting("parsing the trace", every=0.1):
        time.sleep(1.3)
    shown = capsys.readouterr().err
    assert "parsing the trace: 00:01" in shown, shown
    with waiting("parsing the trace", every=0.1):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""
    with waiting("parsing the trace", enabled=False, every=0.1):  # the other ranks of a run
        time.sleep(0.6)
    assert capsys.readouterr().err == ""


def test_a_quantized_load_counts_the_layers_it_has_quantized(tmp_path, capsys, monkeypatch):
    """The real loader on a real checkpoint: bitsandbytes quantizes each linear weight as load_state_dict reaches it,
    and the bar counts every layer that holds weights (embedding, norms, linears, head) up to the whole model."""
    from litgpt import GPT, Config

    from memfit.training.loading import load_model
    from memfit.training.quantizers import QUANTIZERS

    monkeypatch.setattr(progress, "SHOWN_AFTER_S", 0.0)
    config = Config(n_layer=2, n_head=2, n_embd=32, block_size=16, padded_vocab_size=64, vocab_size=64)
    torch.save(GPT(config).state_dict(), tmp_path / "lit_model.pth")
    model = load_model(
        GPT,
        config,
        tmp_path / "lit_model.pth",
        dtype=torch.float32,
        device=torch.device("cpu"),
        quantize=QUANTIZERS["bnb.nf4"],
    )
    holding = sum(next(m.parameters(recurse=False), None) is not None for m in model.modules())
    shown = capsys.readouterr().err
    assert "loading and quantizing (bnb.nf4) lit_model.pth" in shown, shown
    assert f"{holding}/{holding}" in shown, shown
    assert type(model.transformer.h[0].attn.qkv).__name__ == "Linear4bit"


def test_the_bar_is_not_shown_when_loading_is_quick_or_on_other_ranks(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    state = model.state_dict()
    with layers_loaded(model, "loading"):  # memory-mapped and assigned: at once
        model.load_state_dict(state)
    with layers_loaded(model, "loading", enabled=False):
        model.load_state_dict(state)
    assert capsys.readouterr().err == ""
    # the hooks are gone afterwards: a later load counts nothing
    assert not any(m._load_state_dict_pre_hooks for m in model.modules())


def test_the_work_after_a_run_shows_how_long_it_has_taken(capsys, monkeypatch):
    """``report.optional`` (the ledger, the picture, the page after training) runs each part under ``waiting``, on
    rank 0: a part that takes its time names itself on stderr."""
    from memfit.observatory.report import optional

    monkeypatch.setattr(progress, "SHOWN_AFTER_S", 0.2)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    optional(fabric, "complete the ledger from the profiler trace", time.sleep, 0.8)
    assert "complete the ledger from the profiler trace: 00:00" in capsys.readouterr().err


def test_a_wait_inside_the_profilers_quiet_bars_does_not_hang(capsys, monkeypatch):
    """The profiler's step runs with tqdm's lock held (quiet_bars clears the training bar around it); a 4-process
    FSDP run hung there when the seconds' line was a tqdm bar waiting for that lock. Run in a thread, so a hang fails
    the test instead of stopping the suite."""
    import threading

    from tqdm import tqdm

    from memfit.progress import quiet_bars

    monkeypatch.setattr(progress, "SHOWN_AFTER_S", 0.2)
    finished = threading.Event()

    def profiled_step():
        with tqdm(total=4, desc="training") as bar, quiet_bars(), waiting("profiler: writing the trace", every=0.1):
            time.sleep(0.8)
            bar.update()
        finished.set()

    threading.Thread(target=profiled_step, daemon=True).start()
    assert finished.wait(10), "the wait inside quiet_bars hung"
    assert "profiler: writing the trace: 00:00" in capsys.readouterr().err


@pytest.mark.slow
def test_a_line_the_profiler_prints_while_it_records_starts_a_line_of_its_own(tmp_path):
    """torch's profiler prints lines of its own on stderr: "USDT: ... profiler_start" as it starts, and on a CPU, once a
    process, the allocator's "Memory block of unknown size was allocated before the profiling started" at the first
    free of a block older than the profiler, which fell between two steps with the bar drawn. Each starts a line of its
    own (``memfit.observatory.profiling.profiler_starting``) instead of running on from the bar's "... MiB]"."""
    import re

    from conftest import run_script

    run = run_script("pretrain/pretrain.py", "--train.max_steps", "4", "--out_dir", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = [m.start() for m in re.finditer(r"\[W\d{4} [^\]]*\.cpp:\d+\]|USDT:", run.stderr)]
    assert printed, run.stderr[-2000:]  # the profiler does print while it records
    glued = [run.stderr[max(0, i - 60) : i + 60] for i in printed if i and run.stderr[i - 1] not in "\r\n"]
    assert not glued, glued
