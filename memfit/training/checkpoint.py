"""Checkpoints that are never half-written, and resuming from the latest one.

A checkpoint is a directory ``out_dir/step-000020/`` (or ``final/``) holding the weights in litgpt's file name
(``lit_model.pth.lora`` for LoRA, so ``litgpt merge_lora`` reads it), ``training_state.pth`` (optimizer,
scheduler, step counters, data position, RNG) and ``hyperparameters.yaml`` (loadable with ``--config``). It is
written under a temporary name and renamed into place, so a crash leaves either the whole directory or none.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

import torch
import yaml
from lightning.fabric.plugins import TorchCheckpointIO
from litgpt.prompts import PromptStyle, prompt_styles, save_prompt_style
from litgpt.utils import save_config
from torch.distributed.checkpoint.api import CheckpointException

from memfit.errors import UserError
from memfit.files import mark_as_written_by_memfit
from memfit.training.loop_parts import gradient_scaler
from memfit.training.out_dir import EARLIER_RUN, SHARDED_DIR, STEP_DIR, remove_own, step_checkpoints, written_by_memfit

WEIGHTS_FILES = {
    "lora": "lit_model.pth.lora",  # `litgpt merge_lora` reads it
    "adapter": "lit_model.pth.adapter",  # litgpt's `generate/adapter` reads it
    "adapter_v2": "lit_model.pth.adapter_v2",  # litgpt's `generate/adapter_v2` reads it
    "full": "lit_model.pth",  # a whole model
    "pretrain": "lit_model.pth",
}
"""The file each script's checkpoints hold their weights in: litgpt's names, which its tools read"""

# what litgpt copies into its own checkpoints, so its tools (and Hugging Face conversion) find them
_BASE_FILES = (
    "model_config.yaml",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
)


class CheckpointFiles(TorchCheckpointIO):
    """Fabric's checkpoint writer for one device and DDP, writing each file where it is asked to.

    Lightning's own (``TorchCheckpointIO``) serialises the whole file into memory, then writes it through an fsspec
    transaction that stages it in ``$TMPDIR``: with a small ``/tmp`` a save fails however much room the out_dir has,
    a full disk is reported as ``/tmp/tmpXXXX``'s, and a run killed while saving leaves a copy of the weights there.
    ``save_checkpoint`` (below) already writes into a staging directory beside the destination and renames it into
    place, so the file is written straight into it, through a Python file (whose write errors, a full disk's ENOSPC,
    are ``OSError``: torch's own file writer reports them as a bare RuntimeError).
    """

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        write_file(checkpoint, Path(path))


def write_file(obj: Any, path: Path) -> None:
    """``torch.save`` into ``path``; a write error (a full disk, a quota) is raised as the ``OSError`` it is."""
    with open(path, "wb") as f:
        writes = _Writes(f)
        try:
            torch.save(obj, writes)
        except RuntimeError:  # torch's zip writer swallows the file's error and fails later on its own
            if writes.error is not None:
                raise writes.error from None
            raise


class _Writes:
    """A file that remembers its first write error, for ``write_file``."""

    def __init__(self, file) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.file.flush()


def base_files(checkpoint_dir: Path) -> list[Path]:
    """The base model's config and tokenizer files, which travel with every checkpoint as in litgpt."""
    return [checkpoint_dir / name for name in _BASE_FILES]


def rng_states(device: torch.device) -> dict:
    """The random generators a resumed run must continue: the CPU's, and the GPU's where dropout (LoRA's too) draws
    from the device's own generator."""
    states = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def every_rank_rng_states(fabric) -> list[dict]:
    """Each rank's ``rng_states``, gathered to every rank (a checkpoint is written by rank 0): LoRA's dropout draws
    from each rank's own generator, and they drift apart as the ranks' micro-batches differ in size."""
    mine = rng_states(fabric.device)
    if fabric.world_size == 1:
        return [mine]
    gathered = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, mine)
    return gathered


SECRETS = ("access_token",)  # never written into a checkpoint: it is shared with the weights


