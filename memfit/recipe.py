"""The part of every script after its flags: build and load the model, fit, validate, save, summarise.

A script describes its method with a ``Method`` (litgpt model class, config, which parameters train, litgpt's
checkpoint file name) and launches ``main`` with Fabric. Everything below is shared, so a new method is a short
new script, not a copy.
"""

from __future__ import annotations

import errno
import json
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import lightning as L
import matplotlib.image as plt_image
import torch

from memfit.checkpoint import OutDirLock, latest_checkpoint, remove_earlier_run, resume
from memfit.data import PlainText, build_dataloaders, embedded_data
from memfit.loading import apply_activation_checkpointing, load_model
from memfit.loop import (
    CheckpointSpec, Run, TrainingDiverged, complete_ledger, fit, generate_sample, sample_prompt, save, sft_loss,
    sft_targets, validate,
)
from memfit.memory import MemoryProbe, PhaseMemory, fmt_bytes
from memfit.optim import OptimizerInBackward, make_optimizer, warmup_cosine
from memfit.settings import Settings
from memfit.picture import draw_step, step_timeline
from memfit.planner import explain_oom, report_estimate
from memfit.profiling import ProfilerWindow, read_trace_events
from memfit.strategy import make_fabric

# what litgpt copies into its own checkpoints, so its tools (and Hugging Face conversion) find them
_CONFIG_FILES = ("model_config.yaml", "config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                 "tokenizer_config.json")


@dataclass
class Method:
    """What a script contributes: its model, which parameters train, and how its checkpoint is named."""

    model_class: type
    block_class: type
    config: object
    weights_file: str
    """litgpt's file name for this method's checkpoint, so litgpt's tools read it"""
    mark_trainable: Callable | None = None
    """Freezes all but the method's parameters; None: every parameter trains"""
    from_scratch: bool = False
    """Initialise the weights instead of loading them (pretraining)"""
    prepare: Callable | None = None
    """Called on the loaded model before Fabric wraps it (a method's workarounds)"""
    loss_fn: Callable = sft_loss
    targets_fn: Callable = sft_targets
    """Counts the target tokens of a batch (what ``loss_fn`` averages over)"""
    new_parameters: tuple[str, ...] = ()
    """Names of the parameters the method adds (``lora_A``): the only ones a base checkpoint may lack"""

    def embedded_data(self, settings: Settings):
        if self.from_scratch:
            return PlainText(path=settings.embedded_json.with_name("corpus.txt"))
        return embedded_data(settings.embedded_json)


def model_config(settings: Settings, config_class: type, **method_options):
    """The model's litgpt config, from --model_name or the checkpoint dir, with the method's options."""
    if settings.model_name is not None:
        return config_class.from_name(settings.model_name, **method_options)
    return config_class.from_file(settings.checkpoint_dir / "model_config.yaml", **method_options)


def build_model(fabric: L.Fabric, settings: Settings, method: Method) -> torch.nn.Module:
    # FSDP shards from CPU memory: loading each rank's full copy onto its GPU first would defeat it.
    device = torch.device("cpu") if settings.strategy == "fsdp" else fabric.device
    weights = None if method.from_scratch else settings.checkpoint_dir / "lit_model.pth"
    model = load_model(
        method.model_class, method.config, weights, dtype=settings.dtype, device=device, quantize=settings.quantize,
        new_parameters=method.new_parameters,
    )
    if method.mark_trainable is not None:
        method.mark_trainable(model)
    if method.prepare is not None:
        method.prepare(model)
    if settings.activation_checkpointing and settings.strategy != "fsdp":  # FSDP applies its own policy
        apply_activation_checkpointing(model, method.block_class)
    return model


def make_optimizers(fabric: L.Fabric, settings: Settings, model: torch.nn.Module):
    lr, decay = settings.train.lr, settings.train.weight_decay
    if settings.optimizer_in_backward:
        return OptimizerInBackward(settings.optimizer, model.parameters(), lr, decay, fabric.device,
                                   **settings.optimizer_args)
    return fabric.setup_optimizers(
        make_optimizer(settings.optimizer, model.parameters(), lr, decay, fabric.device, **settings.optimizer_args)
    )


def run(settings: Settings, method: Method):
    """What a script ends with: predict (--estimate), or build Fabric and launch ``main`` on every process.

    Returns the ``Estimate``, or the ``Run`` (on a single process), so a caller in Python can inspect either.
    """
    if settings.estimate:
        return report_estimate(settings, method, settings.memory_budget)
    fabric = make_fabric(settings, method.block_class)
    return fabric.launch(main, settings, method)


def main(fabric: L.Fabric, settings: Settings, method: Method) -> Run:
    # One run per --out_dir at a time; rank 0 speaks for the job.
    with OutDirLock(settings.out_dir) if fabric.global_rank == 0 else nullcontext():
        if settings.overwrite and fabric.global_rank == 0:
            remove_earlier_run(settings.out_dir)
        memory = PhaseMemory(MemoryProbe(fabric.device))
        try:
            return _prepare_and_fit(fabric, settings, method, memory)
        except torch.OutOfMemoryError as error:
            # Not a traceback: where it ran out, what held the memory, and which settings would fit.
            explain_oom(fabric, settings, method, memory, error, memory.run)
            raise SystemExit(3) from None
        except TrainingDiverged as error:
            latest = latest_checkpoint(settings.out_dir)
            print(f"error: {error}\nNothing was saved for that step; the latest checkpoint is"
                  f" {latest if latest else 'none'}.", file=sys.stderr)
            raise SystemExit(4) from None
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                raise
            latest = latest_checkpoint(settings.out_dir)
            print(f"error: could not write {error.filename or settings.out_dir}: {error.strerror}; free space (or fix"
                  " the permissions) and continue with --resume true"
                  + (f" from {latest}" if latest else ", or start again with --overwrite true"), file=sys.stderr)
            raise SystemExit(1) from None
        except KeyboardInterrupt:
            step = memory.run.counters.step if memory.run is not None else 0
            latest = latest_checkpoint(settings.out_dir)
            where = (f"continue from {latest} with --resume true" if latest
                     else "no checkpoint was written yet; start again with --overwrite true")
            print(f"\nInterrupted after step {step}: nothing partial was saved; {where}.", file=sys.stderr)
            raise SystemExit(130) from None


def _prepare_and_fit(fabric: L.Fabric, settings: Settings, method: Method, memory: PhaseMemory) -> Run:
    from litgpt.tokenizer import Tokenizer

    fabric.seed_everything(settings.seed)
    train = settings.train
    data = settings.data if settings.data is not None else method.embedded_data(settings)
    block_size = method.config.block_size
    # Samples longer than the model's context are truncated to it, as the model could not take them.
    max_seq_length = min(train.max_seq_length or block_size, block_size)
    tokenizer = Tokenizer(settings.checkpoint_dir)
    batches, val_loader, longest_train, longest = build_dataloaders(
        fabric, data, tokenizer, train.micro_batch_size, max_seq_length, settings.seed, method.targets_fn
    )
    prompt = None
    if settings.eval.max_new_tokens and val_loader is not None:
        prompt = sample_prompt(data, tokenizer, settings.eval.evaluate_example, settings.seed)
    steps_per_epoch = max(1, len(batches.loader) // settings.accumulation)
    max_steps = min(train.max_steps or math.inf, (train.epochs or math.inf) * steps_per_epoch)
    if train.max_tokens:
        # as litgpt: the horizon assumes full-length samples; the loop also stops once max_tokens were read
        max_steps = min(max_steps, max(1, train.max_tokens // (train.global_batch_size * longest_train)))
    if settings.profile.enabled:  # a resumed run restores the position its first part used (the data state)
        # The longest sample goes into the last micro-batch of the profiled step: the first step with optimizer
        # state, with gradients accumulating, so the step the ledger explains is the run's peak.
        wait, warmup, _ = ProfilerWindow.schedule(settings.profile, int(max_steps))
        micro_batch = (wait + warmup) * settings.accumulation + settings.accumulation - 1
        batches.sampler.longest_position = micro_batch * train.micro_batch_size
    prompt_style = getattr(data, "prompt_style", None)
    run = _load_and_fit(fabric, settings, method, memory, batches, val_loader, longest, longest_train,
                        int(max_steps), prompt_style, tokenizer, prompt)
    return run


def _load_and_fit(
    fabric, settings, method, memory, batches, val_loader, longest, longest_train, max_steps, prompt_style, tokenizer,
    prompt,
) -> Run:
    train, block_size = settings.train, method.config.block_size
    with memory.phase("load"):
        model = build_model(fabric, settings, method)
        # names as the state dict spells them; computed before wrapping, which renames parameters
        keep = None
        if method.mark_trainable is not None:
            keep = {k for k, v in model.state_dict(keep_vars=True).items() if getattr(v, "requires_grad", False)}
        # rope cache for the longest sample only (less memory than block_size); text blocks carry one extra target
        model.max_seq_length = min(longest, block_size)
        model = fabric.setup_module(model)
        optimizer = make_optimizers(fabric, settings, model)
    warmup_steps = train.lr_warmup_steps or 0
    if train.lr_warmup_fraction:
        warmup_steps = round(train.lr_warmup_fraction * max_steps)
    scheduler = warmup_cosine(optimizer, warmup_steps, max_steps, train.min_lr)

    run = Run(
        fabric=fabric, model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
        val_loader=val_loader, train=train, eval=settings.eval, accumulation=settings.accumulation,
        max_steps=max_steps, loss_fn=method.loss_fn, targets_fn=method.targets_fn, out_dir=settings.out_dir,
        run_dir=settings.run_dir, profile=settings.profile, memory=memory, max_tokens=train.max_tokens,
        tokenizer=tokenizer, sample_prompt=prompt,
        checkpoint=CheckpointSpec(
            weights_file=method.weights_file,
            keep=keep,
            hparams=settings.hparams,
            # the base model's config and tokenizer travel with each checkpoint, as in litgpt
            extra_files=[settings.checkpoint_dir / name for name in _CONFIG_FILES],
            prompt_style=prompt_style,
        ),
    )
    if settings.resume:
        state = run.training_state()
        resume_from = resume(fabric, settings.out_dir, method.weights_file, model, state)
        run.restore_rng(state)
        fabric.print(f"Resumed from {resume_from} at step {run.counters.step}")

    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    fabric.print(
        f"{settings.script}: {n_trainable:,} trainable / {n_frozen:,} frozen parameters | precision"
        f" {settings.precision}{' + ' + settings.quantize if settings.quantize else ''} | {fabric.world_size}"
        f" process(es) x {settings.accumulation} micro-batch(es) of {train.micro_batch_size} per step | up to"
        f" {train.global_batch_size * longest_train:,} tokens per step (longest sample {longest_train}, at step"
        f" {batches.sampler.longest_position // (train.micro_batch_size * settings.accumulation) + 1})"
        f" | {run.max_steps} steps"
    )
    memory.run = run
    if run.val_loader is not None and settings.eval.initial_validation and run.counters.step == 0:
        val = validate(fabric, model, run.val_loader, method.loss_fn, settings.eval.max_iters)
        fabric.print(f"Initial validation: loss {val:.3f}")
        fabric.log_dict({"val_loss": val, "val_ppl": math.exp(min(val, 50))}, step=0)
    fit(run)
    if run.val_loader is not None and settings.eval.final_validation:
        run.val_losses.append(validate(fabric, model, run.val_loader, method.loss_fn, settings.eval.max_iters))
        generate_sample(run)
    save(run, "final")
    # The run is saved. What follows is optional: a failure in it is a warning, never a lost run.
    optional(fabric, "complete the ledger from the profiler trace", complete_ledger, run)
    optional(fabric, "publish the memory ledger", publish_ledger, run, settings)
    optional(fabric, "draw the memory picture", publish_picture, run, settings)
    read_trace_events.cache_clear()  # both readers are done: the parsed trace can be hundreds of MB
    for logger in fabric.loggers:
        # Fabric leaves flushing to us; the CSV logger would otherwise lose its rows
        optional(fabric, "flush the logger", logger.finalize, "success")
    if fabric.global_rank == 0:
        optional(fabric, "write the run summary", write_summary, run, settings)
    return run


def optional(fabric: L.Fabric, what: str, function: Callable, *args) -> None:
    """Runs work that must not cost a finished run: an error in it is reported in one line and swallowed."""
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001  (any failure here is optional work failing)
        first_line = (str(error).splitlines() or [""])[0][:200]
        fabric.print(f"warning: could not {what} ({type(error).__name__}: {first_line}); the checkpoint is saved")


def publish_ledger(run: Run, settings: Settings) -> None:
    """The ledger as JSON in the run dir, as TensorBoard scalars and a text panel, and as a table on stdout."""
    ledger = run.ledger
    if ledger is None or not ledger.phases or run.fabric.global_rank != 0:
        return
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "ledger.json").write_text(json.dumps(ledger.as_dict(), indent=2))
    scalars = {
        f"ledger/{phase}/{role}_gib": size / 2**30
        for phase in ledger.phases for role, size in ledger.breakdown(phase).items()
    }
    run.fabric.log_dict(scalars, step=run.counters.step)
    table = ledger.table()
    for logger in run.fabric.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            experiment.add_text("memory_ledger", f"<pre>{table}</pre>", global_step=run.counters.step)
    print("\n" + table)


def publish_picture(run: Run, settings: Settings) -> None:
    """The profiled step's memory as a PNG in the run dir and in TensorBoard's Images tab (both work offline)."""
    own_trace = [t for t in run.trace_files if t.name.startswith(f"rank{run.fabric.global_rank}.")]
    if not own_trace or run.ledger is None or run.fabric.global_rank != 0:
        return
    cuda = run.fabric.device.type == "cuda"
    # CPU traces count from the profiler's start: what was alive before the step is added; CUDA totals are absolute
    timeline = step_timeline(own_trace[-1], 1 if cuda else 0, 0 if cuda else run.ledger.baseline_total)
    title = f"{settings.run_name}: one optimizer step ({run.ledger.measures})"
    run.picture = draw_step(timeline, title, settings.run_dir / "memory_step.png")
    image = plt_image.imread(run.picture["png"])[..., :3]  # (H, W, RGB)
    for logger in run.fabric.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_image"):
            experiment.add_image("memory_step", image, global_step=run.counters.step, dataformats="HWC")


def summary_dict(run: Run, settings: Settings) -> dict:
    losses = run.losses
    return {
        "script": settings.script,
        "run": settings.run_name,
        "world_size": run.fabric.world_size,
        "steps": run.counters.step,
        "tokens_per_s": run.tokens_trained / run.train_seconds if run.train_seconds else 0.0,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "val_loss": run.val_losses[-1] if run.val_losses else None,
        "memory": run.memory.as_dict(),
        "ledger_peak_bytes": max((r.peak for r in run.ledger.phases.values()), default=None) if run.ledger else None,
        "profile_traces": [str(p) for p in run.trace_files],
        "memory_snapshot": str(run.snapshot) if run.snapshot else None,
        "memory_picture": run.picture,
        "checkpoint": str(run.last_checkpoint) if run.last_checkpoint else None,
    }


def write_summary(run: Run, settings: Settings) -> None:
    summary = summary_dict(run, settings)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    measured = "CUDA allocated" if summary["memory"]["measures"] == "cuda_allocated" else "process RSS"
    peaks = summary["memory"]["peak_bytes"]
    phases = ("load", "forward", "backward", "optimizer_step")
    lines = [
        "",
        f"Done: {summary['steps']} steps, {summary['tokens_per_s']:,.0f} tokens/s,"
        f" loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
        + (f" (val {summary['val_loss']:.3f})" if summary["val_loss"] is not None else ""),
        f"Peak memory by phase ({measured}): "
        + ", ".join(f"{phase} {fmt_bytes(peaks[phase])}" for phase in phases if phase in peaks),
        f"Profile:    {settings.run_dir}  (tensorboard --logdir {settings.profile_dir}, PyTorch Profiler tab)",
    ]
    if run.picture:
        lines.append(f"Picture:    {run.picture['png']}  (offline; also in TensorBoard's Images tab)")
    if run.snapshot:
        lines.append(f"Snapshot:   {run.snapshot}  (open at pytorch.org/memory_viz)")
    lines.append(f"Checkpoint: {run.last_checkpoint}")
    print("\n".join(lines))
