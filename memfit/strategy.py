"""Fabric construction: precision plugin, strategy (single device, DDP, FSDP with CPU offload) and logger.

Inside FSDP, activation checkpointing is the strategy's policy; without FSDP, ``memfit.loading`` wraps the blocks.
"""

from __future__ import annotations

from typing import Any

import lightning as L

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
