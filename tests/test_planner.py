"""memfit.prediction.planner: the settings that fit a budget, the same training first, each group fastest first,
and the out-of-memory explanation that ends a run which did not fit."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, load_script, one_process_plan, out_of_memory_in, run_in_process
from memfit.args import StepSettings
from memfit.training.optim import OPTIMIZERS
from memfit.training.quantizers import QUANTIZERS


@pytest.mark.slow
def test_planner_lists_settings_that_fit_fastest_first(embedded, capsys):
    """The planner itself, on the LoRA script's step (the --memory_budget output around its rows, with the reverse
    answers, is tests/test_most_that_fits.py's)."""
    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.prediction.estimate import estimate
    from memfit.prediction.planner import plans_that_fit, training_changes
    from memfit.settings.budget import ALLOCATOR_RESERVE
    from memfit.settings.run import ScriptStep
    from memfit.units import fmt_bytes

    config = Config.from_file(embedded[0] / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
    script = ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, load_script("finetune/lora.py").train_step)
    plan = one_process_plan(micro_batch_size=4, accumulation=2, sequence_length=96, precision="bf16-true")
    budget = int(estimate(script, plan).peak * 0.8)  # the given settings do not fit
    fitting = plans_that_fit(script, plan, budget)
    assert fitting, "something must fit 80% of the given peak"
    assert "planning: settings tried" in capsys.readouterr().err  # a wait of seconds to minutes shows its progress
    assert all(estimate.peak * (1 + ALLOCATOR_RESERVE) <= budget for _, estimate in fitting)
    # the same training first, then what changes it (a quantization, another optimizer), each fastest first
    changed = [bool(training_changes(e.plan, plan)) for _, e in fitting]
    assert changed == sorted(changed), changed
    for group in (False, True):
        costs = [cost for (cost, _), other in zip(fitting, changed, strict=True) if other == group]
        assert costs == sorted(costs)
    assert min(cost for cost, _ in fitting) > 1.0  # every fitting option costs some speed
    kinds = {
        (
            e.plan.micro_batch_size,
            e.plan.activation_checkpointing,
            e.plan.quantize,
            e.plan.optimizer,
            e.plan.activation_offloading,
        )
        for _, e in fitting
    }
    assert len(kinds) == len(fitting) >= 3
    print(f"budget {fmt_bytes(budget)}: {len(fitting)} settings fit; fastest {fitting[0][1].plan.describe()}")

    # the same rows as searching the fewest checkpointed blocks of every plan that fits only checkpointed, then
    # dropping the rows a faster one makes pointless: the planner searches only where its turn comes
    every, searched = _every_row(script, plan, budget, trains_all_weights=False)
    assert [(cost, e.plan, e.peak) for cost, e in every] == [(cost, e.plan, e.peak) for cost, e in fitting]
    assert searched >= 2, searched  # plans whose fewest blocks were searched for


def _every_row(script, plan, budget: int, trains_all_weights: bool) -> tuple[list, int]:
    """The planner's rows made the slow way: every candidate estimated, every plan that fits only with each block
    checkpointed searched for its fewest blocks, then sorted and the pointless dropped; and how many were searched."""
    from memfit.prediction.estimate import estimate
    from memfit.prediction.most_that_fits import Searcher, fewest_checkpointed
    from memfit.prediction.planner import (
        candidates,
        dominated,
        recompiles_per_length,
        slowdown,
        training_changes,
    )
    from memfit.settings.budget import fits

    searcher = Searcher(script, budget, plan.accelerator)
    given = estimate(script, plan, whole_step=False, extrapolate=True)
    rows, searched = [], 0
    for candidate in candidates(plan, trains_all_weights=trains_all_weights):
        result = estimate(script, candidate, whole_step=False, extrapolate=True)
        if not fits(result.peak, budget, "cuda"):
            continue
        if candidate.activation_checkpointing == candidate.blocks:
            if searcher.fits(dataclasses.replace(candidate, activation_checkpointing=0)):
                continue
            result, searched = fewest_checkpointed(searcher, candidate).result, searched + 1
        rows.append((slowdown(result, given, budget), result))
    every = []
    for cost, result in sorted(rows, key=lambda row: (row[0], row[1].peak)):
        if not dominated(result, result.peak, every, plan):
            every.append((cost, result))
    # and the fastest row of the same training compiled, where it fits (a GPU's plan, blocks that compile once)
    same = [result for _, result in every if not training_changes(result.plan, plan)]
    if same and plan.accelerator != "cpu" and not recompiles_per_length(script.config):
        compiled = estimate(script, dataclasses.replace(same[0].plan, compile=True), whole_step=False, extrapolate=True)
        if fits(compiled.peak, budget, "cuda"):
            every = sorted([*every, (slowdown(compiled, given, budget), compiled)], key=lambda row: row[0])
    return sorted(every, key=lambda row: bool(training_changes(row[1].plan, plan))), searched


