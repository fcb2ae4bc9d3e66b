"""What a resumed run must keep: the settings of the checkpoint it continues, compared flag by flag with those given
(``hyperparameters.yaml``), with the few a resume may change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memfit.args import TrainArgs
from memfit.errors import UserError
from memfit.training.checkpoint import plain_hparams
from memfit.training.embedded import embedded_data_of
from memfit.training.optim import OPTIMIZERS

# Settings that only change what is measured or logged, or how the data is read: a resumed run may change them
# (the data's order is Memfit's sampler's, whatever the number of loader workers).
_CHANGEABLE_ON_RESUME = (
    "resume",
    "resume_with_changed_data",
    "out_dir",
    "overwrite",
    "eval.",
    "profile.",
    "profile_dir",
    "logger_name",
    "log.",
    "memory_budget",
    "train.log_interval",
    "train.save_interval",
    "data.num_workers",
    # the same training in less memory, as the out-of-memory explanation suggests: the global batch
    # stays (accumulation is exact), and a block's activations are recomputed, not changed
    "train.micro_batch_size",
    "activation_checkpointing",
    # the same global batch over more or fewer processes: the data position is kept in global
    # samples, and a sharded (FSDP) checkpoint is resharded on load
    "devices",
    "num_nodes",
    # the same training on another kind of device (a run rehearsed on the CPU, continued on a GPU): the checkpoint
    # holds no device tensors, and a generator the other device lacks is said when resuming
    "accelerator",
    # the same training in compiled kernels (a run started eager and continued compiled, or the other way)
    "compile",
    # the same all-reduce with DDP's buckets as the gradients' storage or beside them: memory, not the update
    "ddp.",
)


def check_resume_settings(checkpoint: Path, stored: dict, hparams: dict) -> None:
    """A resumed run continues with the settings it was started with (``stored``: those of ``checkpoint``, read by
    ``memfit.settings.resolve.resume_point``); a changed one is refused, not recorded. With
    ``--resume_with_changed_data`` the data's settings may change too."""
    compare_settings(
        checkpoint / "hyperparameters.yaml",
        _flatten(stored),
        _flatten(plain_hparams(hparams)),
        changed_data=bool(hparams.get("resume_with_changed_data")),
    )


_NEWER_SCRIPT_FLAGS = {"sample_order": "longest_early"}
"""Flags of the scripts' own signatures that a checkpoint saved before they existed does not record, with the value
such a run trained with (memfit never reads a script's signature). A ``--train.*`` flag needs no entry: its declared
default (``_declared_default``) is what a run trained with before the flag existed."""


def _declared_default(key: str):
    """The default ``memfit.args.TrainArgs`` declares for ``train.NAME``; for a script's flag, its entry above."""
    if key.startswith("train."):
        declared = {field.name: field for field in dataclasses.fields(TrainArgs)}.get(key.removeprefix("train."))
        if declared is not None and declared.default is not dataclasses.MISSING:
            return declared.default
        return _NO_DEFAULT
    return _NEWER_SCRIPT_FLAGS.get(key, _NO_DEFAULT)


_NO_DEFAULT = object()


def compare_settings(stored_file: Path, stored: dict, given: dict, changed_data: bool) -> None:
    for key in sorted(given.keys() | stored.keys()):
        if key.startswith(_CHANGEABLE_ON_RESUME) or given.get(key) == stored.get(key):
            continue
        if key not in stored and given.get(key) == _declared_default(key):
            continue  # a flag newer than the checkpoint, at the value the run trained with
        if changed_data and (key == "data" or key.startswith("data.")):
            continue
        if key == "optimizer" and all(
            isinstance(name, str) and name in OPTIMIZERS and OPTIMIZERS[name].torch_adamw
            for name in (given.get(key), stored.get(key))
        ):
            continue  # PyTorch's AdamW kernels: the same update and the same state, so a resume may switch kernel
        if key == "checkpoint_dir" and stored.get(key) is None and embedded_data_of(Path(given.get(key) or "")):
            continue  # runs on the embedded default recorded no checkpoint_dir before it was recorded by path
        raise UserError(
            f"--resume: --{key} is {given.get(key)!r} here but {stored.get(key)!r} in the run being resumed"
            f" ({stored_file}); a resumed run keeps its settings: drop --{key}, or start a new run in a fresh --out_dir"
        )


def _flatten(values: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": x}}`` as ``{"train.lr": x}``; a data module as ``data`` (its class) and ``data.FIELD``, the
    flags that set them."""
    flat = {}
    for key, value in values.items():
        if not prefix and key == "data" and isinstance(value, dict) and "class_path" in value:
            flat["data"] = value["class_path"]
            flat.update(_flatten(value.get("init_args") or {}, "data."))
        elif isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
