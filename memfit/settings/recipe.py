"""A recipe's flags resolved into its run: what every ``setup()`` does the same way.

A script names its method (``FineTuning``: litgpt's model module, the method's own settings of its ``Config``, which
weights train, its ``train_step``) and hands its flags, as given, to ``resolve_finetuning``. That checks every flag
before anything is built or written (a bad value ends in one line, ``memfit.settings.cli``), in the order that makes a
mistake cost nothing: the flags alone first, then the checkpoint (the embedded default's first build), the run dirs, a
resumed run's settings, the architecture and the tokenizer. It returns the run (``memfit.settings.run.Run``) and the
step the estimate traces (``memfit.settings.run.ScriptStep``); the script then estimates, or starts Fabric and launches
``main``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from litgpt import Config

from memfit.args import TrainArgs
from memfit.errors import line_to_stderr
from memfit.settings.budget import parse_budget
from memfit.settings.flag_values import check_compile, refuse_quantize
from memfit.settings.model_source import check_architecture, check_pretraining_dirs, check_vocabulary
from memfit.settings.resolve import (
    resolve_checkpoint_dir,
    resolve_hardware,
    resolve_resume,
    resolve_training,
    run_hparams,
    run_inputs,
)
from memfit.settings.resume_settings import check_resume_settings
from memfit.settings.run import Run, ScriptStep
from memfit.settings.run_dirs import check_run_dirs
from memfit.training.checkpoint import resume_point
from memfit.training.cpu_threads import threads_for_free_cores
from memfit.training.data import PlainText, check_sample_order, embedded_data, give_access_token
from memfit.training.strategy import check_ddp, resolve_strategy


@dataclass(frozen=True)
class FineTuning:
    """What a fine-tuning method is, as its script declares it."""

    name: str
    """The method: lora, adapter, adapter_v2 or full (its profile dirs, checkpoints and summary say it)"""
    gpt: type
    """litgpt's ``GPT`` of the method's module (``litgpt.lora``, ``litgpt.adapter``, ...)"""
    block: type
    """Its transformer ``Block``: FSDP's unit, and what activation checkpointing wraps"""
    config: type
    """Its ``Config``, which takes the method's own settings"""
    train_step: Callable
    """The script's ``train_step``, which ``--estimate`` runs on fake tensors"""
    validate: Callable
    """The script's ``validate``, which ``--estimate`` runs on fake tensors too"""
    mark_trainable: Callable | None = None
    """Freezes what does not train (None: every weight trains)"""
    config_options: Callable[[], dict] = dict
    """The method's own settings of ``config`` (LoRA's rank and targets, the adapter's prompts)"""
    check_flags: Callable[[], None] = lambda: None
    """Checks the method's own flags, with the flags alone (before the checkpoint is read)"""
    check_config: Callable[[object], None] = lambda config: None
    """Checks them against the architecture (an adapter's first layer within its depth)"""
    quantizes: bool = True
    """Whether the method takes ``--quantize`` (a frozen base); one that does not refuses it in ``check_flags``"""


class _FlagsAlone(NamedTuple):
    """What the flags give before anything is read from disk."""

    accelerator: str
    precision: str
    devices: int
    strategy: str
    activation_checkpointing: bool | int
    train: TrainArgs
    optimizer: object
    optimizer_args: dict
    accumulation: int


def _flags_alone(given: dict, *, quantizes: bool, pretraining: bool) -> _FlagsAlone:
    """The hardware, the strategy and the training settings, from the flags alone: a mistake in them is said before
    the embedded default's first build and before any file is read."""
    if given["memory_budget"] is not None:
        parse_budget(given["memory_budget"])
    accelerator, precision, devices = resolve_hardware(
        accelerator=given["accelerator"],
        precision=given["precision"],
        quantize=given["quantize"],
        devices=given["devices"],
        num_nodes=given["num_nodes"],
        strategy=given["strategy"],
        fsdp=given["fsdp"],
        estimate=given["estimate"],
    )
    world_size = devices * given["num_nodes"]
    # several processes: FSDP, with each block checkpointed as litgpt's fine-tuning does (its pretraining shards the
    # blocks and does not checkpoint them)
    strategy, activation_checkpointing = resolve_strategy(
        given["strategy"], world_size, given["activation_checkpointing"], checkpoint_blocks=not pretraining
    )
    check_compile(given["compile"], estimate=given["estimate"], accelerator=accelerator)
    check_ddp(given["ddp"], strategy, world_size)
    train, optimizer, optimizer_args, accumulation = resolve_training(
        train=given["train"],
        eval=given["eval"],
        profile=given["profile"],
        optimizer=given["optimizer"],
        optimizer_in_backward=given["optimizer_in_backward"],
        strategy=strategy,
        world_size=world_size,
        seed=given["seed"],
        precision=precision,
        **({"pretraining": True} if pretraining else {"quantize": given["quantize"] if quantizes else None}),
    )
    return _FlagsAlone(
        accelerator=accelerator,
        precision=precision,
        devices=devices,
        strategy=strategy,
        activation_checkpointing=activation_checkpointing,
        train=train,
        optimizer=optimizer,
        optimizer_args=optimizer_args,
        accumulation=accumulation,
    )