@pytest.mark.slow
def test_the_planner_traces_a_whole_depth_plan_only_when_its_turn_comes(embedded):
    """Full fine-tuning of a 6-block model: its plans are estimated from 2- and 3-block traces, but CPU offload's
    (FSDP) from whole-depth ones, made only when the plan's turn comes (its model's sizes stand in until then) and never
    past the rows listed: the same rows as estimating every plan first."""
    from litgpt import GPT, Config
    from litgpt.model import Block

    from memfit.prediction.estimate import estimate, untraced
    from memfit.prediction.planner import least_slowdown, plans_that_fit
    from memfit.settings.run import ScriptStep

    config = Config.from_file(embedded[0] / "model_config.yaml", n_layer=6)
    script = ScriptStep(GPT, Block, config, None, load_script("finetune/full.py").train_step)
    plan = one_process_plan(micro_batch_size=1, accumulation=2, sequence_length=32, precision="bf16-true", blocks=6)
    budget = int(estimate(script, plan).peak * 0.3)  # only CPU offload fits, the fastest with some blocks checkpointed
    every, searched = _every_row(script, plan, budget, trains_all_weights=True)
    assert all(row.plan.cpu_offload for _, row in every) and searched, [row.plan.describe() for _, row in every]
    # where a plan waits in the planner's queue, from its model's sizes alone, is no later than its row's place
    given = estimate(script, plan, whole_step=False, extrapolate=True)
    for cost, row in every:
        candidate = dataclasses.replace(row.plan, activation_checkpointing=row.plan.activation_checkpointing and 6)
        assert least_slowdown(untraced(script, candidate), given, budget) <= cost, row.plan.describe()
    whole_depth = lambda script: sum(1 for key in script.traced if isinstance(key[0], bool))  # noqa: E731
    fitting = plans_that_fit(script, plan, budget, most=len(every))  # on the traces made above
    assert [(c, e.plan, e.peak) for c, e in fitting] == [(c, e.plan, e.peak) for c, e in every]
    fresh = dataclasses.replace(script, traced={})
    fitting = plans_that_fit(fresh, plan, budget, most=2)
    assert [(c, e.plan, e.peak) for c, e in fitting] == [(c, e.plan, e.peak) for c, e in every[:2]]
    assert whole_depth(fresh) < whole_depth(script), (whole_depth(fresh), whole_depth(script))


