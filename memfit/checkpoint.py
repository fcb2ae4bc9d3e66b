"""Checkpoints that are never half-written, and resuming from the latest one.

A checkpoint is a directory ``out_dir/step-000020/`` (or ``final/``) holding the weights in litgpt's file name
(``lit_model.pth.lora`` for LoRA, so ``litgpt merge_lora`` reads it), ``training_state.pth`` (optimizer,
scheduler, step counters, data position, RNG) and ``hyperparameters.yaml`` (loadable with ``--config``). It is
written under a temporary name and renamed into place, so a crash leaves either the whole directory or none.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _plain(value: Any) -> Any:
    """Hyperparameters as YAML jsonargparse reads back: dataclasses as dicts, DataModules as class_path/init_args."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        if hasattr(value, "prepare_data"):  # a DataModule
            return {"class_path": f"{type(value).__module__}.{type(value).__qualname__}", "init_args": fields}
        return fields
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def save_checkpoint(
    fabric,
    out_dir: Path,
    name: str,
    weights_file: str,
    model: torch.nn.Module,
    state: dict,
    hparams: dict,
    weights_filter: Callable | None = None,
    extra_files: list[Path] = (),
) -> Path:
    """Writes ``out_dir/name/`` atomically. Every rank must call it (sharded strategies write from all ranks)."""
    final = out_dir / name
    staging = out_dir / f".{name}.tmp"
    if fabric.global_rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    fabric.barrier()
    filters = {"model": weights_filter} if weights_filter is not None else None
    fabric.save(staging / weights_file, {"model": model}, filter=filters)
    fabric.save(staging / "training_state.pth", state)
    if fabric.global_rank == 0:
        (staging / "hyperparameters.yaml").write_text(yaml.safe_dump(_plain(hparams), sort_keys=False))
        for extra in extra_files:
            if extra.is_file():
                shutil.copy2(extra, staging / extra.name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    fabric.barrier()
    return final


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The highest ``step-N`` directory; in-progress (``.tmp``) directories are never returned."""
    steps = [(int(m.group(1)), p) for p in out_dir.glob("step-*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return max(steps)[1] if steps else None


def load_checkpoint(fabric, checkpoint: Path, weights_file: str, model: torch.nn.Module, state: dict) -> None:
    """Restores the weights (strict=False: LoRA checkpoints hold only the trainable part) and the training state."""
    fabric.load(checkpoint / weights_file, {"model": model}, strict=False)
    fabric.load(checkpoint / "training_state.pth", state)
