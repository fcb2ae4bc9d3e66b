"""Settings shared by every script. litgpt's TrainArgs/EvalArgs are reused so that litgpt flags carry over."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from litgpt.args import EvalArgs as LitEvalArgs
from litgpt.args import TrainArgs as LitTrainArgs

from memfit.errors import UserError

__all__ = [
    "EvalArgs",
    "TrainArgs",
    "FSDPArgs",
    "DDPArgs",
    "AdapterArgs",
    "LogArgs",
    "ProfileArgs",
    "LoggerChoice",
    "check_batch_sizes",
]

LoggerChoice = Literal["tensorboard", "csv", "wandb", "mlflow"]


@dataclass
class LogArgs:
    """Where wandb or MLflow files the run (litgpt's --log names; its litlogger fields are not taken)"""

    project: str | None = None
    """The wandb project or MLflow experiment (default: memfit-<script>)"""
    run: str | None = None
    """The run's name (default: the name of the run's profile dir)"""
    group: str | None = None
    """The wandb group (wandb only)"""


@dataclass
class EvalArgs(LitEvalArgs):
    """Validation settings (litgpt's, with --help text that says what each does)"""

    # litgpt's fields again, with litgpt's defaults, for their --help text only (as TrainArgs below)
    interval: int = 600
    """Optimizer steps between validations"""
    max_new_tokens: int | None = None
    """Tokens to generate from the sample prompt at each validation (none: no sample)"""
    max_iters: int = 100
    """Validation micro-batches per validation (each of --train.micro_batch_size samples), at most the whole
    validation split"""
    initial_validation: bool = False
    """Also validate before the first step"""
    final_validation: bool = True
    """Validate after the last step"""
    evaluate_example: str | int = "first"
    """The validation sample whose prompt generates text: first, random, or its index"""


STEP_SETTING = {"step": True}
"""The metadata of a ``TrainArgs`` field that each script's ``train_step`` reads: such a field is also a field of
``StepSettings`` (below), the one value the step gets (``max_norm: float | None = field(default=None,
metadata=STEP_SETTING)``). Declaring it here is all a new step setting takes besides its use in ``train_step``."""


@dataclass
class TrainArgs(LitTrainArgs):
    """Training-related arguments (litgpt's, plus the optimizer's learning rate and weight decay)"""

    # litgpt's fields again, with litgpt's defaults, for their --help text only: jsonargparse reads the attribute
    # docstrings of the class itself, not of the class it extends, so inherited fields showed none.
    save_interval: int | None = 1000
    """Optimizer steps between step-* checkpoints (null: only final/)"""
    log_interval: int = 1
    """Optimizer steps between progress-bar and logger updates"""
    global_batch_size: int = 64
    """Samples per optimizer step, across all data-parallel processes"""
    micro_batch_size: int = 4
    """Samples per forward/backward in each process; global / (micro x processes) micro-batches accumulate"""
    lr_warmup_steps: int | None = 100
    """Optimizer steps of linear learning-rate warm-up"""
    lr_warmup_fraction: float | None = None
    """The warm-up as a fraction of an epoch's optimizer steps (litgpt's meaning), instead of lr_warmup_steps (give
    --train.lr_warmup_steps 0 with it)"""
    epochs: int | None = None
    """Stop after this many passes over the training data"""
    max_tokens: int | None = None
    """Stop after this many training tokens (the schedule assumes full-length samples, as litgpt's)"""
    max_steps: int | None = None
    """Stop after this many optimizer steps (with epochs and max_tokens: whichever comes first)"""
    max_time: float | None = None
    """litgpt's time limit; not supported: bound the run with max_steps or max_tokens"""
    max_seq_length: int | None = None
    """Truncate samples to this many tokens (default and upper bound: the model's context)"""
    tie_embeddings: bool | None = None
    """Pretraining only: make the head and the token embedding one parameter"""
    max_norm: float | None = field(default=None, metadata=STEP_SETTING)
    """Clip the gradient norm to this (null: no clipping; the norm is logged either way)"""
    min_lr: float = 6e-5
    """Pretraining: the learning rate the cosine decay ends at. Fine-tuning decays to 0 and does not use it, as
    litgpt's fine-tuning scripts (a value other than the default is warned about)"""
    lr: float = 3e-4
    """Peak learning rate, reached after the warm-up (which starts from 0, as litgpt's) and then decayed along a
    cosine"""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)"""
    loss_weighting: Literal["tokens", "micro_batches"] = "tokens"
    """How the micro-batches of a step weigh in its loss: tokens, every target token of the step the same (a
    micro-batch with more answer tokens counts more); micro_batches, each micro-batch's mean loss the same (litgpt's:
    the loss divided by the accumulation). The same when a step is one micro-batch or its micro-batches hold as many
    targets"""

    def __post_init__(self) -> None:
        # litgpt's own check says only "Choose one"; the scripts set a default warm-up in steps, so say how.
        if self.lr_warmup_fraction and self.lr_warmup_steps:
            raise ValueError(
                f"--train.lr_warmup_fraction {self.lr_warmup_fraction} and --train.lr_warmup_steps"
                f" {self.lr_warmup_steps} both set the warm-up: give one (--train.lr_warmup_steps 0 to use the fraction)"
            )
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction < 1:
            raise ValueError(f"--train.lr_warmup_fraction {self.lr_warmup_fraction} must be in [0, 1)")


def check_batch_sizes(train: TrainArgs, data_parallel: int) -> int:
    """Gradient-accumulation iterations per optimizer step; one clear line when the sizes do not divide."""
    if train.micro_batch_size < 1 or train.global_batch_size < 1:
        raise UserError("--train.micro_batch_size and --train.global_batch_size must be at least 1")
    per_rank, rest = divmod(train.global_batch_size, data_parallel)
    if rest or per_rank % train.micro_batch_size:
        raise UserError(
            f"--train.global_batch_size {train.global_batch_size} must be a multiple of --train.micro_batch_size"
            f" {train.micro_batch_size} x {data_parallel} data-parallel process(es)"
        )
    if train.max_steps is None and train.epochs is None and train.max_tokens is None:
        raise UserError("give --train.max_steps, --train.epochs or --train.max_tokens to say how long to train")
    return per_rank // train.micro_batch_size


@dataclass
class FSDPArgs:
    """Fully sharded data parallel settings (with --strategy fsdp)"""

    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state in CPU memory, moving each block to the GPU only for its
    compute: how a model bigger than the card trains, on one GPU too (--devices 1)"""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """What is sharded across ranks: everything (FULL_SHARD), everything but the weights between a block's forward and
    its backward (SHARD_GRAD_OP), everything within each node and replicated across nodes (HYBRID_SHARD, with
    --num_nodes 2 or more), or nothing (NO_SHARD: refused, that is --strategy ddp)"""
    accumulate_unsharded: bool = False
    """Under gradient accumulation, keep each rank's gradients unsharded (the whole model's) until a step's last
    micro-batch and reduce-scatter them once: one reduce-scatter a step instead of one a micro-batch, for the whole
    model's gradients on every rank (false: each micro-batch's are reduce-scattered into the rank's 1/N share)"""
    state_dict_type: Literal["full", "sharded"] = "sharded"
    """step-* checkpoints: one file per rank (sharded: no rank holds the whole model, and a resume on another number
    of processes reshards it) or gathered into litgpt's consolidated file (full); final/ is always consolidated"""


