"""The flags every script shares, declared once, and their validation.

A script's ``setup()`` declares its own method's flags (and its defaults for ``out_dir`` and ``train``) and
forwards ``**flags`` to ``resolve_settings``; jsonargparse follows that call, so the parameters below, with their
types and documentation, are flags of every script (``--precision``, ``--quantize``, ``--data``, ...).
Everything a user can get wrong is checked here, before anything is built or written.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from litgpt.data import DataModule

from memfit.args import EvalArgs, LoggerChoice, OptimizerChoice, TrainArgs, check_batch_sizes
from memfit.checkpoint import latest_checkpoint, plain_hparams
from memfit.cli import UserError
from memfit.embedded import ensure_embedded
from memfit.memory import parse_budget
from memfit.optim import resolve_optimizer
from memfit.precision import (
    PrecisionChoice,
    QuantizeChoice,
    check_combination,
    compute_dtype,
    default_precision,
    resolve_accelerator,
)
from memfit.profiling import ProfileArgs


@dataclass
class FSDPArgs:
    """Fully sharded data parallel settings (with --strategy fsdp)"""

    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state in CPU memory, moving each block to the GPU only for its
    compute: how a model bigger than the card trains, on one GPU too (--devices 1)"""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """What is sharded across ranks: everything (FULL_SHARD), gradients and optimizer state (SHARD_GRAD_OP), within a
    node (HYBRID_SHARD), or nothing (NO_SHARD, like DDP)"""
    state_dict_type: Literal["full", "sharded"] = "full"
    """Checkpoint format: one consolidated file (full), or one file per rank (sharded; faster, less memory)"""


