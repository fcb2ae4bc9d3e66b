"""The learning-rate schedules are litgpt's: the fine-tuning scripts' against litgpt's own fine-tuning scheduler
(``litgpt.finetune.lora.get_lr_scheduler``), pretraining's against litgpt's pretraining loop over micro-batches
(``litgpt.pretrain.get_lr``), each on the learning rates a real run logged."""

import csv
import math
import warnings

import pytest
import torch

from conftest import lora_run, run_in_process, run_summary, tiny_train


def litgpt_finetune_lrs(peak: float, warmup: int, max_steps: int, steps: int) -> list[float]:
    """The learning rate of each optimizer step under litgpt's fine-tuning scheduler, stepped as litgpt's loop steps
    it (after each optimizer step)."""
    from litgpt.finetune.lora import get_lr_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    with warnings.catch_warnings():  # SequentialLR's epoch-argument deprecation, at the switch
        warnings.simplefilter("ignore")
        scheduler = get_lr_scheduler(optimizer, warmup_steps=warmup, max_steps=max_steps)
        lrs = []
        for _ in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return lrs


def litgpt_pretrain_lrs(
    peak: float, warmup_iters: int, max_iters: int, min_lr: float, accumulation: int, steps: int
) -> list[float]:
    """litgpt's pretraining loop: the learning rate set at each micro-batch iteration; an optimizer step uses the
    one set at its last micro-batch."""
    from litgpt.pretrain import get_lr

    lrs, iter_num = [], 0
    for _ in range(steps * accumulation):
        lr = get_lr(peak, iter_num, warmup_iters, max_iters, min_lr)
        iter_num += 1
        if iter_num % accumulation == 0:
            lrs.append(lr)
    return lrs


def memfit_lrs(scheduler, steps: int) -> list[float]:
    optimizer = scheduler.optimizer
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("warmup, max_steps", [(10, 100), (8, 24), (200, 948), (1, 2)])
def test_the_finetune_schedule_is_litgpts(warmup, max_steps):
    from memfit.training.optim import finetune_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-4)
    ours = memfit_lrs(finetune_schedule(optimizer, warmup, max_steps), max_steps)
    assert ours[0] == 0.0  # litgpt's first step has no learning rate
    assert ours == pytest.approx(litgpt_finetune_lrs(2e-4, warmup, max_steps, max_steps), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("warmup_iters, max_iters", [(20, 400), (2000, 24000), (4, 12)])
def test_the_pretrain_schedule_is_litgpts_loop_where_a_step_is_one_micro_batch(warmup_iters, max_iters):
    from memfit.training.optim import pretrain_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=4e-4)
    ours = memfit_lrs(pretrain_schedule(optimizer, warmup_iters, max_iters, 1, 4e-5), max_iters)
    assert ours == pytest.approx(litgpt_pretrain_lrs(4e-4, warmup_iters, max_iters, 4e-5, 1, max_iters), rel=1e-12)


@pytest.mark.parametrize("accumulation", [2, 4, 8])
def test_the_pretrain_schedule_is_litgpts_get_lr_at_each_steps_first_micro_batch_whatever_the_accumulation(
    accumulation,
):
    """With several micro-batches a step, each step takes litgpt's value at its first micro-batch, so the schedule is
    the same on any number of processes (FSDP's tests compare such runs); litgpt's loop steps with the value of the
    step's last micro-batch, at most one step's warm-up increment later."""
    from litgpt.pretrain import get_lr

    from memfit.training.optim import pretrain_schedule

    warmup_steps, steps = 5, 60
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=4e-4)
    ours = memfit_lrs(
        pretrain_schedule(optimizer, warmup_steps * accumulation, steps * accumulation, accumulation, 4e-5), steps
    )
    at_first_micro_batch = [
        get_lr(4e-4, s * accumulation, warmup_steps * accumulation, steps * accumulation, 4e-5) for s in range(steps)
    ]
    assert ours == pytest.approx(at_first_micro_batch, rel=1e-12)
    one_process = memfit_lrs(
        pretrain_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=4e-4), warmup_steps, steps, 1, 4e-5),
        steps,
    )
    assert ours == pytest.approx(one_process, rel=1e-12)
    theirs = litgpt_pretrain_lrs(4e-4, warmup_steps * accumulation, steps * accumulation, 4e-5, accumulation, steps)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 4e-4 / warmup_steps


