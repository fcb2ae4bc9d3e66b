"""Command-line entry: jsonargparse's CLI, with a user's mistake reported in one line instead of a traceback.

Three kinds of mistakes end here, each as ``error: ...`` on stderr and exit status 2, before anything is written:
a flag jsonargparse cannot parse (``--quantize bnb.nf5``), a class it cannot build (``--data JSON`` with a missing
file), and a setting the scripts reject (``UserError``). Errors raised while training are bugs and keep their
traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from memfit.errors import UserError, line_to_stderr
from memfit.files import special_kind
from memfit.settings.flag_help import SHARED_FLAG_HELP
from memfit.settings.model_source import check_config_values
from memfit.training.checkpoint import WEIGHTS_FILES, resume_point
from memfit.training.embedded import embedded_data_of
from memfit.training.out_dir import latest_checkpoint
from memfit.training.signals import PREEMPTING, Preempted


def _fail(message: str) -> None:
    line_to_stderr(f"error: {message}")
    _after_rank_zero()
    raise SystemExit(2)


def _after_rank_zero(most_seconds: float = 20.0) -> None:
    """A rank that Lightning's launcher started (``--devices`` above 1 without torchrun or srun) ends after rank 0,
    its parent. Lightning's watcher in rank 0 kills every process, rank 0 included (exit 137, "Killed"), when it sees
    a child end with an error while rank 0 still runs: with every rank ending on the same refusal (an out_dir in
    use), the run's status depended on which rank the machine let finish first."""
    launched_by_lightning = os.environ.get("LOCAL_RANK", "0") != "0" and not any(
        name in os.environ for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "LSB_JOBID")
    )
    if not launched_by_lightning:
        return
    parent, deadline = os.getppid(), time.monotonic() + most_seconds
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.05)


def one_line(message: str) -> str:
    """jsonargparse's multi-line validation report, reduced to the flag, the value and the reason.

    jsonargparse's errors carry the flag and the value only in their text (``Parser key "train.lr": ...``, no
    attribute names them), so they are read from it; where the parser itself knows more (a flag's choices, its
    nearest spelling) the helpers above take it from the parser's actions and the command line instead."""
    key = re.search(r'Parser key "([^"]+)"', message)
    flag = f"--{key.group(1)}" if key else None
    given = re.search(r"Given value: (.*)", message)
    choices = re.search(r"Literal\[([^\]]*)\]", message)
    if flag and given and choices:
        return f"{flag} {given.group(1).strip()!r} is not one of {choices.group(1)}"
    nested = re.findall(r'Parser key "([^"]+)":[ \t]*\n\s*(\S[^\n]*)', message)
    if len(nested) > 1:  # a field inside a block (--model_config '{n_layer: x}'): name the field and its reason
        (outer, _), (inner, reason) = nested[0], nested[-1]
        return f"--{inner if inner.startswith(outer + '.') else f'{outer}.{inner}'}: {reason}"
    lines = [re.sub(r'^Parser key "[^"]+":\s*', "", line.strip()) for line in message.splitlines()]
    lines = [line for line in lines if line and "NoneType" not in line and "Union of no types" not in line]
    bullets = [i for i, line in enumerate(lines) if line.startswith("- ")]
    reason = lines[bullets[-1]][2:] if bullets else (lines[0] if lines else message.strip())
    if bullets and reason.endswith(":") and bullets[-1] + 1 < len(lines):
        # "Problem with given class_path 'litgpt.data.JSON':" says what on its next line (a key the class lacks)
        reason += " " + lines[bullets[-1] + 1]
    if "expected one argument" in reason:  # argparse reads "-1e-3" as a flag
        reason += " (a value that starts with '-' is written --flag=VALUE)"
    shown = given.group(1).strip() if given else ""
    if shown and len(shown) < 60 and "Namespace(" not in shown and shown not in reason:
        reason += f" (got {shown!r})"
    return f"{flag}: {reason}" if flag and not reason.startswith("--") else reason


