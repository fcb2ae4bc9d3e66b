"""The most a budget holds (``memfit.prediction.most_that_fits``): each reverse answer is a boundary of the estimate,
and runs for real on the CPU land on the same side of the budget as the estimate says (the ledger's tensor peak);
checkpointing a number of blocks lowers the measured peak as predicted and trains the same weights."""

import dataclasses

import pytest
import torch

from conftest import load_script, one_process_plan, tiny_train
from memfit.settings.run import ScriptStep

pretrain = load_script("pretrain/pretrain.py")


def _pretrain(tmp_path, name: str, **settings):
    from memfit.args import ProfileArgs

    train = settings.pop("train", {})
    return pretrain.setup(
        out_dir=tmp_path / name / "out",
        profile_dir=tmp_path / name / "profiles",
        logger_name="csv",
        accelerator="cpu",
        profile=ProfileArgs(wait=1, warmup=1, active=1),
        train=tiny_train(**{"max_steps": 3, "global_batch_size": 16, "micro_batch_size": 16, **train}),
        **settings,
    )


def _script_step(embedded, script_path: str) -> ScriptStep:
    """The embedded model's step as the estimate takes it from a script: LoRA's (query and value) or full's."""
    if script_path.endswith("lora.py"):
        from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

        config = Config.from_file(embedded[0] / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
        return ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, load_script(script_path).train_step)
    from litgpt.model import GPT, Block, Config

    config = Config.from_file(embedded[0] / "model_config.yaml")
    return ScriptStep(GPT, Block, config, None, load_script(script_path).train_step)


def _measured(run) -> int:
    """The ledger's tensor peak of the recorded step: what a CPU budget is held against."""
    return max(record.peak for record in run.ledger.phases.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, low, high, train",
    [
        ("--train.max_seq_length", 96, 97, {}),
        ("--train.micro_batch_size", 6, 7, {"max_seq_length": 64, "global_batch_size": 84}),
    ],
)
def test_the_answer_fits_when_run_and_the_next_value_does_not(tmp_path, embedded, flag, low, high, train):
    """A budget halfway between the estimates at two neighbouring values: the answer is the lower one, and two real
    pretraining runs (every sample the full length) measure a peak under the budget at it and over it at the next."""
    key = "max_seq_length" if flag == "--train.max_seq_length" else "micro_batch_size"
    peaks = {
        value: _pretrain(tmp_path, f"estimate-{value}", estimate=True, train={**train, key: value}).peak
        for value in (low, high)
    }
    budget = (peaks[low] + peaks[high]) // 2
    result = _pretrain(tmp_path, "budget", estimate=True, memory_budget=f"{budget}B", train={**train, key: low})
    answer = next(limit for limit in result.limits["these settings"] if limit.flag == flag)
    assert (answer.value, answer.next_value) == (low, high), answer.line()
    assert answer.result.peak <= budget < answer.next_result.peak
    measured = {value: _measured(_pretrain(tmp_path, f"run-{value}", train={**train, key: value})) for value in peaks}
    print(f"{flag}: budget {budget:,} B, predicted {peaks}, measured {measured}")
    assert measured[low] <= budget < measured[high], (budget, peaks, measured)


@pytest.mark.slow
def test_checkpointing_each_number_of_blocks_lowers_the_measured_peak_as_predicted_and_trains_the_same(
    tmp_path, embedded
):
    """--activation_checkpointing 0, 1, ..., 4 on the embedded model's 4 blocks: each run's measured peak within 3%
    of its estimate, falling with the count, and the weights after training equal to the unchecked run's."""
    full = load_script("finetune/full.py")
    from memfit.args import ProfileArgs

    measured, predicted, weights = {}, {}, {}
    for count in range(5):
        common = dict(
            out_dir=tmp_path / str(count) / "out",
            profile_dir=tmp_path / str(count) / "profiles",
            logger_name="csv",
            accelerator="cpu",
            activation_checkpointing=count,
            profile=ProfileArgs(wait=1, warmup=1, active=1),
            train=tiny_train(max_steps=3, global_batch_size=8, micro_batch_size=8),
        )
        measured[count] = _measured(full.setup(**common))
        predicted[count] = full.setup(estimate=True, **common).peak
        final = tmp_path / str(count) / "out" / "final" / "lit_model.pth"
        weights[count] = torch.load(final, weights_only=True)["model"]
    print({count: (predicted[count], measured[count]) for count in measured})
    for count in measured:
        assert abs(predicted[count] - measured[count]) <= 0.03 * measured[count], (count, predicted, measured)
        for name, tensor in weights[0].items():
            assert torch.equal(weights[count][name], tensor), (count, name)
    # falling with the count; the fourth block checkpointed saves nothing at the peak (its recomputation comes first
    # in backward, while every other activation is alive), so 3 and 4 are equal, which a suite's order moved by
    # 12 KB (0.05%) in one run
    assert all(measured[c + 1] <= measured[c] * 1.001 for c in range(4)), measured
    assert measured[3] < measured[2] < measured[1] < measured[0], measured
    assert measured[4] < 0.9 * measured[0]


