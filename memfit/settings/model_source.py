"""The checks of the model a run starts from: its checkpoint dir (or pretraining's tokenizer and initial weights),
the architecture its config describes, its weights' size and its tokenizer, each refused in one line naming the file
and the fix before anything is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
import types
import typing
import zipfile
from pathlib import Path

import yaml
from litgpt import Config
from litgpt.tokenizer import Tokenizer

from memfit.errors import UserError


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
    if hugging_face:  # not "damaged or truncated": the file is missing, and another format is there
        raise UserError(
            f"{flag} {str(checkpoint_dir)!r} has no lit_model.pth, only Hugging Face weights ({hugging_face[0]}"
            f"{', ...' if len(hugging_face) > 1 else ''}); convert them with `litgpt convert_to_litgpt"
            f" {checkpoint_dir}`, then give the same dir"
        )
    raise UserError(
        f"{flag} {str(checkpoint_dir)!r} has no lit_model.pth; give a litgpt checkpoint dir (as `litgpt download`"
        " makes it)"
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