@pytest.mark.slow
def test_the_planner_offers_the_fastest_plan_compiled_where_its_blocks_compile_once(embedded):
    """Full fine-tuning on a GPU's plan: the fastest row of the same training is offered compiled too, its peak the
    compiled step's estimate and its time the eager twin's x ``COMPILED_STEP_COST``, first where it fits. LoRA on the
    query and value, whose compiled blocks compile again for every length, is not offered it; nor a CPU's plan."""
    from litgpt import GPT, Config
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import Block as LoRABlock
    from litgpt.lora import Config as LoRAConfig
    from litgpt.lora import mark_only_lora_as_trainable
    from litgpt.model import Block

    from memfit.prediction.estimate import estimate
    from memfit.prediction.planner import COMPILED_STEP_COST, plans_that_fit, recompiles_per_length
    from memfit.settings.run import ScriptStep

    config = Config.from_file(embedded[0] / "model_config.yaml")
    script = ScriptStep(GPT, Block, config, None, load_script("finetune/full.py").train_step)
    plan = one_process_plan(micro_batch_size=2, accumulation=2, sequence_length=32, precision="bf16-true")
    budget = int(estimate(script, plan).peak * 2)  # the given settings fit
    fitting = plans_that_fit(script, plan, budget)
    compiled = [(cost, row) for cost, row in fitting if row.plan.compile]
    assert len(compiled) == 1 and fitting[0] == compiled[0], [row.plan.describe() for _, row in fitting]
    cost, row = compiled[0]
    twin = next((c, r) for c, r in fitting if r.plan == dataclasses.replace(row.plan, compile=False))
    assert cost == pytest.approx(twin[0] * COMPILED_STEP_COST)
    assert row.peak == estimate(script, row.plan, whole_step=False, extrapolate=True).peak < twin[1].peak
    assert "--compile true" in row.plan.as_flags()
    on_cpu = plans_that_fit(script, dataclasses.replace(plan, accelerator="cpu"), budget)
    assert not any(row.plan.compile for _, row in on_cpu)

    lora_config = LoRAConfig.from_file(embedded[0] / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
    assert recompiles_per_length(lora_config) and not recompiles_per_length(config)
    lora = ScriptStep(
        LoRAGPT, LoRABlock, lora_config, mark_only_lora_as_trainable, load_script("finetune/lora.py").train_step
    )
    assert not any(row.plan.compile for _, row in plans_that_fit(lora, plan, budget))


@pytest.mark.slow
def test_out_of_memory_ends_with_an_explanation(tmp_path, embedded, monkeypatch):
    """A simulated allocation failure in backward on CPU: the ledger at the failing phase and what would fit."""
    out_of_memory_in(monkeypatch, "backward")
    result = run_in_process(
        "finetune/lora.py",
        "--train.max_steps",
        "5",
        "--train.save_interval",
        "1",
        "--memory_budget",
        "12MiB",
        cwd=tmp_path,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    err = result.stderr
    assert "Traceback" not in err
    assert "Out of memory in backward at step 1 on cpu" in err
    assert "Held when it failed: params_trainable" in err
    assert (
        "Settings that fit 12.00 MiB against the CPU ledger's tensor peak, the same training first, each fastest first"
        in err
    )
    assert "With these settings otherwise: --train.max_seq_length " in err and "--activation_checkpointing" in err
    assert "No checkpoint was written for the failed step" in err
    out_dir = tmp_path / "out/finetune/lora"
    assert not out_dir.exists() or not any(out_dir.iterdir())  # no checkpoint, not even a half-written one


_TOO_LARGE = ["--train.global_batch_size", "1024", "--train.max_steps", "1", "--logger_name", "csv"]
"""Full fine-tuning of the embedded model, one step of a global batch of 1,024 samples (with ``--train.micro_batch_size
1024``, a micro-batch that needs more than the limit leaves)"""


def _limited(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    from memfit.failure.oom import ADDRESS_SPACE_LIMITED  # the GPU check's CPU rehearsal runs the same

    return subprocess.run(
        [sys.executable, "-c", ADDRESS_SPACE_LIMITED, str(ROOT / "finetune/full.py"), *_TOO_LARGE, *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_real_cpu_allocation_failure_ends_with_an_explanation(tmp_path, embedded):
    """Not simulated: under an address-space limit (``memfit.failure.oom.ADDRESS_SPACE_LIMITED``: 1.5 GB more than the process
    uses once its libraries are loaded) a micro-batch that needs more fails in PyTorch's CPU allocator, which raises a
    plain RuntimeError, not torch.OutOfMemoryError (a traceback, where nothing catches it). The run ends as an
    out-of-memory on a GPU does: where, what was held, settings that fit what the limit left, exit 3, no checkpoint.
    Its one step is the step the profiler records, whose stop needs host memory the failed step still holds (it raised
    a MemoryError over the run's own error)."""
    result = _limited(tmp_path, "--train.micro_batch_size", "1024", "--profile_dir", str(tmp_path / "profiles"))
    err = _explained_cpu_out_of_memory(result, tmp_path / "profiles", tmp_path / "out/finetune/full")
    assert "at step 1 on cpu: [enforce fail" in err
    assert "Held when it failed: params_trainable" in err
    number, unit = err.split("Settings that fit ")[1].split()[:2]
    fits = float(number) * {"MiB": 2**20, "GiB": 2**30}[unit]
    assert fits <= 0.85 * 1.5e9 + 0.01 * 2**30  # of what the limit left (to 0.01 GiB), not the machine's RAM


def _explained_cpu_out_of_memory(result: subprocess.CompletedProcess, profiles: Path, out_dir: Path) -> str:
    """Checks a run that ran out of a CPU's memory for real ended as an out-of-memory on a GPU does (exit 3, no
    traceback, what was alive and who asked, a picture, no checkpoint); returns its stderr."""
    err = result.stderr
    assert result.returncode == 3, err[-3000:]
    assert "Traceback" not in err
    assert " on cpu: [enforce fail" in err and "DefaultCPUAllocator: can't allocate memory" in err, err[-3000:]
    # what was alive, read at the failure: the forward's saved activations outweigh the trained weights
    (failure,) = profiles.glob("*/oom/ledger.json")
    alive = json.loads(failure.read_text())
    assert alive["bytes_by_role"]["activations"] > alive["bytes_by_role"]["params_trainable"] > 0, alive
    assert alive["failing_request_bytes"] > 0 and "Largest holders at the failure: activations" in err, err[-3000:]
    # drawn too, once the failed step is let go: matplotlib needs memory the failed step held (a SystemError in the
    # drawing, then a crash at exit, where it drew first)
    assert "warning: could not" not in err and "Picture: " in err, err[-3000:]
    # the model's line that asked, not torch's: the tiny model's forward, in litgpt (or Memfit's loss)
    asked = alive["failing_request_at"]
    assert asked["source"].split("/")[0] in ("litgpt", "memfit") and asked["code"], asked
    assert f"The failed request came from {asked['source']}: " in err, err[-3000:]
    assert "No checkpoint was written for the failed step" in err
    assert not out_dir.exists() or not any(out_dir.iterdir())
    return err


@pytest.mark.slow
def test_the_first_setting_a_real_cpu_out_of_memory_suggests_runs_under_the_same_limit(tmp_path, embedded):
    """The failure above, then its first suggestion, as the flags it prints, run under the same limit: it trains."""
    failed = _limited(tmp_path, "--train.micro_batch_size", "1024", "--profile_dir", str(tmp_path / "profiles"))
    assert failed.returncode == 3, failed.stderr[-3000:]
    first = failed.stderr.split("The first as flags: ")[1].splitlines()[0].split()
    result = _limited(tmp_path, *first, "--out_dir", str(tmp_path / "fits"))
    assert result.returncode == 0, (first, result.stderr[-3000:])


def test_an_out_of_memory_the_estimate_says_should_not_happen_is_pointed_out(capsys):
    """When the failing settings are themselves among those predicted to fit, the explanation says so and where
    else the memory may have gone, instead of leaving the user to spot them in the list; when they do not fit, it
    does not."""
    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.failure.oom import explain_oom
    from memfit.memory import MemoryProbe
    from memfit.observatory.phases import PhaseMemory
    from memfit.settings.run import ScriptStep

    config = Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=64,
        vocab_size=256,
        padded_vocab_size=256,
        lora_r=4,
        lora_query=True,
        lora_value=True,
    )
    script = ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, load_script("finetune/lora.py").train_step)
    plan = one_process_plan(micro_batch_size=2, accumulation=1, sequence_length=32, accelerator="cpu")
    memory = PhaseMemory(MemoryProbe(torch.device("cpu")))
    explain_oom(torch.OutOfMemoryError("simulated"), 1, torch.device("cpu"), memory, script, plan, "1GB")
    err = capsys.readouterr().err
    assert "The estimate puts these very settings at " in err and "under 953.67 MiB: the memory went elsewhere" in err
    explain_oom(torch.OutOfMemoryError("simulated"), 1, torch.device("cpu"), memory, script, plan, "100KB")
    err = capsys.readouterr().err
    assert "Nothing the planner tries fits" in err and "these very settings" not in err


def test_an_out_of_memory_explanation_survives_a_model_the_estimate_cannot_trace(capsys):
    """Working out what would fit runs the model on fake tensors; a model they cannot run (an operation whose output
    size depends on values) costs that part of the explanation a warning line, not the explanation and the clean
    end: the lines before and after it are still printed."""
    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.failure.oom import explain_oom
    from memfit.memory import MemoryProbe
    from memfit.observatory.phases import PhaseMemory
    from memfit.settings.run import ScriptStep

    class NonzeroGPT(GPT):
        def forward(self, idx, *args, **kwargs):
            torch.nonzero(idx)  # its size depends on the values
            return super().forward(idx, *args, **kwargs)

    config = Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=64,
        vocab_size=256,
        padded_vocab_size=256,
        lora_r=4,
        lora_query=True,
        lora_value=True,
    )
    lora_step = load_script("finetune/lora.py").train_step
    script = ScriptStep(NonzeroGPT, Block, config, mark_only_lora_as_trainable, lora_step)
    plan = one_process_plan(micro_batch_size=2, accumulation=1, sequence_length=32)
    memory = PhaseMemory(MemoryProbe(torch.device("cpu")))
    explain_oom(torch.OutOfMemoryError("simulated"), 1, torch.device("cpu"), memory, script, plan, "1GB")
    err = capsys.readouterr().err
    # the planner's progress bar (a few redrawn lines, cleared at its end) is not part of the explanation
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("planning: settings tried")]
    assert lines[0] == "Out of memory in loading the model on cpu: simulated", lines
    assert lines[-2].startswith("warning: could not work out settings that fit ("), lines
    assert (
        lines[-1] == "No checkpoint was written for the failed step, nor before it: run again with settings that fit."
    )
    # after a checkpoint: where to resume from, and with what
    explain_oom(
        torch.OutOfMemoryError("simulated"),
        3,
        torch.device("cpu"),
        memory,
        script,
        plan,
        "1GB",
        Path("out/finetune/lora/step-000002"),
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "No checkpoint was written for the failed step. --resume true continues from"
        f" {Path('out/finetune/lora/step-000002')} with the same settings, or with a smaller"
        " --train.micro_batch_size"
    ), last


def test_paging_and_offload_cost_what_they_spill():
    """Paged optimizer state that fits beside the peak never moves; the more spills, the slower the plan. CPU
    offload's cost grows with the weights it moves per micro-batch."""
    import dataclasses

    from memfit.prediction.estimate import Estimate
    from memfit.prediction.planner import PCIE_BYTES_PER_S, slowdown, spill_seconds

    gib = 2**30
    plan = one_process_plan(
        micro_batch_size=1, accumulation=8, sequence_length=512, precision="bf16-true", optimizer="PagedAdamW8bit"
    )
    paged = Estimate(
        plan=plan,
        phases={"forward": {"peak": 20 * gib, "roles": {}}},
        host={"paged_state": 12 * gib},
        parameters=7 * 10**9,
        trainable=7 * 10**9,
    )
    assert spill_seconds(paged, 40 * gib) == 0  # 20 GiB free beside the peak: the 12 GiB stay
    partly, fully = spill_seconds(paged, 28 * gib), spill_seconds(paged, 20 * gib)
    assert 0 < partly < fully == 2 * 12 * gib / PCIE_BYTES_PER_S
    # against the same optimizer unpaged, at the same peak
    unpaged = dataclasses.replace(paged, plan=dataclasses.replace(plan, optimizer=OPTIMIZERS["AdamW8bit"]), host={})
    assert slowdown(paged, unpaged, 40 * gib) == 1.0
    assert 1.0 < slowdown(paged, unpaged, 28 * gib) < slowdown(paged, unpaged, 20 * gib)
    offload = dataclasses.replace(plan, optimizer=OPTIMIZERS["AdamW"], cpu_offload=True, strategy="fsdp")
    few, many = (
        Estimate(
            plan=dataclasses.replace(offload, accumulation=a),
            phases={"forward": {"peak": gib, "roles": {}}},
            host={"offloaded_params": 14 * gib, "offloaded_trainable": 7 * 10**9},
            parameters=7 * 10**9,
            trainable=7 * 10**9,
        )
        for a in (1, 8)
    )
    assert spill_seconds(many, 80 * gib) > spill_seconds(few, 80 * gib) > 0


def test_the_planners_slowdown_is_relative_to_the_given_settings():
    """ "Slowdown vs. the given settings" was each plan's own cost factor: for a QLoRA recipe the planner listed the
    recipe's very settings at x1.22, and the nf4 variant (no double quantization) at x1.15, as if both were slower.
    The given settings are x1.00; each change is priced against them."""
    import dataclasses

    from memfit.prediction.estimate import Estimate
    from memfit.prediction.planner import slowdown

    gib = 2**30
    given = one_process_plan(
        micro_batch_size=2,
        accumulation=8,
        sequence_length=512,
        precision="bf16-true",
        quantize="bnb.nf4-dq",
        optimizer="PagedAdamW8bit",
    )

    def predicted(**changes) -> Estimate:
        return Estimate(
            plan=dataclasses.replace(given, **changes),
            phases={"forward": {"peak": 12 * gib, "roles": {}}},
            host={},
            parameters=7 * 10**9,
            trainable=40 * 10**6,
            block_parameters=202 * 10**6,  # Llama-2-7B's
        )

    budget = 16 * gib
    assert slowdown(predicted(), predicted(), budget) == 1.0
    changes = {
        "nf4 without double quantization": dict(quantize=QUANTIZERS["bnb.nf4"]),
        "fused AdamW": dict(optimizer=OPTIMIZERS["AdamW"]),
        "half the micro-batch": dict(micro_batch_size=1, accumulation=16),
        "activation checkpointing": dict(activation_checkpointing=True),
    }
    factors = {name: slowdown(predicted(**change), predicted(), budget) for name, change in changes.items()}
    # each change is priced against the given settings, in both directions, and against each other consistently
    for name, change in changes.items():
        assert factors[name] * slowdown(predicted(), predicted(**change), budget) == pytest.approx(1.0), name
    both = slowdown(predicted(quantize=QUANTIZERS["bnb.nf4"], activation_checkpointing=True), predicted(), budget)
    assert both == pytest.approx(factors["nf4 without double quantization"] * factors["activation checkpointing"])
    # what is less work is faster than the given settings, what is more work slower
    assert factors["nf4 without double quantization"] < 1 and factors["fused AdamW"] < 1
    assert factors["half the micro-batch"] > 1 and factors["activation checkpointing"] > 1
    # the costs come from the model: checkpointing every block adds each block's forward (2 x its parameters a
    # token) to LoRA's 4 x parameters, and halving the micro-batch reads every weight twice as often
    from memfit.prediction.planner import GPU_FLOPS, HBM_BYTES_PER_S

    tokens = 2 * 8 * 512
    compute = 4 * 7e9 * tokens / GPU_FLOPS
    reads = 8 * 2 * 7e9 * 2 / HBM_BYTES_PER_S
    recompute = 2 * 202e6 * 4 * tokens / GPU_FLOPS
    assert factors["activation checkpointing"] == pytest.approx(
        (compute + recompute + reads * (1 + 4 * 202e6 / 14e9)) / (compute + reads)
    )
    assert factors["half the micro-batch"] == pytest.approx((compute + 2 * reads) / (compute + reads))
    assert factors["nf4 without double quantization"] == pytest.approx(1.15 / 1.2)
    # fewer blocks checkpointed cost less
    two = slowdown(predicted(activation_checkpointing=2), predicted(), budget)
    assert 1 < two < factors["activation checkpointing"]


def test_an_out_of_memory_inside_a_checkpointed_region_leaves_no_saved_tensor_hooks_for_the_planner():
    """torch 2.11's checkpoint keeps its saved-tensor hooks pushed in a suspended generator when the checkpointed
    function raises (an H200's CUDA out-of-memory in the loss's checkpointed head): the error's traceback keeps it
    alive, and the planner's fake step then saved into the dead checkpoint (CheckpointError). The same shape here:
    hooks pushed in a generator left at its yield by a function that raised, caught by a ``with`` as ends_cleanly
    catches it. Once ``release_failed_step`` has run, a new graph's saved tensors no longer reach those hooks."""
    from contextlib import contextmanager

    from memfit.failure.oom import release_failed_step

    packed = []

    def suspended_checkpoint():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            yield

    def failing_step():
        region = suspended_checkpoint()
        next(region)  # as torch 2.11's checkpoint: the function runs between two next() calls
        raise torch.OutOfMemoryError("CUDA out of memory (inside a checkpointed region)")

    def saves_into_stale_hooks() -> bool:
        packed.clear()
        x = torch.ones(3, requires_grad=True)
        (x * x).sum()
        return bool(packed)

    seen = {}

    @contextmanager
    def catches():
        try:
            yield
        except RuntimeError as error:
            seen["before"] = saves_into_stale_hooks()
            release_failed_step(error)
            seen["after"] = saves_into_stale_hooks()

    with catches():
        failing_step()
    assert seen == {"before": True, "after": False}


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, checkpointing, sequence_length",
    [
        ("finetune/full.py", False, 48),
        ("finetune/full.py", True, 48),
        ("finetune/full.py", False, 500),
        ("finetune/lora.py", False, 500),
    ],
)
def test_the_planners_half_trace_predicts_the_whole_steps_peaks(script, checkpointing, sequence_length, embedded):
    """The planner traces only the first two chunks of the head (memfit.training.loss.only_chunks): every phase's peak
    is that of the estimate's trace of all of them. 2 x 500 tokens are four chunks of the embedded head (256 tokens
    each, the last shorter), for a trained head (full) and a frozen one (LoRA, whose gradients are taken in forward).
    (Both trace a step's last micro-batch alone, on gradients as the earlier ones leave them: the estimates against
    runs with accumulation in tests/test_estimate.py check that against what the runs measured.)"""
    from memfit.prediction.estimate import estimate
    from memfit.settings.run import ScriptStep

    module = load_script(script)
    checkpoint_dir, _ = embedded
    config = module.Config.from_file(checkpoint_dir / "model_config.yaml")
    if script == "finetune/lora.py":
        config = dataclasses.replace(config, lora_r=4, lora_query=True, lora_value=True)
    step = ScriptStep(
        module.GPT, module.Block, config, getattr(module, "mark_only_lora_as_trainable", None), module.train_step
    )
    plan = one_process_plan(
        micro_batch_size=2,
        accumulation=4,
        sequence_length=sequence_length,
        precision="bf16-true",
        activation_checkpointing=checkpointing,
        step_settings=StepSettings(max_norm=1.0),
    )
    whole, half = estimate(step, plan), estimate(step, plan, whole_step=False)
    assert set(half.phases) == set(whole.phases)
    for name, phase in whole.phases.items():
        assert half.phases[name]["peak"] == phase["peak"], (name, half.phases[name]["peak"], phase["peak"])
    assert half.peak == whole.peak