def _plain(value: Any) -> Any:
    """Hyperparameters as YAML jsonargparse reads back: dataclasses as dicts, DataModules as class_path/init_args."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init and f.name not in SECRETS
        }
        if hasattr(value, "prepare_data"):  # a DataModule
            return {"class_path": f"{type(value).__module__}.{type(value).__qualname__}", "init_args": fields}
        return fields
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, PromptStyle):  # by its registered name, which --config reads back
        return next((name for name, cls in prompt_styles.items() if type(value) is cls), type(value).__name__)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in SECRETS}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def plain_hparams(hparams: dict) -> dict:
    """The hyperparameters as ``hyperparameters.yaml`` stores them."""
    return _plain(hparams)


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
    prompt_style: PromptStyle | None = None,
    model_config=None,
) -> Path:
    """Writes ``out_dir/name/`` atomically. Every rank must call it (sharded strategies write from all ranks).

    ``model_config``: the litgpt ``Config`` the weights were trained with, written as ``model_config.yaml`` in place of
    the base checkpoint's (for whole-model checkpoints, whose architecture may come from ``--model_name``).

    The files are flushed to disk before the directory is renamed into place, and an earlier ``final/`` is moved
    aside, not deleted, until the new one is in place: a crash or power loss leaves a complete checkpoint.
    """
    final = out_dir / name
    staging = out_dir / f".{name}.tmp"
    made_staging = False
    try:
        if fabric.global_rank == 0:
            remove_own(staging)
            staging.mkdir(parents=True)  # FileExistsError where one Memfit did not write is in the way
            made_staging = True
            mark_as_written_by_memfit(staging)
        fabric.barrier()
        if is_sharded(model):
            sharded = name != "final" and _fsdp_state_dict_type(hparams) == "sharded"
            save_fsdp(fabric, staging, weights_file, model, state, weights_filter, sharded)
        else:
            filters = {"model": weights_filter} if weights_filter is not None else None
            fabric.save(staging / weights_file, {"model": model}, filter=filters)
            scaler = gradient_scaler(fabric)  # 16-mixed's scale: a resume starting at 2**16 would skip other steps
            fabric.save(
                staging / "training_state.pth",
                {
                    **state,
                    **rng_states(fabric.device),
                    "rank_rng_states": every_rank_rng_states(fabric),
                    **({"grad_scaler": scaler} if scaler is not None else {}),
                },
            )
        if fabric.global_rank == 0:
            (staging / "hyperparameters.yaml").write_text(yaml.safe_dump(plain_hparams(hparams), sort_keys=False))
            for extra in extra_files:
                if extra.is_file():
                    shutil.copy2(extra, staging / extra.name)
            if model_config is not None:
                save_config(model_config, staging)
            if prompt_style is not None:  # litgpt generate/chat then use the template the model was trained with
                save_prompt_style(prompt_style, staging)
        fabric.barrier()  # every rank's files are written
        if fabric.global_rank == 0:
            _fsync_tree(staging)
            previous = out_dir / f".{name}.old"
            remove_own(previous)
            if written_by_memfit(final):  # a final/ Memfit did not write is refused before the run starts
                os.replace(final, previous)
            os.replace(staging, final)
            _fsync(out_dir)
            remove_own(previous)
            if name == "final":  # this run is complete: the one --overwrite set aside can go
                remove_own(out_dir / EARLIER_RUN)
    except BaseException as error:  # an interrupted or failed save leaves nothing half-written behind
        if fabric.global_rank == 0 and made_staging:
            shutil.rmtree(staging, ignore_errors=True)
        disk_error = os_error_within(error)
        if disk_error is not None and disk_error.errno is not None:  # named by its destination, not its staging name
            raise OSError(disk_error.errno, disk_error.strerror, str(final)) from error
        raise
    fabric.barrier()
    return final


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by ``--strategy fsdp`` (torch's second FSDP)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def os_error_within(error: BaseException) -> OSError | None:
    """The disk's error behind a failed save: the error itself, or, from torch's distributed checkpoint (a sharded
    save, which gathers every rank's failure into one ``CheckpointException``), the first rank's ``OSError``."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            return error
        failures = getattr(error, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) else failure
                found = os_error_within(failure if isinstance(failure, BaseException) else None)
                if found is not None:
                    return found
        error = error.__cause__ or error.__context__
    return None


def reshard(model: torch.nn.Module) -> None:
    """Frees the gathered parameters of every FSDP unit. A forward without backward (validation) leaves the units
    that do not reshard after forward (the head and the root; every block with SHARD_GRAD_OP) gathered, and their
    parameters are then the whole tensors, not the shards that a checkpoint reads."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _fsdp_state_dict_type(hparams: dict) -> str:
    fsdp = hparams.get("fsdp")
    return getattr(fsdp, "state_dict_type", None) or (fsdp or {}).get("state_dict_type", "sharded")


def _unwrapped(obj):
    """The module or optimizer inside Fabric's wrapper (torch's state-dict functions take the real ones)."""
    return getattr(obj, "module", None) if hasattr(obj, "_forward_module") else getattr(obj, "optimizer", obj)


def save_fsdp(
    fabric, staging: Path, weights_file: str, model, state: dict, weights_filter: Callable | None, sharded: bool
) -> None:
    """An FSDP checkpoint, written with torch's distributed-checkpoint functions rather than ``fabric.save``:
    Fabric's ``ModelParallelStrategy`` cannot filter a sharded save (LoRA would write the whole frozen base at every
    interval) and saves nothing without the model in the same call.

    ``sharded``: the weights the filter keeps and the optimizer state go to ``sharded/``, each rank writing its own
    shards (no rank ever holds the whole model); torch reshards them on load, for another number of processes too.
    Else both are gathered to rank 0's CPU memory and written as litgpt's consolidated ``weights_file`` (``{"model":
    state_dict}``, what ``litgpt generate`` and ``merge_lora`` read) and ``training_state.pth``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    module, optimizer = _unwrapped(model), _unwrapped(state["optimizer"])
    reshard(module)
    keep = weights_filter or (lambda key, value: True)
    options = StateDictOptions(full_state_dict=not sharded, cpu_offload=not sharded)  # gathered: on rank 0 only
    weights = {k: v for k, v in get_model_state_dict(module, options=options).items() if keep(k, v)}
    optimizer_state = get_optimizer_state_dict(module, optimizer, options=options)
    rest = {
        key: value.state_dict() if hasattr(value, "state_dict") else value
        for key, value in state.items()
        if key != "optimizer"
    }
    training_state = {**rest, **rng_states(fabric.device), "rank_rng_states": every_rank_rng_states(fabric)}
    if sharded:
        dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=staging / SHARDED_DIR)
    if fabric.global_rank == 0:
        if not sharded:
            write_file({"model": weights}, staging / weights_file)
            training_state["optimizer"] = optimizer_state
        write_file(training_state, staging / "training_state.pth")


