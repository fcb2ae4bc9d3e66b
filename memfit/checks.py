"""The checks of a script's flags, run in ``setup()`` before anything is built or written.

Each function takes the flags it checks as arguments and raises ``UserError`` with one line naming the bad value
and the fix; the scripts declare the flags themselves.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch
import yaml
from litgpt import Config
from litgpt.tokenizer import Tokenizer

from memfit.args import AdapterArgs, EvalArgs, FSDPArgs, TrainArgs, check_batch_sizes
from memfit.checkpoint import latest_checkpoint, missing_dirs, plain_hparams, step_checkpoints
from memfit.data import check_streaming
from memfit.embedded import embedded_data_of, ensure_embedded
from memfit.errors import UserError
from memfit.nf4 import import_nf4
from memfit.optim import float16_adamw_warning, resolve_optimizer
from memfit.precision import (
    PRECISION_ALIASES,
    check_combination,
    default_precision,
    resolve_accelerator,
    slow_half_precision_on_this_cpu,
)
from memfit.profiling import ProfileArgs
from memfit.strategy import check_fsdp


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
    else:
        checkpoint_dir = Path(checkpoint_dir)
        if not checkpoint_dir.exists() and (Path("checkpoints") / checkpoint_dir).is_dir():
            checkpoint_dir = Path("checkpoints") / checkpoint_dir  # litgpt's `org/name` under checkpoints/
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
    precision = PRECISION_ALIASES.get(str(precision), precision) or default_precision(accelerator, planned=estimate)
    if devices == "auto":  # as litgpt: every GPU the process sees
        devices = torch.cuda.device_count() if accelerator == "cuda" and torch.cuda.is_available() else 1
    check_combination(precision, quantize)
    if precision == "16-mixed" and accelerator == "cpu":
        raise UserError("--precision 16-mixed needs a GPU; on CPU use bf16-mixed or bf16-true")
    if devices < 1 or num_nodes < 1:
        raise UserError(f"--devices {devices} / --num_nodes {num_nodes}: both must be at least 1")
    if num_nodes > 1 and not estimate:
        check_launcher(num_nodes)
    check_fsdp(fsdp, precision, strategy)
    if quantize == "torchao.nf4":
        import_nf4()  # installed, or a one-line refusal before anything is built
        if devices * num_nodes > 1 and strategy == "ddp":
            raise UserError(
                "--quantize torchao.nf4 on several processes needs --strategy fsdp or auto (each rank"
                " holds its shard of the 4-bit base); DDP would replicate it"
            )
        if devices * num_nodes == 1 and strategy == "fsdp":  # torchao's all-gather hook expects a real all-gather
            raise UserError(
                "--quantize torchao.nf4 --strategy fsdp needs 2 processes or more (torchao's NF4 fails"
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


def check_launcher(num_nodes: int) -> None:
    """Several nodes need a rendezvous that every node agrees on. Without a launcher Fabric recognises, it falls back
    to 127.0.0.1, a random port and node rank 0, and the first process waits for the other nodes forever."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

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
        quantize
        and quantize.startswith("bnb.")
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


def check_run_dirs(
    out_dir: Path,
    profile_dir: Path,
    resume_from: Path | None,
    overwrite: bool,
    estimate: bool,
    reads: dict[str, Path] | None = None,
) -> None:
    """Writable directories, and an out_dir that holds no earlier run unless told what to do with it; ``--overwrite``
    never deletes what the run ``reads`` (``run_inputs``): a merged ``final/`` is the base of the next run."""
    if not estimate:
        check_writable("--out_dir", Path(out_dir))
        check_writable("--profile_dir", Path(profile_dir))
    earlier = earlier_run(Path(out_dir))
    if overwrite and not estimate:
        for name in earlier:
            deleted = (Path(out_dir) / name).resolve()
            for flag, path in (reads or {}).items():
                if path.resolve() == deleted or deleted in path.resolve().parents:
                    raise UserError(
                        f"--overwrite true would delete {str(Path(out_dir) / name)!r}, which {flag} {str(path)!r}"
                        " reads; choose another --out_dir (or move that checkpoint out of it first)"
                    )
    if earlier and not (resume_from or overwrite or estimate):
        if "final" in earlier:  # nothing to continue: a resumed run keeps its settings, --train.max_steps included
            raise UserError(
                f"--out_dir {str(out_dir)!r} already holds a finished run (final); choose a fresh"
                " --out_dir, or replace it with --overwrite true"
            )
        raise UserError(
            f"--out_dir {str(out_dir)!r} already holds an unfinished run ({', '.join(earlier[:3])}); continue it with"
            " --resume true, choose a fresh --out_dir, or replace it with --overwrite true"
        )


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