def _given(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` on the command line (``--flag value`` or ``--flag=value``), if it was."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


# litgpt before 0.4 put the optimizer's settings in `train:`; litgpt 0.5 refuses these keys too. Older copies of its
# config hub still carry them, so the refusal says where each one moved.
_MOVED_TO_OPTIMIZER = ("learning_rate", "weight_decay", "beta1", "beta2")


def _old_litgpt_form(message: str) -> str | None:
    key = re.search(r"Group 'train' does not accept nested key '(\w+)'", message)
    if key is None or key.group(1) not in _MOVED_TO_OPTIMIZER:
        return None
    return (
        f"train.{key.group(1)} is the form of litgpt before 0.4 (litgpt 0.5 refuses it too): move train.learning_rate,"
        " weight_decay, beta1 and beta2 to `optimizer: {class_path: torch.optim.AdamW, init_args: {lr: ...,"
        " weight_decay: ..., betas: [beta1, beta2]}}`"
    )


def _model_config_values(argv: list[str]) -> str | None:
    """A ``--model_config`` given inline whose values litgpt's ``Config`` fails on (``n_head: 0`` ended in "integer
    modulo by zero", naming no field): the same check as a checkpoint's model_config.yaml gets, naming the field."""
    values = {}
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        if flag == "--model_config":
            with contextlib.suppress(yaml.YAMLError):
                given = yaml.safe_load(value)
                values.update(given if isinstance(given, dict) else {})
        elif flag.startswith("--model_config."):
            with contextlib.suppress(yaml.YAMLError):
                values[flag.removeprefix("--model_config.")] = yaml.safe_load(value)
    if not values:
        return None
    try:
        check_config_values(values, "--model_config")
    except UserError as error:
        return str(error)
    except KeyError:  # a name that is no Config field: jsonargparse's own message says so
        return None
    return None


def _did_you_mean(parser, message: str) -> str | None:
    """jsonargparse's "Unrecognized arguments: --trian.lr 1" as the flag and the script's nearest flag, where one is
    near (a misspelling, or British spelling: ``--quantise``)."""
    match = re.match(r"Unrecognized arguments: (--[^\s=]+)", message)
    if match is None:
        return None
    flag = match.group(1)
    flags = sorted({name for action in parser._actions for name in action.option_strings if name.startswith("--")})
    near = difflib.get_close_matches(flag, flags, n=1, cutoff=0.75)
    hint = f"did you mean {near[0]}?" if near else "--help lists them"
    return f"{flag} is not a flag of this script; {hint}"


def _known_choices(parser, argv: list[str], message: str) -> str | None:
    """For a value outside a fixed set, the line jsonargparse does not always write: the flag, the value, the set.

    Its message for a bad ``Literal`` value is sometimes only "Cannot take a Union of no types", and a bad litgpt
    prompt style surfaces as a bare KeyError ('chatml').
    """
    from typing import Literal, get_args, get_origin

    key = re.search(r'Parser key "([^"]+)"', message)
    if key:
        action = next((a for a in parser._actions if a.dest == key.group(1)), None)
        hint = getattr(action, "_typehint", None)
        options = [a for h in (hint, *get_args(hint)) if get_origin(h) is Literal for a in get_args(h)]
        given = _given(argv, f"--{key.group(1)}")
        if options and given is not None:
            return f"--{key.group(1)} {given!r} is not one of {', '.join(map(repr, options))}"
    style = _given(argv, "--data.prompt_style")
    if style is not None:
        from litgpt.prompts import prompt_styles

        if style not in prompt_styles:
            return (
                f"--data.prompt_style {style!r} is not one of litgpt's prompt styles"
                f" ({', '.join(sorted(prompt_styles))})"
            )
    return None


def _fields_not_a_file(argv: list[str], message: str) -> str | None:
    """A settings block given a file path (``--model_config model_config.yaml``, refused by litgpt too): say how to
    give the fields."""
    key = re.search(r'Parser key "([^"]+)"', message)
    given = _given(argv, f"--{key.group(1)}") if key else None
    if given is None or "expects a dict or Namespace" not in message or given.lstrip().startswith("{"):
        return None
    return (
        f"--{key.group(1)} {given!r}: give the fields themselves, not a file: a `{key.group(1)}:` block in a"
        f" --config YAML file, or inline as --{key.group(1)} '{{n_layer: 2, n_embd: 64, ...}}'"
    )


def _token_to_data(config) -> None:
    """litgpt's --access_token reaches a data module that checks for a token while it is built (LIMA raises without
    one), so it is set among the module's arguments before jsonargparse builds it."""
    token, data = config.get("access_token"), config.get("data")
    init_args = getattr(data, "init_args", None) if data is not None and not isinstance(data, str) else None
    if token is not None and init_args is not None and "access_token" in init_args and init_args.access_token is None:
        init_args.access_token = token


def _estimate_without_absent_data(config) -> None:
    """A recipe estimated where its data is not (a login node, a laptop): the estimate needs the data only for the
    longest sample's length, so a data file that is not on this machine is left out, said in a note, instead of
    failing the data module's own check. The length is then --train.max_seq_length, or the model's context."""
    data = config.get("data")
    init_args = getattr(data, "init_args", None) if data is not None and not isinstance(data, str) else None
    if not config.get("estimate") or init_args is None:
        return
    for field in ("json_path", "path", "train_data_path"):  # litgpt's JSON and TextFiles, memfit's PlainText
        value = init_args.get(field)
        if value is not None and "://" not in str(value) and not Path(value).exists():
            print(f"note: --data.{field} {str(value)!r} is not on this machine; the estimate goes on without the data")
            config.data = None
            return


def choices(typehint) -> list | None:
    """The values of a ``Literal`` type (within ``Optional``/``Union`` too), or None."""
    from typing import Literal, get_args, get_origin

    values = [
        value for hint in (typehint, *get_args(typehint)) if get_origin(hint) is Literal for value in get_args(hint)
    ]
    return values or None


def accepted(typehint) -> str:
    """What a flag whose type holds a ``Literal`` accepts, as --help lists it: each value once as typed (litgpt's
    ``32`` is both a string and an int in --precision's), then the union's other forms (``--devices``: auto or an
    integer; ``--resume``: true, false, auto or a path), which listing the Literal alone hid."""
    from pathlib import PurePath
    from typing import Literal, get_args, get_origin

    values = list(dict.fromkeys(map(str, choices(typehint))))
    forms = []
    # a bare Literal's arguments are its values, listed above; a union's are its other forms
    members = () if get_origin(typehint) is Literal else get_args(typehint)
    for other in (hint for hint in members if get_origin(hint) is not Literal):
        if other is bool:
            values = ["true", "false", *values]
        elif other is type(None):
            values.append("null")
        elif other is int:
            forms.append("an integer")
        elif other is float:
            forms.append("a number")
        elif isinstance(other, type) and issubclass(other, PurePath):
            forms.append("a path")
        else:
            forms.append(getattr(other, "__name__", str(other)))
    return ", ".join(values) + "".join(f", or {form}" for form in forms)


def make_parser(function: Callable):
    """jsonargparse's parser of a script's ``setup``, with a help text that shows each fixed set of values as typed."""
    from pathlib import PurePath

    from jsonargparse import DefaultHelpFormatter, auto_parser, set_parsing_settings

    class HelpFormatter(DefaultHelpFormatter):
        # jsonargparse writes a type without what comes before each dot, so --help listed --quantize as nf4, nf4-dq,
        # ..., values it then refuses: a Literal's values are listed whole
        def _get_type_str(self, action):
            hint = getattr(action, "_typehint", None)
            if isinstance(hint, type) and issubclass(hint, PurePath):  # jsonargparse shows "<class 'Path'>"
                return "a path"
            values = choices(hint)
            if values is None:
                return super()._get_type_str(action)
            return "one of " + accepted(action._typehint)

    # dataclass attribute docstrings (TrainArgs, ProfileArgs, ...) become --help text, as in litgpt
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    # as_positional=False: every setting is a named flag, like litgpt's scripts
    return auto_parser(
        with_shared_help(function), as_positional=False, exit_on_error=False, formatter_class=HelpFormatter
    )


def with_shared_help(function: Callable) -> Callable:
    """``function`` with the help of the flags every recipe shares (``memfit.settings.flag_help``) added to its
    docstring's Args for the parameters it does not describe itself: jsonargparse reads --help from the docstring."""
    import functools
    import inspect
    import types

    doc = inspect.cleandoc(function.__doc__ or "")
    described = set(re.findall(r"^    (\w+):", doc, flags=re.MULTILINE))
    added = [
        f"    {name}: {SHARED_FLAG_HELP[name]}"
        for name in inspect.signature(function).parameters
        if name in SHARED_FLAG_HELP and name not in described
    ]
    if not added:
        return function
    # a copy of the function itself, not a wrapper: jsonargparse resolves the string annotations (``from __future__
    # import annotations``) in the function's own globals, which a wrapper defined here would replace with this
    # module's (under ``python -m cProfile``, where the script is not ``__main__``, every such flag was then unknown)
    documented = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
    documented = functools.update_wrapper(documented, function)
    documented.__doc__ = doc + ("" if "\nArgs:" in doc else "\n\nArgs:") + "\n" + "\n".join(added)
    return documented


def _resumed_run_settings(function: Callable, args: list[str]) -> list[str]:
    """``args`` after the settings of the run that ``--resume`` continues, as ``--config`` of its checkpoint's
    ``hyperparameters.yaml`` (which reproduces the run): the flags a user does not give again are the run's, not the
    defaults, and those given are checked against it (``memfit.settings.resume_settings.check_resume_settings``). The checkpoint
    is the one the resume itself takes (``memfit.training.checkpoint.resume_point``: an earlier one where its file is
    damaged); where there is none, the run refuses the resume by name."""
    import inspect

    resume = _given(args, "--resume")
    if resume is None or resume.lower() in ("false", "null"):
        return args
    if resume.lower() in ("true", "auto"):
        out_dir = Path(_given(args, "--out_dir") or inspect.signature(function).parameters["out_dir"].default)
        checkpoint = None if (out_dir / "final").is_dir() else latest_checkpoint(out_dir)  # finished: refused by name
        if checkpoint is None:
            return args
    else:
        checkpoint = Path(resume).parent if Path(resume).is_file() else Path(resume)
    try:
        checkpoint, stored = resume_point(checkpoint, warn=False)  # the run warns when it takes it
    except UserError:
        return args
    _same_script(function, checkpoint, stored)
    return ["--config", str(checkpoint / "hyperparameters.yaml"), *args]


_WRITTEN_BY = {name: script for script, name in WEIGHTS_FILES.items() if name != WEIGHTS_FILES["full"]}
"""The scripts whose checkpoints a weights file names alone (a whole model is full fine-tuning's or pretraining's)"""


def _same_script(function: Callable, checkpoint: Path, stored: dict) -> None:
    """Refuses a checkpoint another script wrote, by name, before its settings are read as this script's: they
    failed as "--lora_alpha is 16 here but None" (a full.py checkpoint) or "Key 'adapter.prompt_length' is not
    expected" (an adapter.py one), flags the user never gave. Which script wrote it: its weights file (a LoRA or
    adapter run's own suffix; a whole model for full fine-tuning and pretraining) and, between those two,
    pretraining's own settings."""
    import inspect

    script = Path(inspect.getsourcefile(function)).stem  # lora, adapter, adapter_v2, full, pretrain
    files = [name for name in _WRITTEN_BY if (checkpoint / name).is_file()]
    if files:
        writer, held = _WRITTEN_BY[files[0]], files[0]
    elif (checkpoint / "lit_model.pth").is_file():
        writer = "pretrain" if "initial_checkpoint_dir" in stored else "full"
        held = "lit_model.pth"
    else:
        return  # a sharded checkpoint: its weights are checked by name on load
    if writer != script:
        where = "finetune" if writer != "pretrain" else "pretrain"
        _fail(
            f"--resume {str(checkpoint)!r} was written by {where}/{writer}.py (it holds {held}), not"
            f" {script}.py: resume it with that script, or start this one in a fresh --out_dir"
        )


def _positional_at(args: list[str]) -> int | None:
    """Where a positional argument is: a word that is no flag's value (every flag takes one, in ``--flag value`` or
    ``--flag=value`` form, but --help)."""
    i = 0
    while i < len(args):
        if not args[i].startswith("-"):
            return i
        i += 1 if "=" in args[i] or args[i] in ("--help", "-h") else 2
    return None


def _blocks_replace_blocks(args: list[str]) -> list[str]:
    """An ``--optimizer`` block given after a ``--config`` file that has one replaces it. jsonargparse merges the new
    block into the file's, and fails with an AttributeError on the file's plain dict (litgpt's CLI too); an
    ``--optimizer AdamW`` just before it first replaces the file's block with a name, which the block then replaces."""
    if not any(arg == "--config" or arg.startswith("--config=") for arg in args):
        return args
    replaced = []
    for i, arg in enumerate(args):
        value = (
            arg.split("=", 1)[1]
            if arg.startswith("--optimizer=")
            else args[i + 1]
            if arg == "--optimizer" and i + 1 < len(args)
            else None
        )
        if value is not None and value.lstrip().startswith("{"):
            replaced += ["--optimizer", "AdamW"]
        replaced.append(arg)
    return replaced


CONFIG_FILE_BYTES = 2**20
CONFIG_VALUES = 100_000
"""A --config file's limits: litgpt's config hub files are 1-3 KB and hold under 100 values. A file past them is
refused before jsonargparse reads it: a YAML alias bomb (9 levels of 9 aliases, 81 aliases in a 1 KB file) is 387
million values once expanded, and took 22 GB of memory before the kernel killed the run."""


def _check_config_file(path_text: str) -> None:
    """Refuses, in one line, a --config file that is too large, not UTF-8 text, not YAML, empty, not a mapping, or
    whose aliases expand to more than ``CONFIG_VALUES`` values (counted without expanding them: PyYAML shares each
    alias's object, jsonargparse then copies them out)."""
    import yaml

    path = Path(path_text)
    if not path.is_file():
        return  # jsonargparse says it does not exist
    flag = f"--config {path_text!r}"
    size = path.stat().st_size
    if size > CONFIG_FILE_BYTES:
        raise UserError(
            f"{flag} is {size:,} bytes: a config file is a few KB of flag: value lines; is it the right file?"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{flag} is not UTF-8 text (byte {error.object[error.start]:#x} at {error.start}): save it as UTF-8"
        )
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise UserError(f"{flag} is not valid YAML ({one_line(str(error))})") from None
    if values is None:
        raise UserError(f"{flag} is empty: it sets nothing; give flag: value lines (as litgpt's config_hub files)")
    if not isinstance(values, dict):
        raise UserError(
            f"{flag} is a YAML {type(values).__name__}, not a mapping: write one flag: value per line (as litgpt's"
            " config_hub files)"
        )
    counted: dict[int, int] = {}

    def expanded(value) -> int:  # each object counted once, however many aliases share it
        if id(value) not in counted:
            children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
            counted[id(value)] = 0  # a recursive alias (a list holding itself) stops here
            counted[id(value)] = 1 + sum(min(expanded(child), CONFIG_VALUES + 1) for child in children)
        return counted[id(value)]

    if expanded(values) > CONFIG_VALUES:
        raise UserError(
            f"{flag}: its YAML aliases expand to over {CONFIG_VALUES:,} values (a config file holds under 100): it"
            " would take the machine's memory; write the values out"
        )


def CLI(
    function: Callable,
    args: list[str] | None = None,
    real_model_defaults: dict | None = None,
    hidden: tuple[str, ...] = (),
) -> Any:
    """Parses ``args`` (the command line) into ``function``'s arguments and calls it; a mistake ends in one line.
    ``real_model_defaults``: the script's defaults where it trains a real model (``--checkpoint_dir`` or
    ``--model_name``), by flag name without the dashes: the signature's are sized for the embedded default.
    ``hidden``: flags (without the dashes) the script refuses, left out of its --help; given, they are refused in one
    line as before (a fine-tuning script's ``PRETRAINING_ONLY``, which litgpt's shared ``TrainArgs`` brings)."""
    import argparse

    from jsonargparse import ArgumentError

    parser = make_parser(function)
    for action in parser._actions:  # argparse keeps no public way to hide an argument once added
        if action.dest in hidden:
            action.help = argparse.SUPPRESS
    args = sys.argv[1:] if args is None else list(args)
    positional = _positional_at(args)
    if positional is not None:
        # litgpt's form: the checkpoint dir as a positional argument, first or after other flags; placed last, so
        # that a --config file that names another checkpoint dir does not replace it
        args = [*args[:positional], *args[positional + 1 :], "--checkpoint_dir", args[positional]]
    args = _blocks_replace_blocks(args)
    config_at = next((i for i, arg in enumerate(args) if arg == "--config" or arg.startswith("--config=")), None)
    before = [arg.split("=")[0] for arg in args[: config_at or 0] if arg.startswith("--") and arg not in ("--help",)]
    if before:  # jsonargparse applies flags in order: the file's values would silently replace these
        _fail(
            f"{before[0]} comes before --config, whose file would replace it: put --config first (the flags after"
            " it override the file)"
        )
    for i, arg in enumerate(args):
        flag, value = (arg.split("=", 1) + [None])[:2] if arg.startswith("--") and "=" in arg else (arg, None)
        if value is None and i + 1 < len(args) and arg.startswith("--"):
            value = args[i + 1]
        if flag.endswith(("_dir", "_path")) and value == "":
            # read as a Path, "" is "." : --out_dir "$OUT" with OUT unset trained into the current directory
            _fail(f"{flag} is empty (an unset shell variable?): give a directory or file, or leave the flag out")
        if (flag == "--config" or flag.endswith(("_dir", "_path", ".path"))) and value and not value.startswith("-"):
            kind = special_kind(value)
            if kind not in (
                None,
                "directory",
            ):  # reading a FIFO blocks until a writer comes: jsonargparse and read_text would wait forever
                _fail(f"{flag} {value!r} is a {kind}, not a file or directory: give a regular file or directory")
    args = _resumed_run_settings(function, args)
    try:
        for i, arg in enumerate(args):
            if arg == "--config" and i + 1 < len(args):
                _check_config_file(args[i + 1])
            elif arg.startswith("--config="):
                _check_config_file(arg.split("=", 1)[1])
        config = parser.parse_args(args)
        if real_model_defaults and _real_model(config):
            embedded = parser.get_defaults()
            parser.set_defaults(real_model_defaults)
            config = parser.parse_args(args)  # a --config file and the flags given override these, as any default
            _say_real_model_defaults(function, args, config, real_model_defaults, embedded)
        _token_to_data(config)
        _estimate_without_absent_data(config)
        init = parser.instantiate_classes(config)
    except UserError as error:
        _fail(str(error))
    # IndexError: jsonargparse's own report of a class that failed on an empty assertion (litgpt's Config's
    # ``assert self.n_embd % self.n_head == 0``) fails to indent its empty message
    except (ArgumentError, ValueError, TypeError, FileNotFoundError, KeyError, IndexError, AssertionError) as error:
        _fail(
            _old_litgpt_form(str(error))
            or _did_you_mean(parser, str(error))
            or _known_choices(parser, args, str(error))
            or _fields_not_a_file(args, str(error))
            or _model_config_values(args)
            or one_line(str(error))
        )
    init.pop("config", None)
    try:
        with _stop_before_training():
            return function(**init)
    except UserError as error:
        _fail(str(error))
    except Preempted as error:  # before the run's own handling began (the embedded default's first build, say)
        print(f"Preempted by {error}: nothing was saved; run the same command again", file=sys.stderr)
        raise SystemExit(128 + error.signum) from None
    except KeyboardInterrupt:
        print("Interrupted (Ctrl-C) before training began: nothing was saved", file=sys.stderr)
        raise SystemExit(130) from None


def _real_model(config) -> bool:
    """Whether the run is on a model of the user's (``--model_name``, or a ``--checkpoint_dir`` that is not the
    embedded default's own, which tests and resumed runs name by its path)."""
    if config.model_name is not None:
        return True
    return config.checkpoint_dir is not None and embedded_data_of(Path(config.checkpoint_dir)) is None


def _say_real_model_defaults(function: Callable, args: list[str], config, defaults: dict, embedded) -> None:
    """One line naming the settings a real model took from ``defaults`` in place of the embedded default's (those
    no flag or file gave otherwise), so that nobody learns of them from the learning-rate curve."""
    import inspect

    taken = [
        f"--{key} {'null' if config[key] is None else config[key]}"
        for key, value in defaults.items()
        if config[key] == value and embedded[key] != value and _given(args, f"--{key}") is None
    ]
    if taken:
        script = "/".join(Path(inspect.getsourcefile(function)).parts[-2:])
        print(f"note: a real model: these settings are litgpt's defaults for {script}: {' '.join(taken)}")


@contextmanager
def _stop_before_training():
    """SIGTERM, SIGUSR1 and SIGHUP stop the run at once until its own handlers (``memfit.training.signals.RunSignals``)
    take over: before them, a scheduler's SIGTERM during the embedded default's first build ended the process silently
    and left its staging directory in the cache for good; raised as ``Preempted``, the build's cleanup runs and the run
    ends in one line."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Preempted(signum, None)

    previous = {signum: signal.signal(signum, stop) for signum in PREEMPTING}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