def logged_lrs(cwd) -> list[float]:
    (metrics,) = (cwd / "out" / "profiles").glob("*/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("learning_rate")]
    return [float(r["learning_rate"]) for r in sorted(rows, key=lambda r: int(r["step"]))]


@pytest.mark.slow
def test_a_finetune_run_logs_litgpts_learning_rates_and_says_min_lr_is_unused(tmp_path, embedded):
    """LoRA for 8 steps with a 3-step warm-up and a hub file's min_lr: the logged learning rates are litgpt's
    fine-tuning schedule (from 0, cosine to 0), and the min_lr it does not use is named in a warning."""
    result = run_in_process(
        "finetune/lora.py",
        "--train.max_steps",
        "8",
        "--train.lr_warmup_steps",
        "3",
        "--train.lr",
        "1e-3",
        "--train.min_lr",
        "4e-5",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--train.min_lr 4e-05 is not used in fine-tuning" in result.stdout
    assert logged_lrs(tmp_path) == pytest.approx(litgpt_finetune_lrs(1e-3, 3, 8, 8), rel=1e-9, abs=1e-15)


@pytest.mark.slow
def test_a_pretraining_run_logs_litgpts_learning_rates_to_its_max_tokens_horizon(tmp_path, embedded):
    """Pretraining with max_tokens, one micro-batch a step: the steps are litgpt's (max_tokens over max_seq_length
    tokens a sample, not the block's max_seq_length + 1), and each step's learning rate is the one litgpt's loop sets,
    warm-up from 0 and a cosine to min_lr at the max_tokens horizon."""
    seq, micro, steps = 32, 4, 6
    max_tokens = seq * micro * steps
    result = run_in_process(
        "pretrain/pretrain.py",
        "--train.max_seq_length",
        str(seq),
        "--train.micro_batch_size",
        str(micro),
        "--train.global_batch_size",
        str(micro),
        "--train.max_tokens",
        str(max_tokens),
        "--train.max_steps",
        "null",
        "--train.lr_warmup_steps",
        "2",
        "--train.lr",
        "1e-3",
        "--train.min_lr",
        "1e-4",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
        "--eval.interval",
        "1000",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lrs = logged_lrs(tmp_path)
    assert len(lrs) == steps  # max_seq_length + 1 tokens a sample would stop at 5
    assert lrs == pytest.approx(litgpt_pretrain_lrs(1e-3, 2, steps, 1e-4, 1, steps), rel=1e-9)
    assert lrs[0] == 0.0 and math.isclose(lrs[1], 1e-3 / 2)


@pytest.mark.slow
def test_warmup_fraction_max_tokens_and_initial_validation_are_applied(tmp_path, embedded, capsys):
    """litgpt's meanings: max_tokens sets the horizon over full-length steps; lr_warmup_fraction is a fraction of an
    epoch (the embedded data's 1,800 training samples make 225 steps of 8), not of the run."""
    from litgpt.args import EvalArgs

    lora_run(
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


@pytest.mark.slow
def test_a_warm_up_as_long_as_the_run_is_pointed_out(tmp_path, embedded):
    """litgpt warns when lr_warmup_steps is not below max_steps; the run's first line says it (the scripts' own
    default warm-up of 8 steps with a short run is the common case)."""
    result = run_in_process(
        "finetune/lora.py", "--train.max_steps", "3", "--profile.enabled", "false", "--logger_name", "csv", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| 3 steps (225 an epoch, warm-up 8, the whole run: --train.lr is never reached)" in result.stdout
