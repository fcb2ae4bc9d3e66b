"""The training loop every script shares: accumulation, clipping, schedule, eval, logging, profiling, checkpoints.

A script builds its model (which parameters train is the method), then calls ``fit(run)``. Everything that would
otherwise be copied between ``finetune/*.py`` and ``pretrain/pretrain.py`` lives here once.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from memfit.args import EvalArgs, TrainArgs
from memfit.checkpoint import save_checkpoint
from memfit.ledger import Ledger, SavedActivations, complete_from_trace, role_sizes
from memfit.memory import PhaseMemory, fmt_bytes
from memfit.profiling import ProfileArgs, ProfilerWindow


def sft_loss(model, batch) -> torch.Tensor:
    """Next-token loss on an instruction batch; masked prompt tokens carry the label -100."""
    from litgpt.utils import chunked_cross_entropy

    input_ids, targets = batch["input_ids"], batch["labels"]
    logits = model(input_ids, lm_head_chunk_size=128)  # list of (B, <=128, vocab) chunks: no full (B, T, vocab) tensor
    logits[-1] = logits[-1][..., :-1, :]  # token t predicts t+1: drop the last position
    return chunked_cross_entropy(logits, targets[..., 1:])


def text_loss(model, batch) -> torch.Tensor:
    """Next-token loss on plain-text blocks: ``input_ids`` (B, T+1) gives inputs (B, T) and targets (B, T)."""
    from litgpt.utils import chunked_cross_entropy

    input_ids, targets = batch["input_ids"][:, :-1], batch["input_ids"][:, 1:]
    logits = model(input_ids, lm_head_chunk_size=128)
    return chunked_cross_entropy(logits, targets)


def sft_targets(batch) -> int:
    """Tokens an instruction batch's loss counts: the answers' (prompt and padding carry -100), shifted by one."""
    return int((batch["labels"][..., 1:] != -100).sum())


def text_targets(batch) -> int:
    return batch["input_ids"][:, 1:].numel()


def batch_tokens(batch) -> int:
    return batch["input_ids"].numel()


class TrainingDiverged(Exception):
    """A non-finite loss or gradient norm: the step is not taken and nothing more is saved."""


class Counters:
    """Progress that a checkpoint stores; ``load_state_dict`` makes Fabric restore it in place.

    A plain class on purpose: Fabric passes state through ``apply_to_collection``, which copies dataclasses, so a
    dataclass would be restored into a copy and the loop would go on counting from zero.
    """

    def __init__(self) -> None:
        self.step = self.iter_num = self.tokens = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "iter_num": self.iter_num, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.iter_num, self.tokens = state["step"], state["iter_num"], state["tokens"]


@dataclass
class CheckpointSpec:
    """What a method saves: litgpt's file name for it, which weights, and the run's hyperparameters."""

    weights_file: str
    keep: set[str] | None = None
    """State-dict names of the parameters to save (those that train, for LoRA and adapters); None: all"""
    hparams: dict = field(default_factory=dict)
    extra_files: list[Path] = field(default_factory=list)
    prompt_style: object = None
    """The data's prompt template (litgpt's PromptStyle), written as prompt_style.yaml; None for plain text"""


@dataclass
class Run:
    fabric: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    batches: object
    val_loader: object
    train: TrainArgs
    eval: EvalArgs
    accumulation: int
    max_steps: int
    loss_fn: Callable
    targets_fn: Callable
    """Counts the tokens a batch's loss averages over, so a step's loss weighs every target token equally"""
    out_dir: Path
    run_dir: Path
    profile: ProfileArgs
    memory: PhaseMemory
    checkpoint: CheckpointSpec
    counters: Counters = field(default_factory=Counters)
    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    tokens_trained: int = 0
    trace_files: list[Path] = field(default_factory=list)
    snapshot: Path | None = None
    last_checkpoint: Path | None = None
    ledger: Ledger | None = None
    picture: dict | None = None
    """What the memory picture of the profiled step states (its PNG, peak and phase), once drawn"""
    max_tokens: int | None = None
    grad_norms: list[float] = field(default_factory=list)
    tokenizer: object = None
    sample_prompt: torch.Tensor | None = None
    """Encoded prompt of the validation sample generated from after each validation (--eval.max_new_tokens)"""
    samples: list[str] = field(default_factory=list)

    def training_state(self) -> dict:
        state = {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "counters": self.counters,
            "data": self.batches,
            "rng": torch.get_rng_state(),
        }
        device = self.fabric.device
        if device.type == "cuda":  # dropout (LoRA's too) on the GPU draws from the device's own generator
            state["cuda_rng"] = torch.cuda.get_rng_state(device)
        return state

    def restore_rng(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.fabric.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.fabric.device)


def save(run: Run, name: str) -> Path:
    run.last_checkpoint = save_checkpoint(
        run.fabric,
        run.out_dir,
        name,
        run.checkpoint.weights_file,
        run.model,
        run.training_state(),
        run.checkpoint.hparams,
        (lambda key, _value: key in run.checkpoint.keep) if run.checkpoint.keep is not None else None,
        run.checkpoint.extra_files,
        run.checkpoint.prompt_style,
    )
    return run.last_checkpoint


def accumulate(run: Run) -> tuple[float, int]:
    """Forward and backward over ``accumulation`` micro-batches; gradients sum to those of one big batch.

    Each micro-batch's mean loss is weighed by its share of the step's target tokens (over all ranks), so every
    target token counts equally however the prompts, masks and padding split them (as torchtune normalises).
    Returns the step's loss per target token and the tokens it read.
    """
    fabric, model, memory = run.fabric, run.model, run.memory
    micro_batches = [next(run.batches) for _ in range(run.accumulation)]
    counts = [run.targets_fn(batch) for batch in micro_batches]
    step_targets = sum(counts)
    if fabric.world_size > 1:
        step_targets = int(fabric.all_reduce(torch.tensor(float(step_targets), device=fabric.device), reduce_op="sum"))
    # DDP and FSDP average gradients over ranks, hence the world size: the result is the sum over all target
    # tokens divided by their number.
    scale = fabric.world_size / max(step_targets, 1)
    loss_sum, tokens = torch.zeros((), device=fabric.device), 0
    for micro, batch in enumerate(micro_batches):
        accumulating = micro < run.accumulation - 1
        # Skips the gradient all-reduce on all but the last micro-batch (a no-op on one process).
        with fabric.no_backward_sync(model, enabled=accumulating):
            ledger_step = memory.roles is not None
            with memory.phase("forward"), (SavedActivations(model) if ledger_step else nullcontext()) as saved:
                loss = run.loss_fn(model, batch)  # the mean over this micro-batch's target tokens
                memory.activations = saved.bytes if ledger_step else 0
            if ledger_step:
                run.ledger.activations = max(run.ledger.activations, saved.bytes)
                run.ledger.sequence_length = max(run.ledger.sequence_length, batch["input_ids"].shape[1])
            with memory.phase("backward"):
                fabric.backward(loss * (counts[micro] * scale))
        loss_sum += loss.detach().float() * counts[micro]
        tokens += batch_tokens(batch)
    return (loss_sum / max(sum(counts), 1)).item(), tokens


def grad_norm(run: Run) -> torch.Tensor:
    """The total gradient norm (clipping computes it anyway; otherwise it is computed here, to catch inf/NaN)."""
    if run.train.max_norm:
        return run.fabric.clip_gradients(run.model, run.optimizer, max_norm=run.train.max_norm)
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    if not grads:  # stepped inside backward (--optimizer_in_backward): the gradients are already gone
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads)


def optimizer_step(run: Run, loss: float) -> None:
    with run.memory.phase("optimizer_step"):
        norm = grad_norm(run)
        check_finite(run, loss, norm)
        run.optimizer.step()
    run.grad_norms.append(float(norm))
    with run.memory.phase("zero_grad"):
        run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()


def check_finite(run: Run, loss: float, norm: torch.Tensor) -> None:
    """Stops before a non-finite loss or gradient reaches the weights or a checkpoint."""
    bad = torch.tensor(0.0 if math.isfinite(loss) and bool(torch.isfinite(norm)) else 1.0, device=run.fabric.device)
    if run.fabric.world_size > 1:  # every rank stops together
        bad = run.fabric.all_reduce(bad, reduce_op="sum")
    if not bad:
        return
    step = run.counters.step + 1
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {float(norm)}"
    broken = first_nonfinite(run.model)
    if broken:
        cause = f"the weights hold inf/NaN ({broken}): check the checkpoint"
    elif step == 1:
        cause = "the first step diverged: check the data and --precision (16-true overflows easily: try bf16-true)"
    else:
        cause = (f"likely --train.lr {run.train.lr} is too high (try a tenth of it) or --precision 16-true overflowed"
                 " (try bf16-true); --train.max_norm 1.0 clips gradient spikes")
    raise TrainingDiverged(f"non-finite {what} at step {step}: {cause}")


def first_nonfinite(model: torch.nn.Module) -> str | None:
    model = getattr(model, "module", model)  # names as the checkpoint spells them, not Fabric's wrapper's
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
            return name
    return None


@torch.no_grad()
def validate(fabric, model, val_loader, loss_fn, max_iters: int) -> float:
    model.eval()
    losses = []
    for k, batch in enumerate(val_loader):
        if k >= max_iters:
            break
        losses.append(loss_fn(model, batch).float())
    model.train()
    loss = torch.stack(losses).mean() if losses else torch.tensor(float("nan"))
    return fabric.all_reduce(loss.to(fabric.device), reduce_op="mean").item()


def sample_prompt(data, tokenizer, evaluate_example, seed: int) -> torch.Tensor:
    """The prompt litgpt's scripts generate from: a validation record in the data's prompt template (instruction
    data), or the start of a validation block (plain text). ``evaluate_example``: first, random, or an index."""
    dataset = data.val_dataloader().dataset
    count = len(dataset)
    index = {"first": 0, "random": int(torch.randint(count, (1,), generator=torch.Generator().manual_seed(seed)))}.get(
        evaluate_example, evaluate_example)
    index = min(int(index), count - 1)
    records = getattr(dataset, "data", None)
    if records is not None and getattr(data, "prompt_style", None) is not None:
        record = records[index]
        return tokenizer.encode(data.prompt_style.apply(prompt=record["instruction"], **record))
    return dataset[index]["input_ids"][:16]


def generate_sample(run: Run) -> None:
    """Generates ``--eval.max_new_tokens`` tokens from the sample prompt and prints them, as litgpt's scripts do.

    Sampling draws random numbers: it runs on a forked RNG, so a run with samples trains exactly as one without.
    """
    if run.sample_prompt is None or not run.eval.max_new_tokens:
        return
    from litgpt.generate.base import generate  # litgpt's sampler, imported only by runs that generate

    fabric, model, prompt = run.fabric, run.model, run.sample_prompt.to(run.fabric.device)
    max_returned_tokens = len(prompt) + run.eval.max_new_tokens
    if max_returned_tokens > model.max_seq_length:
        fabric.print(f"Sample skipped: {len(prompt)} prompt + {run.eval.max_new_tokens} new tokens exceed the model's"
                     f" max_seq_length {model.max_seq_length} (the longest training sample)")
        return
    devices = [fabric.device] if fabric.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        with fabric.init_tensor():
            model.set_kv_cache(batch_size=1)
        output = generate(model, prompt, max_returned_tokens, temperature=0.8, eos_id=run.tokenizer.eos_id)
        model.clear_kv_cache()
        model.train()
    text = run.tokenizer.decode(output[len(prompt):])
    run.samples.append(text)
    fabric.print(f"Sample after step {run.counters.step}: {text!r}")


def fit(run: Run) -> Run:
    fabric, counters, train = run.fabric, run.counters, run.train
    window = ProfilerWindow(run.profile, run.run_dir, fabric.device, run.max_steps - counters.step, fabric.global_rank)
    progress = tqdm(
        total=run.max_steps, initial=counters.step, desc="train", unit="step",
        disable=fabric.global_rank != 0, dynamic_ncols=True, mininterval=0.5,
    )
    start = time.perf_counter()
    tokens_at_start = counters.tokens
    measures = "CUDA allocated" if fabric.device.type == "cuda" else "CPU tensor memory from profiler events"
    run.ledger = Ledger(device=fabric.device.type, measures=measures, load_peak=run.memory.peaks.get("load", 0))
    run.memory.ledger = run.ledger
    with window, progress:  # the bar closes on any exit, so an error line is not followed by a stale bar
        while counters.step < run.max_steps and (run.max_tokens is None or counters.tokens < run.max_tokens):
            t0 = time.perf_counter()
            if window.recording:  # this step is the ledger's: note what is alive before it starts
                run.ledger.baseline_total = sum(role_sizes(run.model, run.optimizer).values())
                run.memory.roles = lambda: role_sizes(run.model, run.optimizer)
            loss, tokens = accumulate(run)
            optimizer_step(run, loss)
            run.memory.roles = None
            window.step()
            counters.step += 1
            counters.iter_num += run.accumulation
            counters.tokens += tokens * fabric.world_size
            dt = time.perf_counter() - t0
            run.losses.append(loss)
            if counters.step % train.log_interval == 0 or counters.step == run.max_steps:
                log_step(run, loss, tokens * fabric.world_size / dt, progress)
            if run.val_loader is not None and counters.step % run.eval.interval == 0 and counters.step < run.max_steps:
                val = validate(fabric, run.model, run.val_loader, run.loss_fn, run.eval.max_iters)
                run.val_losses.append(val)
                generate_sample(run)
                fabric.log_dict({"val_loss": val, "val_ppl": math.exp(min(val, 50))}, step=counters.step)
            if train.save_interval and counters.step % train.save_interval == 0 and counters.step < run.max_steps:
                save(run, f"step-{counters.step:06d}")
            progress.update(1)
    run.train_seconds = time.perf_counter() - start
    run.tokens_trained = counters.tokens - tokens_at_start
    run.trace_files = window.trace_files()
    run.snapshot = window.snapshot_path
    return run


def complete_ledger(run: Run) -> None:
    """Adds what only the profiler trace knows to the ledger (optional work: call it after the final save)."""
    own_trace = [t for t in run.trace_files if t.name.startswith(f"rank{run.fabric.global_rank}.")]
    if own_trace and run.ledger is not None and run.ledger.phases:
        complete_from_trace(run.ledger, own_trace[-1])


def log_step(run: Run, loss: float, tokens_per_s: float, progress) -> None:
    memory = run.memory
    step_peak = max(memory.last.values(), default=0)
    metrics = {
        "loss": loss,
        "learning_rate": run.optimizer.param_groups[0]["lr"],
        "grad_norm": run.grad_norms[-1],
        "tokens_per_s": tokens_per_s,
        "epoch": run.batches.epoch,
        "memory/step_peak_gib": step_peak / 2**30,
        **memory.probe.scalars(),
    }
    run.fabric.log_dict(metrics, step=run.counters.step)
    progress.set_postfix_str(f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | peak {fmt_bytes(step_peak)}", refresh=False)
