"""The checks of a script's flags, run in ``setup()`` before anything is built or written.

Each function takes the flags it checks as arguments and raises ``UserError`` with one line naming the bad value
and the fix; the scripts declare the flags themselves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import traceback
import types
import typing
import zipfile
from pathlib import Path

import yaml
from litgpt import Config
from litgpt.tokenizer import Tokenizer

from memfit.args import AdapterArgs, EvalArgs, ProfileArgs, TrainArgs
from memfit.errors import UserError
from memfit.training.checkpoint import plain_hparams
from memfit.training.embedded import embedded_data_of
from memfit.training.optim import OPTIMIZERS
from memfit.training.out_dir import EARLIER_RUN, STEP_DIR, missing_dirs, not_memfits_message, not_written_by_memfit


def check_launcher(num_nodes: int, devices: int) -> None:
    """Under torchrun, the processes it started are the ones the flags ask for (otherwise each rank fails on a derived
    quantity, such as the global batch's share, and torchrun adds its own traceback). Several nodes need a rendezvous
    that every node agrees on: without a launcher Fabric recognises, it falls back to 127.0.0.1, a random port and
    node rank 0, and the first process waits for the other nodes forever."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if TorchElasticEnvironment.detect() and int(os.environ["WORLD_SIZE"]) != num_nodes * devices:
        started, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        raise UserError(
            f"--num_nodes {num_nodes} --devices {devices} ask for {num_nodes * devices} processes, but torchrun started"
            f" {started} ({started // per_node} node(s) of {per_node}); give --num_nodes {started // per_node}"
            f" --devices {per_node}, or start torchrun with --nnodes {num_nodes} --nproc_per_node {devices}"
        )
    if num_nodes == 1:
        return
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
    foreign = not_written_by_memfit(Path(out_dir))
    if foreign and not estimate:
        raise UserError(not_memfits_message(Path(out_dir), foreign))
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
        if earlier == [EARLIER_RUN]:
            raise UserError(
                f"--out_dir {str(out_dir)!r} holds the run an interrupted --overwrite set aside ({EARLIER_RUN});"
                " move it back to keep it, choose a fresh --out_dir, or replace it with --overwrite true"
            )
        raise UserError(
            f"--out_dir {str(out_dir)!r} already holds an unfinished run ({', '.join(earlier[:3])}); continue it with"
            " --resume true, choose a fresh --out_dir, or replace it with --overwrite true"
        )


def check_pretraining_dirs(tokenizer_dir: Path | None, initial_checkpoint_dir: Path | None) -> None:
    """litgpt pretraining's --tokenizer_dir and --initial_checkpoint_dir: each holds what it is named for."""
    tokenizers = ("tokenizer.json", "tokenizer.model")
    if tokenizer_dir is not None and not any((Path(tokenizer_dir) / name).is_file() for name in tokenizers):
        raise UserError(f"--tokenizer_dir {str(tokenizer_dir)!r} holds no tokenizer.json or tokenizer.model")
    if initial_checkpoint_dir is not None:
        check_full_weights("--initial_checkpoint_dir", Path(initial_checkpoint_dir))


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
    hugging_face = sorted(p.name for p in (*checkpoint_dir.glob("*.safetensors"), *checkpoint_dir.glob("*.bin")))
    if hugging_face:  # it was called "damaged or truncated": the file is missing, and another format is there
        raise UserError(
            f"{flag} {str(checkpoint_dir)!r} has no lit_model.pth, only Hugging Face weights ({hugging_face[0]}"
            f"{', ...' if len(hugging_face) > 1 else ''}); convert them with `litgpt convert_to_litgpt"
            f" {checkpoint_dir}`, then give the same dir"
        )
    raise UserError(
        f"{flag} {str(checkpoint_dir)!r} has no lit_model.pth; give a litgpt checkpoint dir (as `litgpt download`"
        " makes it)"
    )


def refuse_quantize(script: str, quantize: str | None) -> None:
    """For methods that train every weight: quantized weights cannot train."""
    if quantize:
        raise UserError(
            f"--quantize {quantize}: {script} trains every weight, and quantized weights cannot"
            " train; use finetune/lora.py or the adapter scripts for a quantized base, or drop --quantize"
        )


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
    check_config_values(config, str(config_file))
    if needs_tokenizer and not any((checkpoint_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise UserError(
            f"--checkpoint_dir {str(checkpoint_dir)!r} has no tokenizer (tokenizer.json or tokenizer.model);"
            " copy it from the model's original files (litgpt download fetches it)"
        )


POSITIVE_SIZES = ("block_size", "n_layer", "n_embd", "n_head", "vocab_size", "padding_multiple", "padded_vocab_size",
                  "head_size", "n_query_groups", "intermediate_size", "moe_intermediate_size", "rope_base")  # fmt: skip
"""Config fields that are sizes: a zero or negative one fails deep inside the model's construction or its first step"""


def check_config_values(config: dict, source: str) -> None:
    """Each value of a model's settings (a model_config.yaml) of the type litgpt's ``Config`` declares, the sizes
    positive, and the divisions litgpt asserts whole: otherwise the model is built, and fails (or trains with a norm
    epsilon of text) far from the line that caused it. YAML reads ``1e8`` and ``1e-5`` as text (a number needs a dot:
    ``1.0e-5``), the commonest way a hand-edited file goes wrong."""
    declared = {f.name: f.type for f in dataclasses.fields(Config)}
    for name, value in config.items():
        expected = declared[name]
        if not _of_type(value, expected):
            raise UserError(f"{source}: {name}: {value!r} is not {_type_name(expected)}{_number_hint(value, expected)}")
        if name in POSITIVE_SIZES and value is not None and value <= 0:
            raise UserError(f"{source}: {name}: {value} is not a size (a whole number above 0); fix the value")
    if config.get("norm_eps", 1e-5) <= 0:
        raise UserError(f"{source}: norm_eps: {config['norm_eps']} must be above 0; fix the value")
    if not 0 < config.get("rotary_percentage", 1.0) <= 1:
        raise UserError(
            f"{source}: rotary_percentage: {config['rotary_percentage']} is a fraction of each head (above 0, at most"
            " 1); fix the value"
        )
    try:
        Config(**config)  # litgpt's own consistency checks (n_embd a multiple of n_head, ...), as asserts
    except (AssertionError, ValueError, TypeError, ZeroDivisionError) as error:
        what = str(error) or _failed_assertion(error)
        fix = "fix the value" if source.startswith("--") else "fix the file"
        raise UserError(f"{source}: litgpt's Config refuses these settings ({what}); {fix}") from None


def _of_type(value, expected) -> bool:
    """Whether ``value`` (as YAML read it) is of the type a ``Config`` field declares."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_of_type(value, option) for option in typing.get_args(expected))
    if origin is typing.Literal:
        return value in typing.get_args(expected)
    if expected is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(expected)
        return isinstance(value, list) and all(_of_type(v, item) for v in value)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or expected)


def _number_hint(value, expected) -> str:
    """How to write a number YAML took for text (``1e8`` and ``1e-5`` without a dot, or quoted), else the fix."""
    try:
        number = float(value) if isinstance(value, str) else None
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        return "; fix the value"
    written = int(number) if _of_type(1, expected) and number.is_integer() else number
    return f" (YAML reads {value} as text, not a number): write {yaml.safe_dump(written).splitlines()[0]}"


def _type_name(expected) -> str:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(option) for option in typing.get_args(expected))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(expected))
    names = {int: "a whole number", float: "a number", bool: "true or false", str: "text", dict: "a mapping"}
    if expected is type(None):
        return "null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(expected)[0])}s"
    return names.get(expected, getattr(expected, "__name__", str(expected)))


def _failed_assertion(error: AssertionError) -> str:
    """The source line of a bare ``assert`` that failed (litgpt's Config asserts without a message)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return frame.line or "an assertion"


MAX_LAYERS = 1000
MAX_PARAMETERS = 10**13
"""Past any model there is (the deepest in litgpt's hub has 126 layers, the largest about 10^12 parameters): a
model_config.yaml that says n_layer: 100000000 built layers for minutes, growing, before anything was said"""


def check_architecture(config: Config, source: str, weights: Path | None = None) -> None:
    """Refuses an architecture no machine could build, before building it; and one that ``weights`` (the checkpoint's
    lit_model.pth) is too small to hold, before the data is read and the model built (the load would find it out
    later, after a minute of building a model of 20,000 layers, say)."""
    if config.n_layer > MAX_LAYERS:
        raise UserError(
            f"{source}: n_layer {config.n_layer:,} is past any model (the deepest in litgpt's hub has 126 layers;"
            f" Memfit takes up to {MAX_LAYERS:,}): is the file damaged?"
        )
    experts = max(1, getattr(config, "n_expert", 0) or 1)
    attention = config.n_embd * config.head_size * (2 * config.n_head + 2 * config.n_query_groups)
    parameters = config.padded_vocab_size * config.n_embd * 2 + config.n_layer * (
        attention + 3 * config.n_embd * config.intermediate_size * experts
    )
    if parameters > MAX_PARAMETERS:
        raise UserError(
            f"{source}: about {parameters:.1e} parameters (n_embd {config.n_embd:,}, intermediate_size"
            f" {config.intermediate_size:,}, vocabulary {config.padded_vocab_size:,}), past any model: is the file"
            " damaged?"
        )
    stored = _tensor_bytes(weights) if weights is not None else None
    # a full-precision checkpoint stores at least 2 bytes a weight (a tied embedding and head once): under 1 byte a
    # parameter, the file is another model's
    if stored is not None and stored < parameters:
        raise UserError(
            f"{source} describes about {parameters:,} parameters ({config.n_layer:,} layers), but {weights} holds"
            f" {stored:,} bytes of tensors, under 1 byte a parameter: they are not the same model; use the"
            " model_config.yaml that came with the weights"
        )


def _tensor_bytes(weights: Path) -> int | None:
    """The bytes of tensor data in a torch zip checkpoint, from its directory alone; None for another format."""
    try:
        with zipfile.ZipFile(weights) as archive:
            return sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
    except (OSError, zipfile.BadZipFile):
        return None  # a legacy-format or damaged file: the load says what is wrong with it


def read_tokenizer(directory: Path, flag: str = "--checkpoint_dir") -> Tokenizer:
    """litgpt's ``Tokenizer`` of ``directory``, with a damaged ``tokenizer_config.json`` said in one line (litgpt
    reads its ``tokenizer_class`` unguarded: a KeyError traceback)."""
    try:
        return Tokenizer(directory)
    except KeyError as error:
        raise UserError(
            f"{flag} {str(directory)!r}: its tokenizer_config.json has no {error.args[0]!r} (Hugging Face writes it,"
            ' e.g. "tokenizer_class": "LlamaTokenizer"); add it, or copy the model\'s own tokenizer_config.json'
        ) from None
    except json.JSONDecodeError as error:
        raise UserError(f"{flag} {str(directory)!r}: a tokenizer file is not valid JSON ({error})") from None
    except Exception as error:  # noqa: BLE001 the tokenizers library raises a bare Exception, SentencePiece a RuntimeError
        # litgpt reads tokenizer.json where there is one, else tokenizer.model
        name = "tokenizer.json" if (Path(directory) / "tokenizer.json").is_file() else "tokenizer.model"
        reason = (str(error).splitlines() or [type(error).__name__])[0][:160]
        raise UserError(
            f"{flag} {str(directory)!r}: {name} cannot be read as a tokenizer ({reason}); it may be truncated or"
            " damaged: copy it again from the model's original files (litgpt download fetches it)"
        ) from None


def check_vocabulary(tokenizer_dir: Path, config: Config, flag: str = "--checkpoint_dir") -> None:
    """A tokenizer whose ids the model's embedding can take: a larger one (another model's) failed at step 1 with an
    IndexError from the embedding."""
    vocab = read_tokenizer(tokenizer_dir, flag).vocab_size
    if vocab > config.padded_vocab_size:
        raise UserError(
            f"{flag} {str(tokenizer_dir)!r}: its tokenizer has {vocab:,} tokens but the model's vocabulary holds"
            f" {config.padded_vocab_size:,} (padded_vocab_size): they are not the same model's; use the tokenizer"
            " the model was trained with"
            + (", or a model_config whose vocabulary fits it" if flag == "--tokenizer_dir" else "")
        )


def check_writable(flag: str, path: Path) -> None:
    """Refuses a directory that cannot be created or written, before any work (not at the first save)."""
    check_name_lengths(flag, path)
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


def check_name_lengths(flag: str, path: Path) -> None:
    """Each name in ``path`` within what its file system takes (255 bytes on most): a longer one failed with
    ENAMETOOLONG where it was first made, for the profile dir after training had started."""
    nearest = next((p for p in (Path(path).absolute(), *Path(path).absolute().parents) if _is_dir(p)), Path("/"))
    try:
        most = os.pathconf(nearest, "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    for name in Path(path).parts:
        if len(os.fsencode(name)) > most:
            raise UserError(
                f"{flag}: the name {name[:40]!r}... is {len(os.fsencode(name))} bytes long, past the {most} its file"
                " system takes for one name; shorten it"
            )
    total = len(os.fsencode(str(Path(path).absolute())))
    if total > 3800:  # PATH_MAX is 4096, and a run adds its own names below (the profile dir's run, a checkpoint)
        raise UserError(f"{flag}: the path is {total} bytes long, past what a run can write under; shorten it")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # ENAMETOOLONG: a name in it is too long to ask about
        return False


def earlier_run(out_dir: Path) -> list[str]:
    """The checkpoint directories an earlier run left in ``out_dir``."""
    if not out_dir.is_dir():
        return []
    # a run set aside by an --overwrite that never finished counts: a fresh run here would delete it when it ends
    kept = (EARLIER_RUN,)
    return sorted(
        (
            p.name
            for p in out_dir.iterdir()
            if p.is_dir() and (p.name == "final" or STEP_DIR.match(p.name) or p.name in kept)
        ),
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
    # the same training on another kind of device (a run rehearsed on the CPU, continued on a GPU): the checkpoint
    # holds no device tensors, and a generator the other device lacks is said when resuming
    "accelerator",
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
