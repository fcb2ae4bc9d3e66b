"""What every script does around its method: inputs, Fabric, loading, resume, fit, save and the summary.

A script's ``setup()`` declares its typed flags and hands them over with ``Settings.from_setup(locals())``;
its ``main()`` says how to build the model and which parameters train, and calls ``train()``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch

from memfit.args import EvalArgs, TrainArgs, check_batch_sizes
from memfit.checkpoint import latest_checkpoint, load_checkpoint
from memfit.cli import UserError
from memfit.data import build_dataloaders, embedded_data
from memfit.embedded import ensure_embedded
from memfit.loop import CheckpointSpec, Run, fit, save
from memfit.memory import MemoryProbe, PhaseMemory, fmt_bytes
from memfit.optim import make_optimizer, warmup_cosine
from memfit.precision import check_combination, compute_dtype, default_precision, fabric_precision, resolve_accelerator
from memfit.profiling import ProfileArgs


_CONFIG_FILES = ("model_config.yaml", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


@dataclass
class Settings:
    """The flags every script has, resolved (accelerator, precision, embedded default) and validated."""

    script: str
    checkpoint_dir: Path | None
    out_dir: Path
    precision: str | None
    quantize: str | None
    accelerator: str
    devices: int
    num_nodes: int
    data: Any
    train: TrainArgs
    eval: EvalArgs
    optimizer: str
    logger_name: str
    profile: ProfileArgs
    profile_dir: Path
    resume: bool
    seed: int
    hparams: dict
    embedded: bool = False
    run_name: str = ""

    @classmethod
    def from_setup(cls, setup_locals: dict, script: str) -> "Settings":
        names = {f.name for f in dataclasses.fields(cls)} - {"script", "hparams", "embedded", "run_name"}
        settings = cls(script=script, hparams=dict(setup_locals), **{k: setup_locals[k] for k in names})
        settings.resolve()
        return settings

    def resolve(self) -> None:
        """Checks every input before anything is written; fills in the embedded default."""
        self.accelerator = resolve_accelerator(self.accelerator)
        self.precision = self.precision or default_precision(self.accelerator)
        check_combination(self.precision, self.quantize)
        if self.precision == "16-mixed" and self.accelerator == "cpu":
            raise UserError("--precision 16-mixed needs a GPU; on CPU use bf16-mixed or bf16-true")
        if self.devices < 1 or self.num_nodes < 1:
            raise UserError(f"--devices {self.devices} / --num_nodes {self.num_nodes}: both must be at least 1")
        if self.quantize and self.devices * self.num_nodes > 1:
            raise UserError("--quantize works on one device; set --devices 1 (or drop --quantize and use FSDP)")
        self.accumulation = check_batch_sizes(self.train, self.devices * self.num_nodes)
        if self.checkpoint_dir is None:
            self.embedded = True
            self.checkpoint_dir, json_path = ensure_embedded()
            if self.data is None:
                self.data = embedded_data(json_path)
        else:
            self.checkpoint_dir = Path(self.checkpoint_dir)
            if not (self.checkpoint_dir / "model_config.yaml").is_file():
                raise UserError(
                    f"--checkpoint_dir {str(self.checkpoint_dir)!r} has no model_config.yaml; give a litgpt"
                    " checkpoint dir (as `litgpt download` makes it)"
                )
            if self.data is None:
                raise UserError("with --checkpoint_dir, also give the data, e.g. --data JSON --data.json_path FILE")
        if self.resume and latest_checkpoint(self.out_dir) is None:
            raise UserError(f"--resume: no step-* checkpoint in --out_dir {str(self.out_dir)!r}")
        model_name = self.checkpoint_dir.name if not self.embedded else "embedded"
        self.run_name = f"{self.script}-{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"

    @property
    def run_dir(self) -> Path:
        return self.profile_dir / self.run_name

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)


def make_fabric(settings: Settings, strategy: Any = "auto") -> L.Fabric:
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    # Scalars land beside the profiler trace, so one `tensorboard --logdir profiles` shows both for a run.
    logger_class = TensorBoardLogger if settings.logger_name == "tensorboard" else CSVLogger
    logger = logger_class(root_dir=str(settings.run_dir), name="", version="")
    return L.Fabric(
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=strategy,
        loggers=logger,
        **fabric_precision(settings.precision, settings.quantize, settings.accelerator),
    )


def train(
    fabric: L.Fabric,
    settings: Settings,
    block_size: int,
    build_model: Callable[[], torch.nn.Module],
    checkpoint: CheckpointSpec,
    loss_fn: Callable,
) -> Run:
    from litgpt.tokenizer import Tokenizer

    fabric.seed_everything(settings.seed)
    train_args = settings.train
    tokenizer = Tokenizer(settings.checkpoint_dir)
    # Samples longer than the model's context are truncated to it, as the model could not take them.
    max_seq_length = min(train_args.max_seq_length or block_size, block_size)
    batches, val_loader, longest_train, longest = build_dataloaders(
        fabric, settings.data, tokenizer, train_args.micro_batch_size, max_seq_length, settings.seed
    )
    steps_per_epoch = max(1, len(batches.loader) // settings.accumulation)
    max_steps = min(train_args.max_steps or float("inf"), (train_args.epochs or float("inf")) * steps_per_epoch)

    memory = PhaseMemory(MemoryProbe(fabric.device))
    with memory.phase("load"):
        model = build_model()
        model.max_seq_length = longest  # rope cache for the longest sample only: less memory than block_size
        model = fabric.setup_module(model)
        optimizer = make_optimizer(
            settings.optimizer, model.parameters(), train_args.lr, train_args.weight_decay, fabric.device
        )
        optimizer = fabric.setup_optimizers(optimizer)
    scheduler = warmup_cosine(optimizer, train_args.lr_warmup_steps or 0, int(max_steps), train_args.min_lr)

    run = Run(
        fabric=fabric, model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
        val_loader=val_loader, train=train_args, eval=settings.eval, accumulation=settings.accumulation,
        max_steps=int(max_steps), loss_fn=loss_fn, out_dir=settings.out_dir, run_dir=settings.run_dir,
        profile=settings.profile, memory=memory,
        checkpoint=dataclasses.replace(
            checkpoint,
            hparams=settings.hparams,
            # the base model's config and tokenizer travel with each checkpoint, as in litgpt
            extra_files=[settings.checkpoint_dir / name for name in _CONFIG_FILES],
        ),
    )
    if settings.resume:
        resumed_from = latest_checkpoint(settings.out_dir)
        state = run.training_state()
        load_checkpoint(fabric, resumed_from, checkpoint.weights_file, model, state)
        torch.set_rng_state(state["rng"])
        fabric.print(f"Resumed from {resumed_from} at step {run.counters.step}")

    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    tokens_per_step = train_args.global_batch_size * longest_train
    fabric.print(
        f"{settings.script}: {n_trainable:,} trainable / {n_frozen:,} frozen parameters | precision"
        f" {settings.precision}{' + ' + settings.quantize if settings.quantize else ''} | {settings.accumulation}"
        f" micro-batch(es) of {train_args.micro_batch_size} per step | up to {tokens_per_step:,} tokens per step"
        f" (longest sample {longest_train}, first) | {run.max_steps} steps"
    )
    fabric.barrier()
    fit(run)
    if run.val_loader is not None and settings.eval.final_validation:
        from memfit.loop import validate

        run.val_losses.append(
            validate(fabric, model, run.val_loader, loss_fn, settings.eval.max_iters)
        )
    save(run, "final")
    for logger in fabric.loggers:
        logger.finalize("success")  # Fabric leaves flushing to us; the CSV logger would otherwise lose its rows
    if fabric.global_rank == 0:
        write_summary(run, settings)
    return run


def summary_dict(run: Run, settings: Settings) -> dict:
    losses = run.losses
    return {
        "script": settings.script,
        "run": settings.run_name,
        "steps": run.counters.step,
        "tokens_per_s": run.tokens_trained / run.train_seconds if run.train_seconds else 0.0,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "val_loss": run.val_losses[-1] if run.val_losses else None,
        "memory": run.memory.as_dict(),
        "profile_traces": [str(p) for p in run.trace_files],
        "memory_snapshot": str(run.snapshot) if run.snapshot else None,
        "checkpoint": str(run.last_checkpoint) if run.last_checkpoint else None,
    }


def write_summary(run: Run, settings: Settings) -> None:
    summary = summary_dict(run, settings)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    measured = "CUDA allocated" if summary["memory"]["measures"] == "cuda_allocated" else "process RSS"
    peaks = summary["memory"]["peak_bytes"]
    lines = [
        "",
        f"Done: {summary['steps']} steps, {summary['tokens_per_s']:,.0f} tokens/s,"
        f" loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}"
        + (f" (val {summary['val_loss']:.3f})" if summary["val_loss"] is not None else ""),
        f"Peak memory by phase ({measured}): "
        + ", ".join(f"{phase} {fmt_bytes(peaks[phase])}" for phase in ("load", "forward", "backward", "optimizer_step") if phase in peaks),
        f"Profile:    {settings.run_dir}  (tensorboard --logdir {settings.profile_dir}, PyTorch Profiler tab)",
    ]
    if run.snapshot:
        lines.append(f"Snapshot:   {run.snapshot}  (open at pytorch.org/memory_viz)")
    lines.append(f"Checkpoint: {run.last_checkpoint}")
    print("\n".join(lines))
