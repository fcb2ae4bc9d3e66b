"""What a script's flags become, run in ``setup()`` before anything is built: the checkpoint dir (the embedded default
built on first use), the accelerator, precision and devices, the training's derived settings, the checkpoint to
resume from, the run's name and its recorded settings. Whether a flag is allowed is checked by what it is about
(``flag_values``, ``model_source``, ``run_dirs``, ``resume_settings`` in this package); a resolution that meets a bad
value raises ``UserError`` with one line, as a check does.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
from litgpt import Config

from memfit.args import EvalArgs, FSDPArgs, ProfileArgs, TrainArgs, check_batch_sizes
from memfit.errors import UserError
from memfit.settings.flag_values import check_launcher, check_numbers, check_profile
from memfit.settings.model_source import check_checkpoint_dir, check_full_weights
from memfit.training.data import check_streaming
from memfit.training.embedded import embedded_data_of, ensure_embedded
from memfit.training.loading import check_checkpoint_file
from memfit.training.optim import float16_adamw_warning, resolve_optimizer
from memfit.training.out_dir import latest_checkpoint
from memfit.training.precision import (
    PRECISION_ALIASES,
    check_combination,
    default_precision,
    resolve_accelerator,
    slow_half_precision_on_this_cpu,
)
from memfit.training.quantizers import quantize_kind
from memfit.training.strategy import check_fsdp
from memfit.training.torchao_nf4 import import_nf4

PRETRAINING_ONLY = ("train.tie_embeddings",)
"""Flags of litgpt's ``TrainArgs`` that only pretraining honours: a fine-tuning script refuses them (``resolve_training``)
and leaves them out of its --help (``memfit.settings.cli.CLI``'s ``hidden``)"""


def resolve_checkpoint_dir(
    checkpoint_dir: Path | None, data, model_name: str | None, estimate: bool, pretraining: bool = False
) -> tuple[Path | None, Path | None, str | None]:
    """``(checkpoint dir, embedded data file, model name)``: the user's litgpt checkpoint dir (``org/name`` looked up
    under checkpoints/, as litgpt does), or the embedded default, generated locally, with its dataset. The data is
    checked to be a kind the scripts read. An estimate needs no weights: a checkpoint dir that is not on this machine
    (a recipe's, estimated on a login node) gives way to --model_name, or to litgpt's architecture of its name."""
    if not estimate:  # an estimate reads no data from a streaming module: it needs neither litdata nor the dirs
        check_streaming(data)
    if model_name is not None:
        try:
            Config.from_name(model_name)
        except ValueError:
            raise UserError(
                f"--model_name {model_name!r} is not in litgpt's config table (e.g. Llama-2-7b-hf)"
            ) from None
    # a dir that is here but is not a litgpt checkpoint is refused below, saying why
    if (
        estimate
        and checkpoint_dir is not None
        and not any(where.exists() for where in (Path(checkpoint_dir), "checkpoints" / Path(checkpoint_dir)))
    ):
        name = model_name or litgpt_name(Path(checkpoint_dir).name)
        if name is not None:
            print(
                f"note: --checkpoint_dir {str(checkpoint_dir)!r} is not on this machine; the estimate needs no weights"
                f" and uses litgpt's {name} architecture"
            )
            checkpoint_dir, model_name = None, name
    embedded_json = None
    if checkpoint_dir is None and estimate and model_name is not None:
        pass  # the architecture comes from litgpt's table: nothing to load, so nothing to generate
    elif checkpoint_dir is None and model_name is not None and not pretraining:
        # the embedded weights are no named architecture's: loading them would fail on the first mismatched shape
        raise UserError(
            f"--model_name {model_name!r} without --checkpoint_dir: fine-tuning needs that model's weights;"
            " give its checkpoint dir (as `litgpt download` makes it), or add --estimate true to predict"
            " its memory without them"
        )
    elif checkpoint_dir is None:
        checkpoint_dir, embedded_json = ensure_embedded()
        if not estimate and not pretraining:
            check_checkpoint_file(checkpoint_dir / "lit_model.pth")
    else:
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.exists() and (Path("checkpoints") / checkpoint_dir).is_dir():
            checkpoint_dir = Path("checkpoints") / checkpoint_dir  # litgpt's `org/name` under checkpoints/
        if not checkpoint_dir.exists():
            # a config hub file names the checkpoint as litgpt downloads it: the weights are not here yet
            name = litgpt_name(checkpoint_dir.name)
            repo = "/".join(checkpoint_dir.parts[-2:]) if name is not None else None
            raise UserError(
                f"--checkpoint_dir {str(checkpoint_dir)!r} is not on this machine"
                + (
                    f"; download it with `litgpt download {repo}` (it makes checkpoints/{repo}), or add --estimate"
                    " true to predict this recipe's memory without the weights"
                    if repo is not None
                    else "; give a litgpt checkpoint dir (as `litgpt download` makes it)"
                )
            )
        if not (checkpoint_dir / "model_config.yaml").is_file():
            hugging_face = (
                (checkpoint_dir / "config.json").is_file()
                and any(checkpoint_dir.glob("*.safetensors"))
                or any(checkpoint_dir.glob("pytorch_model*.bin"))
            )
            raise UserError(
                f"--checkpoint_dir {str(checkpoint_dir)!r} has no model_config.yaml; "
                + (
                    f"it holds a Hugging Face checkpoint: convert it with `litgpt convert_to_litgpt {checkpoint_dir}`"
                    " (with --model_name NAME where the dir is not named after the model; it adds lit_model.pth and"
                    " model_config.yaml), then give the same dir"
                    if hugging_face
                    else "give a litgpt checkpoint dir (as `litgpt download` makes it)"
                )
            )
        check_checkpoint_dir(checkpoint_dir, needs_tokenizer=not estimate)
        if not estimate and not pretraining:
            check_full_weights("--checkpoint_dir", checkpoint_dir)
            check_checkpoint_file(checkpoint_dir / "lit_model.pth")
        embedded_json = embedded_data_of(checkpoint_dir)  # a run's hyperparameters.yaml names the embedded dir
        if data is None and not estimate and embedded_json is None:
            raise UserError("with --checkpoint_dir, also give the data, e.g. --data JSON --data.json_path FILE")
    return checkpoint_dir, embedded_json, model_name


def litgpt_name(name: str) -> str | None:
    """The name in litgpt's config table of an architecture named as litgpt's table or Hugging Face name it (the
    name of the dir `litgpt download` makes), else None."""
    try:
        return Config.from_name(name).name
    except ValueError:
        return None


def resolve_hardware(
    accelerator: str,
    precision: str | None,
    quantize: str | None,
    devices: int | str,
    num_nodes: int,
    strategy: str,
    fsdp: FSDPArgs,
    estimate: bool,
) -> tuple[str, str, int]:
    """``(accelerator, precision, devices)`` resolved, and every impossible combination refused."""
    # An estimate plans for the target machine, which need not be this one: a GPU (nobody plans a 7B QLoRA on a
    # laptop's CPU) with a GPU's default precision, unless --accelerator cpu asks for the CPU.
    if estimate:
        accelerator = "cpu" if accelerator == "cpu" else "cuda"
    else:
        accelerator = resolve_accelerator(accelerator)
    if precision is None and quantize is not None:
        precision = quantize_kind(quantize).needs_precision  # the one it computes in, where it has one: not refused
    precision = PRECISION_ALIASES.get(str(precision), precision) or default_precision(accelerator, planned=estimate)
    if devices == "auto":  # as litgpt: every GPU the process sees
        devices = torch.cuda.device_count() if accelerator == "cuda" and torch.cuda.is_available() else 1
    check_combination(precision, quantize)
    if precision == "16-mixed" and accelerator == "cpu":
        raise UserError("--precision 16-mixed needs a GPU; on CPU use bf16-mixed or bf16-true")
    if devices < 1 or num_nodes < 1:
        raise UserError(f"--devices {devices} / --num_nodes {num_nodes}: both must be at least 1")
    if not estimate:
        check_launcher(num_nodes, devices)
    check_fsdp(fsdp, precision, strategy, num_nodes)
    if quantize is not None and quantize_kind(quantize).shards_with_fsdp:
        import_nf4()  # installed, or a one-line refusal before anything is built
        if devices * num_nodes > 1 and strategy == "ddp":
            raise UserError(
                f"--quantize {quantize} on several processes needs --strategy fsdp or auto (each rank"
                " holds its shard of the 4-bit base); DDP would replicate it"
            )
        if devices * num_nodes == 1 and strategy == "fsdp":  # torchao's all-gather hook expects a real all-gather
            raise UserError(
                f"--quantize {quantize} --strategy fsdp needs 2 processes or more (torchao's NF4 fails"
                " under FSDP on one); on one device use --strategy auto"
            )
    elif quantize and (devices * num_nodes > 1 or strategy == "fsdp"):
        raise UserError(
            f"--quantize {quantize} trains on one device: bitsandbytes' 4-bit weights lose their"
            " quantization state when FSDP shards them (benchmarks/qlora_fsdp_routes.py reproduces it);"
            " across devices use --quantize torchao.nf4 --strategy fsdp, or set --devices 1"
        )
    if not estimate and (warning := slow_half_precision_on_this_cpu(precision, accelerator)):
        print(warning)
    return accelerator, precision, devices


def resolve_training(
    train: TrainArgs,
    eval: EvalArgs,
    profile: ProfileArgs,
    optimizer: str | dict,
    optimizer_in_backward: bool,
    strategy: str,
    world_size: int,
    seed: int,
    precision: str,
    pretraining: bool = False,
    quantize: str | None = None,
) -> tuple[TrainArgs, str, dict, int]:
    """``(train, optimizer name, optimizer arguments, micro-batches per step)``; out-of-range values refused, and
    a warning for a float16 AdamW that can diverge. ``precision``: resolved (resolve_hardware).
    ``pretraining``: the script pretrains, which in litgpt honours --train.tie_embeddings and --train.min_lr."""
    if (
        quantize is not None
        and quantize_kind(quantize).library == "bitsandbytes"
        and isinstance(optimizer, dict)
        and optimizer.get("class_path") == "torch.optim.AdamW"
    ):
        # a litgpt file's optimizer block: litgpt's fine-tuning swaps it for bitsandbytes' PagedAdamW under --quantize
        # bnb.* (its instantiate_bnb_optimizer); Memfit keeps what the file names
        print(
            f"warning: litgpt trains --quantize {quantize} with bitsandbytes' PagedAdamW in place of the"
            " torch.optim.AdamW this config names (the same update; its state can page out to host memory under"
            " pressure); Memfit runs the AdamW named, its state on the device, as the estimate counts it: for"
            " litgpt's choice set the block's class_path to bitsandbytes.optim.PagedAdamW"
        )
    if not 0 <= seed < 2**32:  # Lightning's seed_everything seeds NumPy too, which takes 32 bits
        raise UserError(f"--seed {seed} must be between 0 and {2**32 - 1}")
    optimizer, schedule, optimizer_args = resolve_optimizer(optimizer)
    if schedule:  # litgpt keeps lr and weight decay in the optimizer block: they become the schedule's
        train = dataclasses.replace(train, **schedule)
    accumulation = check_batch_sizes(train, world_size)
    check_numbers(train, eval)
    check_profile(profile)
    if train.tie_embeddings is not None and not pretraining:  # as litgpt's fine-tuning scripts
        raise UserError("--train.tie_embeddings is for pretraining: fine-tuning keeps the base model's head; drop it")
    if optimizer_in_backward and accumulation > 1:
        raise UserError(
            "--optimizer_in_backward steps during backward, so it needs --train.global_batch_size equal to"
            f" micro_batch_size x devices (now {accumulation} micro-batches per step)"
        )
    if optimizer_in_backward and train.max_norm:
        raise UserError(
            f"--optimizer_in_backward steps during backward, before clipping could see the whole gradient:"
            f" it needs --train.max_norm null (now {train.max_norm})"
        )
    if optimizer_in_backward and strategy == "fsdp":
        raise UserError("--optimizer_in_backward is not supported with --strategy fsdp; drop one of them")
    if optimizer_in_backward and world_size > 1:  # its hooks run before DDP's all-reduce has averaged the gradient
        raise UserError(
            f"--optimizer_in_backward steps each rank on its own gradient, before DDP averages it over the"
            f" {world_size} processes: the ranks would drift apart; use it on one device"
        )
    if optimizer_in_backward and precision == "16-mixed":  # its hooks step on the scaled gradients, unchecked
        raise UserError(
            "--optimizer_in_backward steps inside backward, before 16-mixed's gradient scaler unscales the"
            " gradients or skips an overflow: use --precision bf16-mixed, bf16-true or 32-true with it"
        )
    if warning := float16_adamw_warning(precision, optimizer, optimizer_args):
        print(warning)
    if not pretraining and train.min_lr not in (0, TrainArgs.min_lr):  # hub files give 4e-5, ignored by litgpt
        print(
            f"warning: --train.min_lr {train.min_lr:g} is not used in fine-tuning: after the warm-up the learning"
            " rate decays to 0, as in litgpt's fine-tuning scripts (pretraining decays to min_lr)"
        )
    return train, optimizer, optimizer_args, accumulation


def resolve_resume(
    resume: bool | str | Path, out_dir: Path, overwrite: bool, with_changed_data: bool = False
) -> Path | None:
    """The step-* checkpoint a run continues from, in litgpt's forms: ``true``, the latest in out_dir (there must be
    one); ``auto``, the latest if there is one, else a fresh start; a path, that checkpoint dir (or a file in it)."""
    if resume is False:
        if with_changed_data:
            raise UserError("--resume_with_changed_data true applies to a resumed run: add --resume, or drop it")
        return None
    if overwrite:
        raise UserError(f"--resume {resume} and --overwrite true contradict each other: give one of them")
    if resume is True or resume == "auto":
        if (Path(out_dir) / "final").is_dir():  # its step-* checkpoints are kept, but the run has nothing left to do
            raise UserError(
                f"--resume {str(resume).lower()}: the run in --out_dir {str(out_dir)!r} is finished (final);"
                " nothing to continue: replace it with --overwrite true, or choose a fresh --out_dir"
            )
        latest = latest_checkpoint(Path(out_dir))
        if latest is None and resume is True:
            finished = " (the run there finished: final)" if (Path(out_dir) / "final").is_dir() else ""
            raise UserError(f"--resume: no step-* checkpoint in --out_dir {str(out_dir)!r}{finished}")
        return latest
    checkpoint = Path(resume)
    checkpoint = checkpoint.parent if checkpoint.is_file() else checkpoint  # litgpt points at the .pth file
    if not (checkpoint / "training_state.pth").is_file():
        raise UserError(
            f"--resume {str(resume)!r} is not a checkpoint Memfit wrote (no training_state.pth there);"
            " give a step-* dir, or true/auto for the latest in --out_dir"
        )
    return checkpoint


def run_inputs(data, **paths: Path | None) -> dict[str, Path]:
    """What a run reads from disk, by flag: ``paths`` (``checkpoint_dir=...``) and the data module's files and
    directories (``--data.json_path``, ``--data.train_data_path``, ...)."""
    inputs = {f"--{name}": Path(path) for name, path in paths.items() if path is not None}
    if data is not None and dataclasses.is_dataclass(data):
        for field in dataclasses.fields(data):
            value = getattr(data, field.name, None)
            if isinstance(value, (str, Path)) and "://" not in str(value) and Path(value).exists():
                inputs[f"--data.{field.name}"] = Path(value)
    return inputs


def run_hparams(flags: dict, train: TrainArgs, precision: str, checkpoint_dir: Path | None) -> dict:
    """What ``hyperparameters.yaml`` records: the flags as given (so ``--config`` reproduces the run), ``train`` as
    resolved, and what litgpt's tools read back: the precision used and the base checkpoint by absolute path
    (``litgpt merge_lora`` then finds it from any working directory), the embedded default's too (``--config`` of
    the file then runs on the embedded data again, see ``resolve_checkpoint_dir``)."""
    hparams = {name: value for name, value in flags.items() if name != "estimate"} | {"train": train}
    if checkpoint_dir is not None:
        hparams["checkpoint_dir"] = str(Path(checkpoint_dir).resolve())
    hparams["precision"] = precision
    return hparams


def model_label(checkpoint_dir: Path | None, model_name: str | None, embedded: bool) -> str:
    """The model as a profile dir's name gives it: the --model_name, "embedded", or the checkpoint dir's name (its
    first 100 characters: the run's name adds about 40 and must stay within a file system's 255 bytes)."""
    return (model_name or ("embedded" if embedded else Path(checkpoint_dir).name)).replace(os.sep, "-")[:100]


def run_name(
    script: str, checkpoint_dir: Path | None, model_name: str | None, embedded: bool, profile_dir: Path
) -> str:
    """The run's profile dir name: script, model, time and pid (unique even for runs started together). Each process
    of a run names it; the scripts take rank 0's name (``fabric.broadcast`` in ``main``)."""
    model = model_label(checkpoint_dir, model_name, embedded)
    # The pid keeps two processes started in the same second apart; the suffix, two runs of one process.
    base = f"{script}-{model}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    name, n = base, 1
    while (profile_dir / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name