def load_fsdp(checkpoint: Path, weights_file: str, model, state: dict, weights_filter: Callable | None = None) -> dict:
    """Restores an FSDP checkpoint (``save_fsdp``), sharded or consolidated, into the sharded ``model`` and ``state``;
    returns what it holds beyond them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    module, optimizer = _unwrapped(model), _unwrapped(state["optimizer"])
    training_state = torch.load(checkpoint / "training_state.pth", weights_only=False, map_location="cpu")
    if (checkpoint / SHARDED_DIR).is_dir():
        saved = dcp.FileSystemReader(checkpoint / SHARDED_DIR).read_metadata().state_dict_metadata
        check_contents(
            checkpoint / SHARDED_DIR,
            {k[len("model.") :]: getattr(v, "size", None) for k, v in saved.items() if k.startswith("model.")},
            module,
            weights_filter,
        )
        weights = {k: v for k, v in get_model_state_dict(module).items() if f"model.{k}" in saved}
        loaded = {"model": weights, "optimizer": get_optimizer_state_dict(module, optimizer)}
        dcp.load(loaded, checkpoint_id=checkpoint / SHARDED_DIR)  # in place, each rank reading its own shards
        set_model_state_dict(module, loaded["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(module, optimizer, loaded["optimizer"])
    elif (checkpoint / weights_file).is_file() and "optimizer" in training_state:
        # every rank maps the consolidated file and keeps only its shard of each tensor
        weights = torch.load(checkpoint / weights_file, mmap=True, weights_only=True, map_location="cpu")["model"]
        check_contents(checkpoint / weights_file, {k: v.shape for k, v in weights.items()}, module, weights_filter)
        full = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(module, weights, options=full)
        set_optimizer_state_dict(module, optimizer, training_state["optimizer"], options=full)
    else:
        raise UserError(
            f"--resume: {checkpoint} holds neither sharded/ nor {weights_file} with its optimizer state:"
            " it was not written by --strategy fsdp; resume with the strategy that wrote it"
        )
    for key, value in state.items():
        if key == "optimizer" or key not in training_state:
            continue
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(training_state.pop(key))
        else:
            state[key] = training_state.pop(key)
    return training_state


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*"), reverse=True):  # files before the directories that hold them
        _fsync(path)
    _fsync(directory)


def resume_point(checkpoint: Path, warn: bool = True) -> tuple[Path, dict]:
    """The checkpoint a resume continues from, and the settings it was trained with: ``checkpoint``, or where its
    ``hyperparameters.yaml`` is missing or unreadable (a checkpoint damaged after it was written), the latest earlier
    step-* in the same directory whose file is whole, with a warning, as ``load_for_resume`` does for damaged
    weights. ``memfit.settings.resume_settings.check_resume_settings`` then compares the settings. ``warn=False``: the same
    answer without the warning (the command line reads it before the run, which warns)."""
    number = STEP_DIR.match(checkpoint.name)
    earlier = [c for c in step_checkpoints(checkpoint.parent) if number and int(c.name[5:]) < int(number.group(1))]
    candidates = [checkpoint, *earlier]
    for candidate in candidates:
        stored_file = candidate / "hyperparameters.yaml"
        try:
            stored = yaml.safe_load(stored_file.read_text())
            if not isinstance(stored, dict):
                raise ValueError(f"it holds a {type(stored).__name__}, not the run's settings")
        except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as error:
            reason = (
                "it is missing"
                if isinstance(error, FileNotFoundError)
                else (str(error).splitlines() or [type(error).__name__])[0][:120]
            )
            if warn:
                print(f"warning: {stored_file} cannot be read ({reason}); trying the previous checkpoint")
            continue
        return candidate, stored
    raise UserError(
        f"--resume: no step-* checkpoint in {str(checkpoint.parent)!r} has a readable hyperparameters.yaml"
        " (the settings it must continue with); start a new run in a fresh --out_dir"
    )


def check_contents(where: Path, saved: dict[str, Any], model: torch.nn.Module, weights_filter: Callable | None) -> None:
    """The weights a checkpoint holds (``{name: shape}``) are those the run saves, ``weights_filter``'s part of the
    model, with their shapes: a LoRA file holding a whole model would otherwise replace the base weights, and one of
    another rank or method would load nothing it trains (``strict=False`` reports neither)."""
    module = _unwrapped(model) if hasattr(model, "_forward_module") else model
    keep = weights_filter or (lambda key, value: True)
    expected = {k: v.shape for k, v in module.state_dict().items() if keep(k, v)}
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    if missing or unexpected:
        found = len(saved.keys() & expected.keys())
        raise UserError(
            f"--resume: {where} holds {found} of the {len(expected)} tensors this run trains"
            + (f" ({len(missing)} missing, e.g. {missing[0]})" if missing else "")
            + (f" and {len(unexpected)} it does not (e.g. {unexpected[0]})" if unexpected else "")
            + ": it is not this run's checkpoint; resume with the script and settings that wrote it, or start a new run"
        )
    for key, shape in expected.items():
        if saved[key] is not None and tuple(saved[key]) != tuple(shape):
            raise UserError(
                f"--resume: {where}: {key} is {tuple(saved[key])} there but {tuple(shape)} in this run's"
                " model; resume with the settings that wrote it, or start a new run"
            )


def load_checkpoint(
    fabric,
    checkpoint: Path,
    weights_file: str,
    model: torch.nn.Module,
    state: dict,
    weights_filter: Callable | None = None,
) -> dict:
    """Restores the weights (strict=False: LoRA checkpoints hold only the trainable part, ``weights_filter``'s, which
    ``check_contents`` checks), the training state and, where the run has one and the checkpoint holds it, 16-mixed's
    gradient scaler. Returns what the checkpoint holds beyond ``state``."""
    if is_sharded(model):
        return load_fsdp(checkpoint, weights_file, model, state, weights_filter)
    if not (checkpoint / weights_file).is_file():
        found = sorted(p.name for p in checkpoint.glob("lit_model.pth*"))
        raise UserError(
            f"--resume: {checkpoint} holds no {weights_file}"
            + (f" but {', '.join(found)}: it was written by another script" if found else "")
            + "; resume with the script that wrote it, or start a new run in a fresh --out_dir"
        )
    saved = torch.load(checkpoint / weights_file, mmap=True, weights_only=True, map_location="cpu")  # shapes only
    check_contents(
        checkpoint / weights_file, {k: v.shape for k, v in saved.get("model", {}).items()}, model, weights_filter
    )
    fabric.load(checkpoint / weights_file, {"model": model}, strict=False)
    rest = fabric.load(checkpoint / "training_state.pth", state)  # what state did not ask for
    if (scaler := gradient_scaler(fabric)) is not None and "grad_scaler" in rest:
        scaler.load_state_dict(rest["grad_scaler"])
    return rest


def load_for_resume(
    fabric,
    checkpoint: Path,
    weights_file: str,
    model: torch.nn.Module,
    state: dict,
    weights_filter: Callable | None = None,
) -> Path:
    """Loads ``checkpoint`` into ``model`` and ``state`` (in place) and restores the random generators; when it is
    damaged (truncated, unreadable), the step-* checkpoint before it in the same directory, and says so."""
    earlier = [c for c in step_checkpoints(checkpoint.parent) if c.name < checkpoint.name]
    for checkpoint in [checkpoint, *earlier]:
        try:
            # Only the CPU's generator is asked for by name (Fabric's load is strict): every checkpoint has it, while
            # the GPU's is there only when the run that wrote it had a GPU, and the run may have begun on another
            # device (a CPU rehearsal resumed on a GPU, or the other way round)
            loaded = state | {"rng": torch.get_rng_state()}  # Fabric replaces the RNG tensor in this dict
            rest = load_checkpoint(fabric, checkpoint, weights_file, model, loaded, weights_filter)
            per_rank = rest.get("rank_rng_states") or []
            # this rank's own generators where the checkpoint has them for the same number of ranks, else rank 0's
            rng = per_rank[fabric.global_rank] if len(per_rank) == fabric.world_size else loaded | rest
            torch.set_rng_state(rng["rng"])
            if fabric.device.type == "cuda" and "cuda_rng" in rng:
                torch.cuda.set_rng_state(rng["cuda_rng"], fabric.device)
            elif fabric.device.type == "cuda":
                fabric.print(
                    f"note: {checkpoint} was written without a GPU: the GPU's random generator (dropout) starts from"
                    " --seed here, so the rest of the run draws other dropout masks than an uninterrupted one would"
                )
            return checkpoint
        except UserError:
            raise
        except (RuntimeError, OSError, EOFError, KeyError, ValueError, UnpicklingError, CheckpointException) as error:
            reason = (str(error).splitlines() or [type(error).__name__])[0][:160]
            fabric.print(f"warning: {checkpoint} is damaged ({reason}); trying the previous checkpoint")
    raise UserError(f"--resume: no readable step-* checkpoint in {str(checkpoint.parent)!r}")