def check_pretraining_dirs(tokenizer_dir: Path | None, initial_checkpoint_dir: Path | None) -> None:
    """litgpt pretraining's --tokenizer_dir and --initial_checkpoint_dir: each holds what it is named for."""
    tokenizers = ("tokenizer.json", "tokenizer.model")
    if tokenizer_dir is not None and not any((Path(tokenizer_dir) / name).is_file() for name in tokenizers):
        raise UserError(f"--tokenizer_dir {str(tokenizer_dir)!r} holds no tokenizer.json or tokenizer.model")
    if initial_checkpoint_dir is not None:
        check_full_weights("--initial_checkpoint_dir", Path(initial_checkpoint_dir))
        if not (Path(initial_checkpoint_dir) / "lit_model.pth").is_file():
            raise UserError(
                f"--initial_checkpoint_dir {str(initial_checkpoint_dir)!r} holds no lit_model.pth; give a"
                " litgpt checkpoint dir"
            )


def check_full_weights(flag: str, checkpoint_dir: Path) -> None:
    """A fine-tuning run's output dir holds only the method's weights: say so, and how to get a full checkpoint."""
    if (checkpoint_dir / "lit_model.pth").is_file():
        return
    if (checkpoint_dir / "lit_model.pth.lora").is_file():
        raise UserError(
            f"{flag} {str(checkpoint_dir)!r} holds LoRA weights only (lit_model.pth.lora); merge them into"
            f" its base model first with `litgpt merge_lora {checkpoint_dir}`, then give the same dir"
        )
    for method in ("adapter", "adapter_v2"):
        if (checkpoint_dir / f"lit_model.pth.{method}").is_file():
            raise UserError(
                f"{flag} {str(checkpoint_dir)!r} holds {method} weights only (lit_model.pth.{method}),"
                " which litgpt cannot merge; give the base checkpoint dir they were trained on (its"
                " checkpoint_dir in hyperparameters.yaml)"
            )


def refuse_quantize(script: str, quantize: str | None) -> None:
    """For methods that train every weight: quantized weights cannot train."""
    if quantize:
        raise UserError(
            f"--quantize {quantize}: {script} trains every weight, and quantized weights cannot"
            " train; use finetune/lora.py or the adapter scripts for a quantized base, or drop --quantize"
        )


def run_name(
    script: str, checkpoint_dir: Path | None, model_name: str | None, embedded: bool, profile_dir: Path
) -> str:
    """The run's profile dir name: script, model, time and pid (unique even for runs started together)."""
    model = (model_name or ("embedded" if embedded else Path(checkpoint_dir).name)).replace(os.sep, "-")
    # Processes started by Fabric's launcher must agree on the name, so the first one hands it down.
    if os.environ.get("LOCAL_RANK", "0") != "0" or os.environ.get("NODE_RANK", "0") != "0":
        inherited = os.environ.get("MEMFIT_RUN_NAME")
        if inherited:
            return inherited
    # The pid keeps two processes started in the same second apart; the suffix, two runs of one process.
    base = f"{script}-{model}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    name, n = base, 1
    while (profile_dir / name).exists():
        n += 1
        name = f"{base}-{n}"
    os.environ["MEMFIT_RUN_NAME"] = name
    return name


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