def test_the_out_of_memory_advice_plans_for_what_the_gpu_has_free_for_this_process():
    """Not the whole card: another job's memory and this process's CUDA context are what the driver does not report
    free; this process's own cached blocks are reusable; a per-process fraction caps the allocator."""
    from memfit.failure.oom import cuda_capacity

    gib = 2**30
    # an 80 GiB card: another job holds 30 GiB, this process's context 0.5 and its allocator 10 (reusable)
    free, reserved = int(80 * gib - 30 * gib - 0.5 * gib - 10 * gib), 10 * gib
    assert cuda_capacity(free, 80 * gib, reserved) == int(49.5 * gib)
    assert cuda_capacity(free, 80 * gib, reserved, fraction=0.25) == 20 * gib  # set_per_process_memory_fraction


@pytest.mark.slow
def test_the_planners_rows_say_whether_they_change_the_training_and_none_saves_nothing(tmp_path):
    """Llama-2-7B QLoRA at 1,024 tokens under 24 GiB: no row is an 8-bit or paged variant saving a LoRA's few MiB of
    optimizer state, and each row says whether it trains as the given settings do (a micro-batch at the same global
    batch, checkpointing) or not (nf4-dq, an unquantized base), with the fastest same-training row as flags."""
    command = ["--model_name", "Llama-2-7b-hf", "--quantize", "bnb.nf4", "--precision", "bf16-true"]
    command += ["--train.max_seq_length", "1024", "--memory_budget", "24GiB", "--estimate", "true"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "finetune/lora.py"), *command], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("  x")]
    assert len(rows) >= 4 and not any("AdamW8bit" in row or "Paged" in row for row in rows), rows
    # everything fits unchecked at 1,024 tokens: no row checkpoints a block it need not
    assert not any("activation_checkpointing" in row for row in rows), rows
    for row in rows:
        settings, label = row.rsplit("  [", 1)
        same = "bnb.nf4," in settings and "bnb.nf4-dq" not in settings
        assert label == ("the same training]" if same else label) and (same or label.startswith("changes the")), row
    # the same training is listed first, so the first row as flags is its fastest
    assert "The first as flags: --train.micro_batch_size 2 " in result.stdout, result.stdout[-3000:]
    assert "--quantize bnb.nf4 --optimizer AdamW" in result.stdout.split("The first as flags: ")[1].splitlines()[0]


