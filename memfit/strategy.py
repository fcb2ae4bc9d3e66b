"""Fabric's strategy for ``--strategy``/``--fsdp`` and its logger for ``--logger_name``.

Inside FSDP, activation checkpointing is the strategy's policy; without FSDP, the script wraps the blocks itself
(``memfit.loading.apply_activation_checkpointing``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.args import FSDPArgs, LogArgs
from memfit.cli import UserError


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


def make_logger(logger_name: str, log: LogArgs, run_dir: Path, script: str):
    """Scalars land beside the profiler trace, so one ``tensorboard --logdir profiles`` shows both for a run; wandb
    and MLflow (when installed) file the run under ``--log.project`` and ``--log.run``."""
    given = [f"--log.{name}" for name, value in vars(log).items() if value is not None]
    if given and logger_name in ("tensorboard", "csv"):
        raise UserError(f"{', '.join(given)} names a wandb or MLflow run; with --logger_name {logger_name} it would be"
                        " ignored: add --logger_name wandb or mlflow, or drop it")
    if log.group is not None and logger_name == "mlflow":
        raise UserError("--log.group is wandb's; MLflow has no run groups: drop it, or use --logger_name wandb")
    if logger_name in ("wandb", "mlflow"):
        try:
            __import__(logger_name)
        except ImportError:
            install = "wandb" if logger_name == "wandb" else "mlflow (or mlflow-skinny)"
            raise UserError(f"--logger_name {logger_name} needs the {logger_name} package, which is not installed:"
                            f" pip install {install}, or use --logger_name tensorboard or csv") from None
    project, name = log.project or f"memfit-{script}", log.run or run_dir.name
    if logger_name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # WANDB_MODE=offline keeps the run on disk (in the run dir) for `wandb sync` later: air-gapped clusters
        return WandbLogger(project=project, name=name, group=log.group, save_dir=str(run_dir))
    if logger_name == "mlflow":
        import os

        from lightning.pytorch.loggers import MLFlowLogger

        # A tracking server when MLFLOW_TRACKING_URI names one, else a file store in the run dir, which needs no
        # server and works offline. MLflow 3 refuses file stores unless allowed (it wants a database, which
        # mlflow-skinny cannot open); `mlflow ui --backend-store-uri <run dir>/mlruns` reads it.
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return MLFlowLogger(experiment_name=project, run_name=name, tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"),
                            save_dir=str(run_dir / "mlruns"))
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    logger_class = TensorBoardLogger if logger_name == "tensorboard" else CSVLogger
    return logger_class(root_dir=str(run_dir), name="", version="")
