"""The run's loggers (TensorBoard, CSV, wandb, MLflow): made from the flags, and never the reason a run ends.

A logger that fails to write (a full disk, a quota, a read-only mount under the profile dir) says so once and is off
for the rest of the run: training goes on and its checkpoints are saved, whichever logger it is. TensorBoard writes
from a thread of its own, whose failure is raised again in the run's next write: that is where it is said.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import Logger

from memfit.errors import UserError
from memfit.training.checkpoint import os_error_within


def make_logger(run) -> KeptGoing:
    """The logger ``--logger_name`` asks for, kept from ending the run (``KeptGoing``)."""
    return KeptGoing(_make_logger(run), run.logger_name)


class KeptGoing(Logger):
    """A run's logger whose first failure is a warning and turns it off; the run goes on without it."""

    def __init__(self, logger, logger_name: str) -> None:
        super().__init__()
        self.logger, self.logger_name = logger, logger_name
        self.failed: BaseException | None = None

    @property
    def name(self) -> str | None:
        return self.logger.name

    @property
    def version(self) -> Any:
        return self.logger.version

    @property
    def root_dir(self) -> str | None:
        return getattr(self.logger, "root_dir", None)

    @property
    def log_dir(self) -> str | None:
        return getattr(self.logger, "log_dir", None)

    @property
    def experiment(self) -> Any:
        """The logger's writer (TensorBoard's ``SummaryWriter``, where the views go), None once it has failed."""
        return None if self.failed is not None else self.logger.experiment

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self._kept_going(self.logger.log_metrics, metrics, step)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self._kept_going(self.logger.log_hyperparams, params, *args, **kwargs)

    def save(self) -> None:
        self._kept_going(self.logger.save)

    def finalize(self, status: str) -> None:
        """The logger's last rows written, or its file left as it was; an error is raised to the caller (the run's
        end says it in one line). A logger that failed during training was already said, and is left."""
        if self.failed is None:
            flush_logger(self.logger, status)

    def _kept_going(self, write, *args, **kwargs) -> None:
        if self.failed is not None:
            return
        try:
            write(*args, **kwargs)
        except Exception as error:  # noqa: BLE001  a logger's failure is never worth the run
            self.failed = error
            disk = os_error_within(error)
            why = disk.strerror if disk is not None and disk.strerror else (str(error).splitlines() or [""])[0][:200]
            where = f" in {self.log_dir}" if self.log_dir else ""
            print(
                f"warning: could not write the {self.logger_name} log{where} ({why or type(error).__name__}); training"
                " goes on without it, and its checkpoints are saved",
                flush=True,
            )


def tensorboards(loggers) -> list:
    """The TensorBoard writers among a run's ``loggers`` (Fabric's), where the Images and Text tabs' views go (each
    made here if the run has not logged yet)."""
    return [logger.experiment for logger in loggers if hasattr(getattr(logger, "experiment", None), "add_image")]


def _make_logger(run):
    """Scalars land beside the profiler trace, so one ``tensorboard --logdir out/profiles`` shows both for a run; wandb
    and MLflow (when installed) file the run under ``--log.project`` and ``--log.run``. ``run``: a
    ``memfit.settings.run.Run``."""
    logger_name, log, run_dir, script = run.logger_name, run.log, run.run_dir, run.method
    given = [f"--log.{name}" for name, value in vars(log).items() if value is not None]
    if given and logger_name in ("tensorboard", "csv"):
        raise UserError(
            f"{', '.join(given)} names a wandb or MLflow run; with --logger_name {logger_name} it would be"
            " ignored: add --logger_name wandb or mlflow, or drop it"
        )
    if log.group is not None and logger_name == "mlflow":
        raise UserError("--log.group is wandb's; MLflow has no run groups: drop it, or use --logger_name wandb")
    if logger_name in ("wandb", "mlflow"):
        try:
            __import__(logger_name)
        except ImportError:
            install = "wandb" if logger_name == "wandb" else "mlflow (or mlflow-skinny)"
            raise UserError(
                f"--logger_name {logger_name} needs the {logger_name} package, which is not installed:"
                f" pip install {install}, or use --logger_name tensorboard or csv"
            ) from None
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
        return MLFlowLogger(
            experiment_name=project,
            run_name=name,
            tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"),
            save_dir=str(run_dir / "mlruns"),
        )
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    if logger_name == "tensorboard":
        _quiet_tensorboard_writer_thread()
    logger_class = TensorBoardLogger if logger_name == "tensorboard" else CSVLogger
    return logger_class(root_dir=str(run_dir), name="", version="")


def flush_logger(logger, status: str = "success") -> None:
    """The logger's rows written, or its file left as it was: Lightning's CSV logger appends to ``metrics.csv``, and
    a full disk left a half-written row there (a 0-byte file where it was the first flush)."""
    writer = getattr(logger, "_experiment", None)  # the CSV logger's writer, where it has made one
    path = Path(writer.metrics_file_path) if hasattr(writer, "metrics_file_path") else None
    before = path.stat().st_size if path is not None and path.is_file() else None
    try:
        logger.finalize(status)
    except OSError:
        if path is not None and path.is_file():
            if before is None:
                path.unlink()
            else:
                os.truncate(path, before)
        raise


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard's writer thread prints its failure's traceback, then the run's next write raises it again, where
    ``KeptGoing`` says it in one line: the thread's own traceback is left unprinted (only that thread's, only an
    ``OSError``; every other thread's exceptions are printed as before)."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def excepthook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    excepthook.quiets_tensorboard = True
    threading.excepthook = excepthook