def test_checkpointed_blocks_are_spread_from_the_first_and_counted_once():
    from memfit.errors import UserError
    from memfit.training.loading import checkpointed_blocks, checkpointed_indices

    assert checkpointed_indices(2, 4) == [0, 2] and checkpointed_indices(16, 32) == list(range(0, 32, 2))
    assert checkpointed_indices(1, 4) == [0] and checkpointed_indices(3, 4) == [0, 1, 2]
    assert all(len(set(checkpointed_indices(k, 7))) == k for k in range(8))
    assert checkpointed_blocks(True, 4) == 4 and checkpointed_blocks(False, 4) == 0 and checkpointed_blocks(3, 4) == 3
    with pytest.raises(UserError, match="--activation_checkpointing 5: the model has 4 blocks"):
        checkpointed_blocks(5, 4)
    # every block and one block are different plans (True == 1 in Python)
    shape = dict(micro_batch_size=1, accumulation=1, sequence_length=64)
    every = one_process_plan(activation_checkpointing=True, **shape)
    one = one_process_plan(activation_checkpointing=1, **shape)
    assert every != one and every.checkpointing_flag == "true" and one.checkpointing_flag == "1"
    assert dataclasses.replace(every, activation_checkpointing=0).checkpointing_flag == "false"


def test_largest_fitting_gallops_from_its_guess_and_confirms_the_boundary():
    from memfit.prediction.most_that_fits import largest_fitting

    for boundary in (1, 7, 50, 99, 100):
        for guess in (1, 10, 49, 50, 51, 100):
            found, tried = largest_fitting(1, 100, lambda i, b=boundary: i <= b, guess)
            assert found == boundary
            assert boundary in tried and (boundary == 100 or boundary + 1 in tried)
    assert largest_fitting(1, 100, lambda i: False, 50)[0] is None
    # an accurate guess costs the answer and the value above it
    assert len(largest_fitting(1, 100, lambda i: i <= 40, 40)[1]) == 2


@pytest.mark.slow
def test_the_planner_checkpoints_the_fewest_blocks_that_fit_and_tries_larger_micro_batches(embedded):
    """Every planner row with checkpointing would not fit with one block fewer; a row whose plan fits unchecked
    checkpoints nothing; micro-batches above the given one are tried (up to the process's share of the batch)."""
    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.prediction.estimate import estimate
    from memfit.prediction.planner import candidates, plans_that_fit
    from memfit.settings.budget import fits
    from memfit.settings.run import ScriptStep

    config = Config.from_file(embedded[0] / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
    script = ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, load_script("finetune/lora.py").train_step)
    plan = one_process_plan(micro_batch_size=4, accumulation=4, sequence_length=128, accelerator="cpu")
    assert {8, 16} <= {c.micro_batch_size for c in candidates(plan, trains_all_weights=False)}
    unchecked = estimate(script, plan, whole_step=False).peak
    every = estimate(script, dataclasses.replace(plan, activation_checkpointing=4), whole_step=False).peak
    budget = (unchecked + every) // 2  # fits only with some blocks checkpointed
    rows = plans_that_fit(script, plan, budget)
    checkpointed = [row for _, row in rows if row.plan.activation_checkpointing]
    assert checkpointed, [row.plan.describe() for _, row in rows]
    for row in checkpointed:
        fewer = dataclasses.replace(row.plan, activation_checkpointing=row.plan.activation_checkpointing - 1)
        assert not fits(estimate(script, fewer, whole_step=False).peak, budget, "cpu"), row.plan.describe()