def _resumed(flags: dict, alone: _FlagsAlone, checkpoint_dir, reads: dict) -> tuple:
    """Where the run resumes from (None: a new run) and the settings its checkpoints record, with the run dirs
    checked (writable; an earlier run there only with --resume or --overwrite) and a resumed run's settings kept."""
    resume_from = resolve_resume(
        flags["resume"], flags["out_dir"], flags["overwrite"], flags["resume_with_changed_data"]
    )
    check_run_dirs(flags["out_dir"], flags["profile_dir"], resume_from, flags["overwrite"], flags["estimate"], reads)
    hparams = run_hparams(flags, alone.train, alone.precision, checkpoint_dir)
    if resume_from is not None:
        # an earlier checkpoint where the latest one's settings are damaged
        resume_from, trained_with = resume_point(resume_from)
        check_resume_settings(resume_from, trained_with, hparams)
    return resume_from, hparams


def _run_of(method: str, flags: dict, alone: _FlagsAlone, **derived) -> Run:
    """Every flag as resolved and what was derived from them (``derived``: the checkpoint, the config, the data, ...),
    by name, as one run; a one-process CPU run's threads sized to the cores left free (``_threads_for_a_busy_cpu``)."""
    run = Run.of(
        method=method,
        estimate=flags["estimate"],
        out_dir=flags["out_dir"],
        profile_dir=flags["profile_dir"],
        train=alone.train,
        eval=flags["eval"],
        optimizer=alone.optimizer,
        optimizer_args=alone.optimizer_args,
        optimizer_in_backward=flags["optimizer_in_backward"],
        precision=alone.precision,
        quantize=flags["quantize"],
        accelerator=alone.accelerator,
        devices=alone.devices,
        num_nodes=flags["num_nodes"],
        strategy=alone.strategy,
        fsdp=flags["fsdp"],
        ddp=flags["ddp"],
        activation_checkpointing=alone.activation_checkpointing,
        accumulation=alone.accumulation,
        profile=flags["profile"],
        resume_with_changed_data=flags["resume_with_changed_data"],
        overwrite=flags["overwrite"],
        seed=flags["seed"],
        memory_budget=flags["memory_budget"],
        logger_name=flags["logger_name"],
        log=flags["log"],
        activation_offloading=flags["activation_offloading"],
        compile=flags["compile"],
        **derived,
    )
    _threads_for_a_busy_cpu(run, flags["estimate"])
    return run


def _threads_for_a_busy_cpu(run: Run, estimate: bool) -> None:
    """A run on one CPU process trains on the cores other processes leave free
    (``memfit.training.cpu_threads``): its threads would otherwise wait on each other."""
    if run.accelerator == "cpu" and not estimate and run.world_size == 1:
        threads_for_free_cores(line_to_stderr)


