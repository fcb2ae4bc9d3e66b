"""Fabric construction: precision plugin, strategy (single device, DDP, FSDP with CPU offload) and logger.

Activation checkpointing is applied here too: inside FSDP by the strategy's policy, and without FSDP by wrapping
each transformer block, so it works on one GPU or the CPU as well.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
import torch

from memfit.precision import fabric_precision
from memfit.settings import Settings


def make_strategy(settings: Settings, block_class: type) -> Any:
    if settings.strategy == "fsdp":
        from lightning.fabric.strategies import FSDPStrategy

        return FSDPStrategy(
            auto_wrap_policy={block_class},
            activation_checkpointing_policy={block_class} if settings.activation_checkpointing else None,
            cpu_offload=settings.fsdp.cpu_offload,
            sharding_strategy=settings.fsdp.sharding_strategy,
            state_dict_type=settings.fsdp.state_dict_type,
            limit_all_gathers=True,
        )
    if settings.strategy == "ddp" or settings.world_size > 1:
        return "ddp"
    return "auto"


def make_fabric(settings: Settings, block_class: type) -> L.Fabric:
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    # Scalars land beside the profiler trace, so one `tensorboard --logdir profiles` shows both for a run.
    logger_class = TensorBoardLogger if settings.logger_name == "tensorboard" else CSVLogger
    logger = logger_class(root_dir=str(settings.run_dir), name="", version="")
    return L.Fabric(
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=make_strategy(settings, block_class),
        loggers=logger,
        **fabric_precision(settings.precision, settings.quantize, settings.accelerator),
    )


def apply_activation_checkpointing(model: torch.nn.Module, block_class: type) -> int:
    """Wraps every ``block_class`` so its activations are recomputed in backward (non-reentrant checkpointing).

    Lightning applies this only inside FSDP; the same PyTorch wrapper works on a plain module.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as apply,
        checkpoint_wrapper,
    )

    apply(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: isinstance(module, block_class),
    )
    return sum(isinstance(m, block_class) for m in model.modules())