@dataclass
class Settings:
    """The resolved shared flags, and what was derived from them."""

    script: str
    out_dir: Path
    train: TrainArgs
    hparams: dict
    checkpoint_dir: Path | None
    model_name: str | None
    precision: str
    quantize: str | None
    accelerator: str
    devices: int
    num_nodes: int
    strategy: str
    fsdp: FSDPArgs
    activation_checkpointing: bool
    data: Any
    eval: EvalArgs
    optimizer: str
    optimizer_in_backward: bool
    optimizer_args: dict
    logger_name: str
    profile: ProfileArgs
    profile_dir: Path
    resume: bool
    overwrite: bool
    seed: int
    estimate: bool = False
    memory_budget: str | None = None
    embedded_json: Path | None = None
    accumulation: int = 1
    run_name: str = ""

    @property
    def run_dir(self) -> Path:
        return self.profile_dir / self.run_name

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.precision)

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def resolve_settings(
    script: str,
    train: TrainArgs,
    hparams: dict,
    *,
    out_dir: Path | None = None,
    checkpoint_dir: Path | None = None,
    model_name: str | None = None,
    precision: PrecisionChoice | None = None,
    quantize: QuantizeChoice | None = None,
    accelerator: Literal["auto", "cpu", "cuda", "gpu"] = "auto",
    devices: int | Literal["auto"] = 1,
    num_nodes: int = 1,
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    activation_checkpointing: bool = False,
    data: DataModule | None = None,
    eval: EvalArgs = EvalArgs(interval=40, max_iters=20),
    optimizer: OptimizerChoice | dict = "AdamW",
    optimizer_in_backward: bool = False,
    logger_name: LoggerChoice = "tensorboard",
    profile: ProfileArgs = ProfileArgs(),
    profile_dir: Path = Path("profiles"),
    resume: bool = False,
    overwrite: bool = False,
    seed: int = 1337,
    estimate: bool = False,
    memory_budget: str | None = None,
) -> Settings:
    """Checks the shared flags and fills in the embedded default.

    Args:
        out_dir: Where checkpoints go (step-*/ and final/). Default: out/finetune/<script>, or out/pretrain.
        checkpoint_dir: A litgpt checkpoint dir (lit_model.pth, model_config.yaml, tokenizer.json or tokenizer.model),
            also given first without the flag, as litgpt takes it; `org/name` is looked up under checkpoints/ as
            `litgpt download` puts it. Default: the embedded tiny Llama and its data, generated locally.
        model_name: A model name from litgpt's config table (e.g. Llama-2-7b-hf): its config replaces the checkpoint
            dir's (pretraining from scratch).
        precision: Fabric precision: 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true. Default: bf16-true on a GPU
            that supports it, else 32-true.
        quantize: Quantize the frozen base with bitsandbytes (works on CPU too).
        accelerator: cpu, cuda (gpu) or auto (the GPU when present).
        devices: Devices (processes) per node, or auto: every visible GPU (one process on CPU).
        num_nodes: Nodes (launch with torchrun or SLURM; see the README).
        strategy: auto (one device), ddp (replicated model), fsdp (sharded model, GPU only).
        fsdp: FSDP settings: cpu_offload, sharding_strategy, state_dict_type.
        activation_checkpointing: Recompute each transformer block's activations in backward instead of keeping them.
        data: A litgpt DataModule, e.g. ``--data JSON --data.json_path FILE --data.val_split_fraction 0.1``.
            Default: the embedded dataset.
        eval: Validation settings.
        optimizer: AdamW (fused where supported, else foreach), AdamW-foreach (PyTorch's default kernel; its step
            allocates scratch about the size of the parameters), AdamW-for-loop, SGD, or bitsandbytes AdamW8bit,
            PagedAdamW, PagedAdamW8bit; or litgpt's block, {class_path: torch.optim.AdamW, init_args: {lr: 2e-4,
            weight_decay: 0.0, betas: [0.9, 0.95]}}, whose lr and weight_decay then set --train.lr and
            --train.weight_decay.
        optimizer_in_backward: Step each parameter's optimizer as soon as its gradient is ready and free the
            gradient (needs no gradient accumulation and no clipping).
        logger_name: Where per-step scalars go: tensorboard or csv (in the run's profile dir).
        profile: The memory-profiler window, counted in optimizer steps.
        profile_dir: Where each run's profile dir (trace, scalars, summary) is created.
        resume: Continue from the latest step-* checkpoint in out_dir.
        overwrite: Start afresh in an out_dir that holds an earlier run, deleting its step-*/ and final/ checkpoints
            (without it, such an out_dir is refused: resume it, or choose a fresh one).
        seed: Random seed.
        estimate: Print the predicted peak memory of these settings, by role and phase, and exit without training
            (works from --model_name alone, no weights needed).
        memory_budget: With --estimate, list the settings that fit this much memory (e.g. 24GB), fastest first; in
            a run, the budget the out-of-memory explanation plans for (default: the device's memory).
    """
    given = {k: v for k, v in locals().items() if k in _FLAG_NAMES}
    if out_dir is None:
        out_dir = Path("out/pretrain") if script == "pretrain" else Path("out/finetune") / script
    # An estimate plans for the target machine, which need not be this one.
    accelerator = ("cuda" if accelerator in ("cuda", "gpu") else "cpu") if estimate and accelerator != "auto" else resolve_accelerator(accelerator)
    precision = precision or default_precision(accelerator)
    if devices == "auto":  # as litgpt: every GPU the process sees
        devices = torch.cuda.device_count() if accelerator == "cuda" and torch.cuda.is_available() else 1
    check_combination(precision, quantize)
    if precision == "16-mixed" and accelerator == "cpu":
        raise UserError("--precision 16-mixed needs a GPU; on CPU use bf16-mixed or bf16-true")
    if devices < 1 or num_nodes < 1:
        raise UserError(f"--devices {devices} / --num_nodes {num_nodes}: both must be at least 1")
    if strategy == "fsdp" and accelerator != "cuda" and not estimate:
        raise UserError(
            "--strategy fsdp needs CUDA GPUs (Lightning's FSDP runs on GPUs only); on CPU use --strategy ddp"
        )
    if quantize and (devices * num_nodes > 1 or strategy == "fsdp"):
        raise UserError("--quantize trains on one device without FSDP; set --devices 1 --strategy auto")
    if fsdp.cpu_offload and strategy != "fsdp":
        raise UserError("--fsdp.cpu_offload true needs --strategy fsdp")
    optimizer, schedule, optimizer_args = resolve_optimizer(optimizer)
    if schedule:  # litgpt keeps lr and weight decay in the optimizer block: they become the schedule's
        train = dataclasses.replace(train, **schedule)
    accumulation = check_batch_sizes(train, devices * num_nodes)
    check_numbers(train, eval)
    check_profile(profile)
    if optimizer_in_backward and (accumulation > 1 or train.max_norm):
        raise UserError(
            "--optimizer_in_backward steps during backward, so it needs --train.global_batch_size equal to"
            f" micro_batch_size x devices (now {accumulation} micro-batches per step) and no --train.max_norm"
        )
    if optimizer_in_backward and strategy == "fsdp":
        raise UserError("--optimizer_in_backward is not supported with --strategy fsdp; drop one of them")

    embedded_json = None
    if checkpoint_dir is None and estimate and model_name is not None:
        pass  # the architecture comes from litgpt's table: nothing to load, so nothing to generate
    elif checkpoint_dir is None:
        checkpoint_dir, embedded_json = ensure_embedded()
    else:
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.exists() and (Path("checkpoints") / checkpoint_dir).is_dir():
            checkpoint_dir = Path("checkpoints") / checkpoint_dir  # litgpt's `org/name` under checkpoints/
        if not (checkpoint_dir / "model_config.yaml").is_file():
            raise UserError(
                f"--checkpoint_dir {str(checkpoint_dir)!r} has no model_config.yaml; give a litgpt checkpoint dir"
                " (as `litgpt download` makes it)"
            )
        check_checkpoint_dir(checkpoint_dir, needs_tokenizer=not estimate)
        if data is None and not estimate:
            raise UserError("with --checkpoint_dir, also give the data, e.g. --data JSON --data.json_path FILE")
    if model_name is not None:
        from litgpt import Config

        try:
            Config.from_name(model_name)
        except ValueError:
            raise UserError(f"--model_name {model_name!r} is not in litgpt's config table (e.g. Llama-2-7b-hf)") from None
    if memory_budget is not None:
        parse_budget(memory_budget)
    if not estimate:
        check_writable("--out_dir", Path(out_dir))
        check_writable("--profile_dir", Path(profile_dir))
    if resume and overwrite:
        raise UserError("--resume true and --overwrite true contradict each other: give one of them")
    if resume and latest_checkpoint(Path(out_dir)) is None:
        raise UserError(f"--resume: no step-* checkpoint in --out_dir {str(out_dir)!r}")
    earlier = earlier_run(Path(out_dir))
    if earlier and not (resume or overwrite or estimate):
        raise UserError(
            f"--out_dir {str(out_dir)!r} already holds a run ({', '.join(earlier[:3])}); continue it with --resume"
            " true, choose a fresh --out_dir, or replace it with --overwrite true"
        )

    settings = Settings(
        script=script, out_dir=Path(out_dir), train=train, hparams={}, checkpoint_dir=checkpoint_dir,
        model_name=model_name, precision=precision, quantize=quantize, accelerator=accelerator, devices=devices,
        num_nodes=num_nodes, strategy=strategy, fsdp=fsdp, activation_checkpointing=activation_checkpointing,
        data=data, eval=eval, optimizer=optimizer, optimizer_in_backward=optimizer_in_backward,
        optimizer_args=optimizer_args,
        logger_name=logger_name, profile=profile, profile_dir=Path(profile_dir), resume=resume, overwrite=overwrite,
        seed=seed,
        estimate=estimate, memory_budget=memory_budget, embedded_json=embedded_json, accumulation=accumulation,
    )
    # The flags as given (not the embedded paths), so hyperparameters.yaml reproduces the run with --config.
    # train as resolved: an optimizer block's lr and weight decay are the ones the run uses
    settings.hparams = {k: v for k, v in hparams.items() if k != "flags"} | given | {"train": train}
    # What litgpt's tools read back from hyperparameters.yaml: the base checkpoint by absolute path (merge_lora finds
    # it from any working directory) and the precision the run really used
    if embedded_json is None and checkpoint_dir is not None:
        settings.hparams["checkpoint_dir"] = str(checkpoint_dir.resolve())
    settings.hparams["precision"] = precision
    if resume:
        check_resume_settings(Path(out_dir), settings.hparams)
    model = model_name or (checkpoint_dir.name if embedded_json is None else "embedded")
    settings.run_name = _run_name(script, model, Path(profile_dir))
    return settings


