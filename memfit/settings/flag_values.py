"""The checks of a script's flag values (numbers in range, the launcher the flags ask for, a method's own options),
run in ``setup()`` before anything is built or written; each raises ``UserError`` with one line naming the bad value
and the fix.
"""

from __future__ import annotations

import math
import os

from memfit.args import AdapterArgs, EvalArgs, ProfileArgs, TrainArgs
from memfit.errors import UserError
from memfit.training.compiled_blocks import check_compiler


def check_launcher(num_nodes: int, devices: int) -> None:
    """Under torchrun, the processes it started are the ones the flags ask for (otherwise each rank fails on a derived
    quantity, such as the global batch's share, and torchrun adds its own traceback). Several nodes need a rendezvous
    that every node agrees on: without a launcher Fabric recognises, it falls back to 127.0.0.1, a random port and
    node rank 0, and the first process waits for the other nodes forever."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if TorchElasticEnvironment.detect() and int(os.environ["WORLD_SIZE"]) != num_nodes * devices:
        started, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        raise UserError(
            f"--num_nodes {num_nodes} --devices {devices} ask for {num_nodes * devices} processes, but torchrun started"
            f" {started} ({started // per_node} node(s) of {per_node}); give --num_nodes {started // per_node}"
            f" --devices {per_node}, or start torchrun with --nnodes {num_nodes} --nproc_per_node {devices}"
        )
    if num_nodes == 1:
        return
    # the ones Fabric's connector tries, in its order; MPI's is False without mpi4py
    if any(
        environment.detect()
        for environment in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)
    ):
        return
    unset = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if name not in os.environ]
    if unset:
        raise UserError(
            f"--num_nodes {num_nodes}: no launcher (torchrun, SLURM's srun, LSF, MPI) and {', '.join(unset)} not set,"
            " so this process would wait for the other nodes forever; start the command on every node under torchrun"
            " or srun, or set MASTER_ADDR, MASTER_PORT and NODE_RANK on each"
        )


def refuse_quantize(script: str, quantize: str | None) -> None:
    """For methods that train every weight: quantized weights cannot train."""
    if quantize:
        raise UserError(
            f"--quantize {quantize}: {script} trains every weight, and quantized weights cannot"
            " train; use finetune/lora.py or the adapter scripts for a quantized base, or drop --quantize"
        )


def check_numbers(train: TrainArgs, eval: EvalArgs) -> None:
    """Out-of-range numbers, and litgpt settings Memfit does not implement, each refused in one line."""

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
    for flag, value in (
        ("--train.min_lr", train.min_lr),
        ("--train.weight_decay", train.weight_decay),
        ("--train.lr_warmup_steps", train.lr_warmup_steps),
    ):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise UserError(f"{flag} {value!r} must be 0 or more")
    # litgpt's argument classes carry these; Memfit's loop does not implement them, so they are refused rather
    # than listed in --help and silently ignored.
    if train.max_time is not None:
        raise UserError("--train.max_time is not supported; bound the run with --train.max_steps or --train.max_tokens")
    positive("--eval.max_new_tokens", eval.max_new_tokens)
    example = eval.evaluate_example
    if not (example in ("first", "random") or str(example).isdigit()):  # an index may arrive as a string
        raise UserError(
            f"--eval.evaluate_example {example!r} must be first, random, or the index of a validation sample"
        )


def check_profile(profile: ProfileArgs) -> None:
    for name in ("wait", "warmup"):
        if getattr(profile, name) < 0:
            raise UserError(f"--profile.{name} {getattr(profile, name)} must be 0 or more")
    if profile.active < 1:
        raise UserError(f"--profile.active {profile.active} must be at least 1 (or --profile.enabled false)")


def check_lora(r: int, alpha: int, dropout: float) -> None:
    if r < 1:
        raise UserError(f"--lora_r {r} must be a whole number greater than 0 (the rank of each LoRA update)")
    if alpha <= 0:  # the update is scaled by alpha / r: 0 trains nothing
        raise UserError(f"--lora_alpha {alpha} must be greater than 0 (the update is scaled by alpha / r)")
    # litgpt's LoRA layers take a dropout of 0 or less as none at all, and torch refuses 1 or more with a traceback
    if not 0 <= dropout < 1:
        raise UserError(f"--lora_dropout {dropout} must be in [0, 1)")


def check_adapter(adapter: AdapterArgs, n_layer: int, prompts_only: bool) -> None:
    """``prompts_only``: LLaMA-Adapter v1, whose only trained parameters are the prompts (and their gates)."""
    if adapter.prompt_length < 1:
        raise UserError(f"--adapter.prompt_length {adapter.prompt_length} must be a whole number greater than 0")
    if adapter.start_layer < 0:  # litgpt would adapt every layer, as with 0
        raise UserError(f"--adapter.start_layer {adapter.start_layer} must be 0 or more")
    if prompts_only and adapter.start_layer >= n_layer:
        raise UserError(
            f"--adapter.start_layer {adapter.start_layer} leaves no layer a prompt: the model has"
            f" {n_layer} layers (0 to {n_layer - 1})"
        )


def check_compile(compile: bool, *, estimate: bool, accelerator: str) -> None:
    """--compile true where it runs: on a CPU only with a C++ compiler for inductor (which the estimate does not run:
    ``memfit.training.compiled_blocks.traced_backend``). Under FSDP each block's forward is compiled before
    ``fully_shard`` makes it a unit (torchtitan's order), its gathers and reductions in FSDP's hooks around it."""
    if not compile:
        return
    if not estimate:
        check_compiler(accelerator)