@dataclass
class DDPArgs:
    """Distributed data parallel settings (with --strategy ddp)"""

    gradient_as_bucket_view: bool = True
    """Each gradient is a view into DDP's all-reduce buckets (true: one copy of the gradients). false is torch's
    default, which litgpt, Lightning and Thunder run: the buckets are a second copy of the trained gradients on every
    rank, for the whole run"""


@dataclass
class AdapterArgs:
    """LLaMA-Adapter settings (v1 and v2)"""

    prompt_length: int = 10
    """Learned prompt tokens per adapted layer"""
    start_layer: int = 2
    """First layer that gets an adapter prompt"""

    def config_options(self) -> dict:
        return {"adapter_prompt_length": self.prompt_length, "adapter_start_layer": self.start_layer}


def litgpt_finetune_defaults(eval_interval: int) -> dict:
    """litgpt's defaults for a fine-tuning script (its ``setup()`` signature; "AdamW" by name is torch's AdamW with
    its own lr 1e-3 and weight decay 0.01), by flag name, which a real model takes where no flag or file says
    otherwise (``memfit.settings.cli.CLI``'s ``real_model_defaults``); the scripts differ in how often they validate."""
    return {
        "train.save_interval": 1000,
        "train.global_batch_size": 16,
        "train.micro_batch_size": 1,
        "train.lr_warmup_steps": 100,
        "train.epochs": 5,
        "train.max_steps": None,
        "train.lr": 1e-3,
        "train.weight_decay": 0.01,
        "eval.interval": eval_interval,
        "eval.max_new_tokens": 100,
        "eval.max_iters": 100,
    }