@pytest.mark.slow
@pytest.mark.parametrize("script_path", ["finetune/lora.py", "finetune/full.py"])
def test_a_larger_micro_batch_never_takes_less_memory(embedded, script_path):
    """What lets the planner leave larger micro-batches untraced once one does not fit
    (``memfit.prediction.planner.beyond_reach``): with something accumulated, the estimated peak never falls as the
    micro-batch grows, with or without checkpointing, across the head's chunk size (256 rows: from micro-batch 3 of 96
    tokens), where it is not a straight line."""
    from memfit.prediction.estimate import estimate

    script = _script_step(embedded, script_path)
    for checkpointing in (0, 4):
        plan = one_process_plan(
            micro_batch_size=1,
            accumulation=32,
            sequence_length=96,
            precision="bf16-true",
            quantize="bnb.nf4" if script_path.endswith("lora.py") else None,
            blocks=4,
            activation_checkpointing=checkpointing,
        )
        peaks = [
            estimate(script, dataclasses.replace(plan, micro_batch_size=m, accumulation=32 // m), whole_step=False).peak
            for m in (1, 2, 3, 4, 8, 16)
        ]
        assert peaks == sorted(peaks) and peaks[0] < peaks[-1], (checkpointing, peaks)


@pytest.mark.slow
def test_the_planner_offers_a_micro_batch_above_64_and_traces_only_what_may_fit(embedded, monkeypatch):
    """A global batch of 1,024 on one GPU: micro-batches up to the whole share are candidates; above one that does
    not fit, the same settings are not traced; the fastest row uses the largest micro-batch that fits. A CPU run is
    offered at most ``CPU_MOST_MICRO_BATCH`` (its process outgrows its tensors with the micro-batch)."""
    import memfit.prediction.planner
    from memfit.prediction.estimate import estimate
    from memfit.settings.budget import ALLOCATOR_RESERVE, fits

    script = _script_step(embedded, "finetune/full.py")
    plan = one_process_plan(micro_batch_size=1, accumulation=1024, sequence_length=64, blocks=4)
    at_128 = estimate(script, dataclasses.replace(plan, micro_batch_size=128, accumulation=8), whole_step=False)
    budget = int(at_128.peak * (1 + ALLOCATOR_RESERVE)) + 1
    traced = []
    monkeypatch.setattr(memfit.prediction.planner, "estimate", lambda *a, **k: traced.append(a[1]) or estimate(*a, **k))
    rows = memfit.prediction.planner.plans_that_fit(script, plan, budget)
    tried = memfit.prediction.planner.candidates(plan, trains_all_weights=True)
    assert max(p.micro_batch_size for p in tried) == 1024 and len(traced) < len(tried), (len(traced), len(tried))
    as_given = [
        p.micro_batch_size
        for p in traced
        if p.accumulation > 1 and dataclasses.replace(p, micro_batch_size=1, accumulation=1024) == plan
    ]
    assert max(as_given) == 256, as_given  # 128 fits, 256 does not: nothing above it is estimated
    fastest = rows[0][1].plan
    assert fastest.micro_batch_size == 128 and not fastest.activation_checkpointing, fastest.describe()
    bigger = dataclasses.replace(fastest, micro_batch_size=256, accumulation=4)
    assert not fits(estimate(script, bigger, whole_step=False, extrapolate=True).peak, budget, "cuda")
    on_cpu = memfit.prediction.planner.candidates(dataclasses.replace(plan, accelerator="cpu"), trains_all_weights=True)
    assert max(p.micro_batch_size for p in on_cpu) == memfit.prediction.planner.CPU_MOST_MICRO_BATCH


@pytest.mark.slow
def test_the_fewest_blocks_are_found_where_two_estimates_meet_the_same_peak(embedded):
    """Full fine-tuning of the embedded model at micro-batch 512 of 78 tokens, as a real CPU out-of-memory asked it:
    two of the search's estimates had the same peak, the line through them never reached the budget, and the
    search raised (OverflowError) where the explanation should have said how many blocks to checkpoint. The answer
    fits and one block fewer does not."""
    from litgpt.model import GPT, Block, Config

    from memfit.prediction.most_that_fits import Searcher, fewest_checkpointed
    from memfit.settings.budget import fits

    config = Config.from_file(embedded[0] / "model_config.yaml")
    script = ScriptStep(GPT, Block, config, None, load_script("finetune/full.py").train_step)
    plan = one_process_plan(micro_batch_size=512, accumulation=1, sequence_length=78, accelerator="cpu")
    budget = int(0.85 * 1.39 * 2**30)  # what the out-of-memory planned for, under a 1.5 GB address-space limit
    answer = fewest_checkpointed(Searcher(script, budget, "cpu"), plan)
    assert answer.value is not None and fits(answer.result.peak, budget, "cpu"), answer.line()
    assert answer.next_result is not None and not fits(answer.next_result.peak, budget, "cpu"), answer.line()


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_a_step_extrapolated_from_shallow_models_is_the_whole_depth_trace_to_the_byte(embedded, micro_batch_size):
    """The planner's and the reverse answers' estimates come from 2- and 3-block traces: on a 6-block model, for
    every number of checkpointed blocks, each phase's peak and roles equal a 6-block trace's. One exception, never
    under: a 4-bit layer's dequantized weight beside a checkpointed block's forward again in backward, which the
    shallow traces place as close to backward's peak as any of them has it (exact from 3 checkpointed blocks on; with
    2 of 6 at micro-batch 1 one weight's copy above the whole-depth trace)."""
    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.prediction.estimate import estimate
    from memfit.settings.run import ScriptStep

    config = Config.from_file(embedded[0] / "model_config.yaml", n_layer=6, lora_r=8, lora_query=True, lora_value=True)
    script = ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, load_script("finetune/lora.py").train_step)
    for count in range(7):
        plan = one_process_plan(
            micro_batch_size=micro_batch_size,
            accumulation=2,
            sequence_length=96,
            precision="bf16-true",
            quantize="bnb.nf4",
            blocks=6,
            activation_checkpointing=count,
        )
        fast = estimate(script, plan, whole_step=False, extrapolate=True)
        whole = estimate(script, plan, whole_step=False)
        assert not fast.timeline and whole.timeline  # the fast one did not trace the whole depth
        if fast.phases == whole.phases:
            continue
        assert count == 2, count  # the one setting the shallow traces place a copy above the whole-depth trace
        assert {k: v for k, v in fast.phases.items() if k != "backward"} == {
            k: v for k, v in whole.phases.items() if k != "backward"
        }
        with torch.device("meta"):
            blocks = GPT(config).transformer.h
        largest_copy = max(m.weight.numel() for m in blocks.modules() if type(m) is torch.nn.Linear) * 2  # bf16
        over = fast.phases["backward"]["peak"] - whole.phases["backward"]["peak"]
        assert 0 <= over <= largest_copy, (count, over, largest_copy)


@pytest.mark.slow
def test_the_readmes_what_fits_block_is_the_commands_output(tmp_path):
    """docs/estimate.md's "What fits on my card?" block, line for line, is what its command prints (the README shows
    the same command)."""
    import re
    import subprocess
    import sys

    from conftest import ROOT

    readme = (ROOT / "docs/estimate.md").read_text()
    section = readme.split("# What fits on my card?")[1].split("\n# ")[0]
    fenced = section.split("```")  # text, the command's block, text, the output's block, text
    command = fenced[1].removeprefix("bash").replace("\\\n", " ").split()
    block = fenced[3].strip().splitlines()
    assert command[:2] == ["python", "finetune/lora.py"]
    assert fenced[1].removeprefix("bash") in (ROOT / "README.md").read_text()  # the README's command is this one
    result = subprocess.run(
        [sys.executable, str(ROOT / command[1]), *command[2:]], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout.splitlines()
    # the picture's dir is named by a digest of the settings, the checkpoint's path among them: another directory,
    # another digest
    digest = re.compile(r"-estimate-(\S+)-[0-9a-f]{10}/")
    assert [digest.sub(r"-estimate-\1-DIGEST/", line) for line in printed[-len(block) :]] == [
        digest.sub(r"-estimate-\1-DIGEST/", line) for line in block
    ]