def check_checkpoint_dir(checkpoint_dir: Path, needs_tokenizer: bool) -> None:
    """A readable model_config.yaml that litgpt's Config accepts, and a tokenizer litgpt can load."""
    config_file = checkpoint_dir / "model_config.yaml"
    try:
        config = yaml.safe_load(config_file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise UserError(f"{config_file} is not valid YAML{line}; restore it from the model's checkpoint") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} holds a {type(config).__name__}, not litgpt's model settings")
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise UserError(f"{config_file}: {unknown[0]!r} is not a litgpt Config field; fix or remove it")
    if needs_tokenizer and not any((checkpoint_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(
            f"--checkpoint_dir {str(checkpoint_dir)!r} has no tokenizer (tokenizer.json or tokenizer.model);"
            " copy it from the model's original files (litgpt download fetches it)"
        )


def check_vocabulary(tokenizer_dir: Path, config: Config, flag: str = "--checkpoint_dir") -> None:
    """A tokenizer whose ids the model's embedding can take: a larger one (another model's) failed at step 1 with an
    IndexError from the embedding."""
    vocab = Tokenizer(tokenizer_dir).vocab_size
    if vocab > config.padded_vocab_size:
        raise UserError(
            f"{flag} {str(tokenizer_dir)!r}: its tokenizer has {vocab:,} tokens but the model's vocabulary holds"
            f" {config.padded_vocab_size:,} (padded_vocab_size): they are not the same model's; use the tokenizer"
            " the model was trained with"
            + (", or a model_config whose vocabulary fits it" if flag == "--tokenizer_dir" else "")
        )


def check_writable(flag: str, path: Path) -> None:
    """Refuses a directory that cannot be created or written, before any work (not at the first save)."""
    missing = missing_dirs(path)
    for link in missing:
        if link.is_symlink():  # a link whose target is gone: creating the directory would fail on the link
            raise UserError(
                f"{flag} {str(path)!r} cannot be created: {str(link)!r} is a link to"
                f" {os.readlink(link)!r}, which does not exist; create that, or remove the link"
            )
    existing = missing[-1].parent if missing else path  # the nearest directory (or file) that is there
    if not existing.is_dir():
        raise UserError(f"{flag} {str(path)!r} cannot be created: {str(existing)!r} is a file; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {str(path)!r} is not writable (no write permission on {str(existing)!r})")


def earlier_run(out_dir: Path) -> list[str]:
    """The checkpoint directories an earlier run left in ``out_dir``."""
    if not out_dir.is_dir():
        return []
    return sorted(
        (p.name for p in out_dir.iterdir() if p.is_dir() and (p.name == "final" or p.name.startswith("step-"))),
        reverse=True,
    )


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
)
# PyTorch's AdamW kernels: the same update and the same state, so a resumed run may switch between them
_ADAMW_KERNELS = {"AdamW", "AdamW-foreach", "AdamW-for-loop"}


def check_resume_settings(checkpoint: Path, hparams: dict) -> Path:
    """A resumed run continues with the settings it was started with; a changed one is refused, not recorded.

    Returns the checkpoint to resume: ``checkpoint``, or where its ``hyperparameters.yaml`` is missing or unreadable
    (a checkpoint damaged after it was written), the latest earlier step-* in the same directory whose file is whole,
    with a warning, as ``load_for_resume`` does for damaged weights. With ``--resume_with_changed_data`` the data's
    settings may change too."""
    candidates = [checkpoint, *[c for c in step_checkpoints(checkpoint.parent) if c.name < checkpoint.name]]
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
            print(f"warning: {stored_file} cannot be read ({reason}); trying the previous checkpoint")
            continue
        compare_settings(
            stored_file,
            _flatten(stored),
            _flatten(plain_hparams(hparams)),
            changed_data=bool(hparams.get("resume_with_changed_data")),
        )
        return candidate
    raise UserError(
        f"--resume: no step-* checkpoint in {str(checkpoint.parent)!r} has a readable hyperparameters.yaml"
        " (the settings it must continue with); start a new run in a fresh --out_dir"
    )


def compare_settings(stored_file: Path, stored: dict, given: dict, changed_data: bool) -> None:
    for key in sorted(given.keys() | stored.keys()):
        if key.startswith(_CHANGEABLE_ON_RESUME) or given.get(key) == stored.get(key):
            continue
        if changed_data and (key == "data" or key.startswith("data.")):
            continue
        if key == "optimizer" and {given.get(key), stored.get(key)} <= _ADAMW_KERNELS:
            continue
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