def _step_settings_of(cls, train) -> StepSettings:
    """The settings ``train`` (``--train.*``, ``memfit.args.TrainArgs``) gives the step: its fields of these names."""
    return cls(**{field.name: getattr(train, field.name) for field in dataclasses.fields(cls)})


StepSettings = dataclasses.make_dataclass(
    "StepSettings",
    [
        (field.name, field.type, dataclasses.field(default=field.default))
        for field in dataclasses.fields(TrainArgs)
        if field.metadata.get("step")
    ],
    frozen=True,
    namespace={
        "of": classmethod(_step_settings_of),
        "__doc__": """What one optimizer step (each script's ``train_step``) needs from the flags besides its model,
        optimizer and batches, as one value: ``fit()`` passes the run's, the estimate traces a plan's
        (``memfit.prediction.fake_step.Plan``). Its fields are the ``TrainArgs`` fields marked ``STEP_SETTING``
        (today ``max_norm``), declared once there.""",
    },
)
StepSettings.__module__ = __name__  # make_dataclass names its own caller's module only from Python 3.12 on


@dataclass
class ProfileArgs:
    """Memory-profiling settings"""

    enabled: bool = True
    """Record a profiler window (per-op memory trace for TensorBoard's PyTorch Profiler tab)"""
    wait: int = 1
    """Optimizer steps before the window starts (the first step allocates the optimizer state)"""
    warmup: int = 1
    """Optimizer steps the profiler runs but discards, so its own start-up cost stays out of the trace"""
    active: int = 1
    """Optimizer steps recorded"""
    with_stack: bool = False
    """Also record every Python call of the recorded step, so the ledger's biggest allocations name the source line
    that made them. Off by default, as torchtune and torchtitan keep it: on the embedded model the Python frames were
    86% of the trace's bytes and made the recorded step and its views several times slower (docs/memory.md)"""
    record_shapes: bool = False
    """Also record each operator's input shapes (TensorBoard's "Group by input shape"). Off by default: on the
    embedded model it raised the window's host memory by about 60 MiB, and Memfit's own views do not use them"""

    def window(self, total_steps: int) -> tuple[int, int, int]:
        """(wait, warmup, active) in optimizer steps; the recorded step is the one after wait + warmup."""
        # A short run still gets a window: shrink the lead-in, keeping the first step out when possible.
        active = max(1, min(self.active, total_steps))
        lead = max(0, total_steps - active)
        warmup = min(self.warmup, lead)
        return min(self.wait, lead - warmup), warmup, active

    @staticmethod
    def default_recorded_step(total_steps: int) -> int:
        """The step (from 1) the default window records: where the run's longest samples go whatever window is asked
        for, so that the profile flags never change the training and, by default, the recorded step is the peak."""
        wait, warmup, _ = ProfileArgs().window(total_steps)
        return wait + warmup + 1