_FLAG_NAMES = (
    "out_dir", "checkpoint_dir", "model_name", "precision", "quantize", "accelerator", "devices", "num_nodes", "strategy",
    "fsdp", "activation_checkpointing", "data", "eval", "optimizer", "optimizer_in_backward", "logger_name",
    "profile", "profile_dir", "resume", "overwrite", "seed", "memory_budget",
)


def refuse_quantize(settings: Settings) -> None:
    """For methods that train every weight: quantized weights cannot train."""
    if settings.quantize:
        raise UserError(
            f"--quantize {settings.quantize}: {settings.script} trains every weight, and quantized weights cannot"
            " train; use finetune/lora.py or the adapter scripts for a quantized base, or drop --quantize"
        )


def _run_name(script: str, model: str, profile_dir: Path) -> str:
    # Processes started by Fabric's launcher must agree on the name, so the first one hands it down.
    if os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("NODE_RANK", "0") != "0":
        inherited = os.environ.get("MEMFIT_RUN_NAME")
        if inherited:
            return inherited
    # The pid keeps two processes started in the same second apart; the suffix, two runs of one process.
    base = f"{script}-{model}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    name, n = base, 1
    while (profile_dir / name).exists():
        n += 1
        name = f"{base}-{n}"
    os.environ["MEMFIT_RUN_NAME"] = name
    return name