def resolve_finetuning(flags: dict, method: FineTuning) -> tuple[Run, ScriptStep]:
    """``flags``: ``setup()``'s parameters as given (``dict(locals())`` first thing in ``setup()``), which also go to
    ``hyperparameters.yaml`` as they are, so that ``--config`` of it reruns the run."""
    alone = _flags_alone(flags, quantizes=method.quantizes, pretraining=False)
    method.check_flags()
    # the checkpoint (the embedded default's first build) after every check of the flags alone: a mistake costs nothing
    data, estimate = flags["data"], flags["estimate"]
    checkpoint_dir, embedded_json, model_name = resolve_checkpoint_dir(
        flags["checkpoint_dir"], data, flags["model_name"], estimate
    )
    give_access_token(data, flags["access_token"])
    check_sample_order(flags["sample_order"], data)
    resume_from, hparams = _resumed(flags, alone, checkpoint_dir, run_inputs(data, checkpoint_dir=checkpoint_dir))

    if model_name is not None:
        config = method.config.from_name(model_name, **method.config_options())
    else:
        config = method.config.from_file(checkpoint_dir / "model_config.yaml", **method.config_options())
    method.check_config(config)
    weights = checkpoint_dir / "lit_model.pth" if model_name is None and not estimate else None
    check_architecture(config, str(checkpoint_dir / "model_config.yaml") if model_name is None else model_name, weights)
    if not estimate:
        check_vocabulary(checkpoint_dir, config)
    if data is None and embedded_json is not None:
        data = embedded_data(embedded_json)
    # the model the run and the estimate build, and the step the estimate traces
    script = ScriptStep(
        method.gpt, method.block, config, method.mark_trainable, method.train_step, validate=method.validate
    )
    run = _run_of(
        method.name,
        flags,
        alone,
        embedded=embedded_json is not None,
        checkpoint_dir=checkpoint_dir,
        config=config,
        data=data,
        resume_from=resume_from,
        hparams=hparams,
        model_name=model_name,
        sample_order=flags["sample_order"],
    )
    return run, script


def resolve_pretraining(
    flags: dict, gpt: type, block: type, train_step: Callable, validate: Callable
) -> tuple[Run, ScriptStep]:
    """pretrain.py's flags, as ``resolve_finetuning`` resolves a fine-tuning script's: every weight trains, from
    litgpt's initialisation or ``--initial_checkpoint_dir``, on a ``--model_config`` given inline, a ``--model_name``
    or a checkpoint dir's config, with ``--tokenizer_dir``'s tokenizer where given."""
    alone = _flags_alone(flags, quantizes=False, pretraining=True)
    refuse_quantize("pretrain", flags["quantize"])
    # the checkpoint (the embedded default's first build) after every check of the flags alone. As in litgpt, a
    # model_config replaces model_name, which is then only a label (litgpt's tinystories.yaml names "stories15M",
    # which is not in its table)
    data, estimate, model_config = flags["data"], flags["estimate"], flags["model_config"]
    tokenizer_dir, initial_checkpoint_dir = flags["tokenizer_dir"], flags["initial_checkpoint_dir"]
    checkpoint_dir, embedded_json, architecture = resolve_checkpoint_dir(
        flags["checkpoint_dir"], data, flags["model_name"] if model_config is None else None, estimate, pretraining=True
    )
    model_name = architecture if model_config is None else flags["model_name"]
    reads = run_inputs(
        data, checkpoint_dir=checkpoint_dir, initial_checkpoint_dir=initial_checkpoint_dir, tokenizer_dir=tokenizer_dir
    )
    resume_from, hparams = _resumed(flags, alone, checkpoint_dir, reads)

    if not estimate:  # the estimate reads neither the tokenizer nor the initial weights: a hub file estimates as is
        check_pretraining_dirs(tokenizer_dir, initial_checkpoint_dir)
    if model_config is not None:
        config = model_config
    elif model_name is not None:
        config = Config.from_name(model_name)
    else:
        config = Config.from_file(checkpoint_dir / "model_config.yaml")
    # the run's name: a model_config's own name (the embedded dir may then lend only its tokenizer)
    label = (model_config.name or model_name or "model_config") if model_config is not None else model_name
    check_architecture(config, "--model_config" if model_config is not None else label or str(checkpoint_dir))
    if not estimate:
        check_vocabulary(
            tokenizer_dir or checkpoint_dir, config, "--tokenizer_dir" if tokenizer_dir else "--checkpoint_dir"
        )
    if data is None and embedded_json is not None:
        data = PlainText(path=embedded_json.with_name("corpus.txt"))
    # the model the run and the estimate build (--train.tie_embeddings too), and the step the estimate traces
    tie = bool(alone.train.tie_embeddings)
    script = ScriptStep(gpt, block, config, None, train_step, validate=validate, text_batches=True, tie_embeddings=tie)
    run = _run_of(
        "pretrain",
        flags,
        alone,
        embedded=embedded_json is not None,
        checkpoint_dir=checkpoint_dir,
        config=config,
        data=data,
        resume_from=resume_from,
        hparams=hparams,
        model_name=model_name,
        label=label,
        tokenizer_dir=tokenizer_dir,
        initial_checkpoint_dir=initial_checkpoint_dir,
    )
    return run, script