def test_does_it_fit_is_answered_yes_or_no_first():
    """ "Will it fit my 4090?" gets a straight answer before any plan: the card as a training process has it, the
    predicted peak, the allocator's reserve on a GPU, and how much is to spare or too much."""
    from memfit.settings.budget import fit_answer, parse_budget

    card = parse_budget("4090")
    no = fit_answer(50 * 2**30, card, "4090", "cuda")
    assert no.startswith("Do these settings fit the 4090 (23.49 GiB for a training process)? No: 50.00 GiB predicted")
    assert "55.00 GiB with the allocator's reserve, 31.51 GiB too much." in no
    yes = fit_answer(10 * 2**30, card, "4090", "cuda")
    assert yes.startswith("Do these settings fit the 4090") and "? Yes: 10.00 GiB predicted" in yes
    assert yes.endswith("to spare.")
    cpu = fit_answer(100 * 2**20, parse_budget("1GiB"), "1GiB", "cpu")
    assert cpu == "Do these settings fit 1.00 GiB? Yes: 100.00 MiB predicted, 924.00 MiB to spare."


@pytest.mark.slow
def test_the_advice_after_an_out_of_memory_under_ulimit_holds_when_followed(tmp_path, embedded):
    """A newcomer's case: the quick start's LoRA with a micro-batch of 256, under an address-space limit that leaves
    it about 700 MiB (``ulimit -v 1500000`` on this project's machine). The address space grows far beyond the tensors
    (threads' arenas, the profiler window), so the advice is planned from what the tensors held at the failure: its
    first plan, run under the same limit, trains to the end (planned from the space left at the start, the first plan
    ran out again). The failure itself is PyTorch's CPU allocator's plain RuntimeError (not torch.OutOfMemoryError), and
    the run ends as an out-of-memory on a GPU does: where, what was held, a picture, settings that fit, exit 3, no
    checkpoint (full fine-tuning's failure goes through the same code: in the extended tier,
    test_a_real_cpu_allocation_failure_ends_with_an_explanation)."""
    from memfit.failure.oom import ADDRESS_SPACE_LIMITED

    limited = ADDRESS_SPACE_LIMITED.replace("1_500_000_000", "740_000_000")
    assert limited != ADDRESS_SPACE_LIMITED
    # 4 steps: the profiled one (the third, with the longest samples), a validation and the saves, as a whole run has
    lora = [sys.executable, "-c", limited, str(ROOT / "finetune/lora.py"), "--train.global_batch_size", "256"]
    lora += ["--train.max_steps", "4"]
    failed = subprocess.run(
        [*lora, "--train.micro_batch_size", "256", "--profile_dir", str(tmp_path / "p1")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = _explained_cpu_out_of_memory(failed, tmp_path / "p1", tmp_path / "out/finetune/lora")
    assert "Under the address-space limit (ulimit -v) the tensors held" in err, err[-3000:]
    first = err.split("The first as flags: ")[1].splitlines()[0].split()
    followed = subprocess.run(
        [*lora, *first, "--out_dir", str(tmp_path / "fits"), "--profile_dir", str(tmp_path / "p2")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert followed.returncode == 0, (first, followed.stderr[-3000:])