def check_numbers(train: TrainArgs, eval: EvalArgs) -> None:
    """Out-of-range numbers, and litgpt settings Memfit does not implement, each refused in one line."""
    import math

    def positive(flag: str, value, integer: bool = True) -> None:
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise UserError(f"{flag} {value!r} must be {'a whole number ' if integer else ''}greater than 0")

    positive("--train.lr", train.lr, integer=False)
    positive("--train.max_steps", train.max_steps)
    positive("--train.epochs", train.epochs)
    positive("--train.log_interval", train.log_interval)
    positive("--train.save_interval", train.save_interval)
    positive("--train.max_seq_length", train.max_seq_length)
    positive("--train.max_norm", train.max_norm, integer=False)
    positive("--train.max_tokens", train.max_tokens)
    positive("--eval.interval", eval.interval)
    positive("--eval.max_iters", eval.max_iters)
    for flag, value in (("--train.min_lr", train.min_lr), ("--train.weight_decay", train.weight_decay),
                        ("--train.lr_warmup_steps", train.lr_warmup_steps)):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise UserError(f"{flag} {value!r} must be 0 or more")
    # litgpt's argument classes carry these; Memfit's loop does not implement them, so they are refused rather
    # than listed in --help and silently ignored.
    if train.max_time is not None:
        raise UserError("--train.max_time is not supported; bound the run with --train.max_steps or --train.max_tokens")
    if train.tie_embeddings is not None:
        raise UserError(
            "--train.tie_embeddings is not supported: the model config decides the head (litgpt's"
            " Config.tie_embeddings in model_config.yaml); drop the flag"
        )
    positive("--eval.max_new_tokens", eval.max_new_tokens)
    example = eval.evaluate_example
    if not (example in ("first", "random") or str(example).isdigit()):  # an index may arrive as a string
        raise UserError(f"--eval.evaluate_example {example!r} must be first, random, or the index of a validation sample")


def check_profile(profile: ProfileArgs) -> None:
    for name in ("wait", "warmup"):
        if getattr(profile, name) < 0:
            raise UserError(f"--profile.{name} {getattr(profile, name)} must be 0 or more")
    if profile.active < 1:
        raise UserError(f"--profile.active {profile.active} must be at least 1 (or --profile.enabled false)")


def check_checkpoint_dir(checkpoint_dir: Path, needs_tokenizer: bool) -> None:
    """A readable model_config.yaml that litgpt's Config accepts, and a tokenizer litgpt can load."""

    import yaml
    from litgpt import Config

    config_file = checkpoint_dir / "model_config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise UserError(f"{config_file} is not valid YAML{line}; restore it from the model's checkpoint") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} holds a {type(config).__name__}, not litgpt's model settings")
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise UserError(f"{config_file}: {unknown[0]!r} is not a litgpt Config field; fix or remove it")
    if needs_tokenizer and not any((checkpoint_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(f"--checkpoint_dir {str(checkpoint_dir)!r} has no tokenizer (tokenizer.json or tokenizer.model);"
                        " copy it from the model's original files (litgpt download fetches it)")


def check_writable(flag: str, path: Path) -> None:
    """Refuses a directory that cannot be created or written, before any work (not at the first save)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{flag} {str(path)!r} cannot be created: {str(existing)!r} is a file; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {str(path)!r} is not writable (no write permission on {str(existing)!r})")


def earlier_run(out_dir: Path) -> list[str]:
    """The checkpoint directories an earlier run left in ``out_dir``."""
    if not out_dir.is_dir():
        return []
    return sorted((p.name for p in out_dir.iterdir() if p.is_dir() and (p.name == "final" or p.name.startswith("step-"))),
                  reverse=True)


# Settings that only change what is measured or logged: a resumed run may change them.
_CHANGEABLE_ON_RESUME = ("resume", "overwrite", "eval.", "profile.", "profile_dir", "logger_name", "memory_budget",
                         "train.log_interval", "train.save_interval")


def check_resume_settings(out_dir: Path, hparams: dict) -> None:
    """A resumed run continues with the settings it was started with; a changed one is refused, not recorded."""
    import yaml

    stored_file = latest_checkpoint(out_dir) / "hyperparameters.yaml"
    if not stored_file.is_file():
        return  # a damaged checkpoint: loading falls back to an earlier one, and says so
    stored = _flatten(yaml.safe_load(stored_file.read_text()) or {})
    given = _flatten(plain_hparams(hparams))
    for key in sorted(given.keys() | stored.keys()):
        if key.startswith(_CHANGEABLE_ON_RESUME) or given.get(key) == stored.get(key):
            continue
        raise UserError(
            f"--resume true: --{key} is {given.get(key)!r} here but {stored.get(key)!r} in the run being resumed"
            f" ({stored_file}); a resumed run keeps its settings: drop --{key}, or start a new run in a fresh --out_dir"
        )


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict) and key != "data":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
