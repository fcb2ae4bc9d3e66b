"""Fabric's strategy for ``--strategy``/``--fsdp`` and its logger for ``--logger_name``.

Inside FSDP, activation checkpointing is the strategy's policy; without FSDP, the script wraps the blocks itself
(``memfit.loading.apply_activation_checkpointing``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.args import FSDPArgs


def make_strategy(strategy: str, world_size: int, fsdp: FSDPArgs, block_class: type, activation_checkpointing: bool) -> Any:
    if strategy == "fsdp":
        from lightning.fabric.strategies import FSDPStrategy  # imported by FSDP runs only: it pulls in torch.distributed

        return FSDPStrategy(
            auto_wrap_policy={block_class},
            activation_checkpointing_policy={block_class} if activation_checkpointing else None,
            cpu_offload=fsdp.cpu_offload,
            sharding_strategy=fsdp.sharding_strategy,
            state_dict_type=fsdp.state_dict_type,
            limit_all_gathers=True,
        )
    if strategy == "ddp" or world_size > 1:
        return "ddp"
    return "auto"


def make_logger(logger_name: str, run_dir: Path):
    """Scalars land beside the profiler trace, so one ``tensorboard --logdir profiles`` shows both for a run."""
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    logger_class = TensorBoardLogger if logger_name == "tensorboard" else CSVLogger
    return logger_class(root_dir=str(run_dir), name="", version="")
