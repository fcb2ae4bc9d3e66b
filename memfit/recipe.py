"""A fine-tuning script's flags resolved into its run: what every ``setup()`` of finetune/ does the same way.

A script names its method (``FineTuning``: litgpt's model module, the method's own settings of its ``Config``, which
weights train, its ``train_step``) and hands its flags, as given, to ``resolve_finetuning``. That checks every flag
before anything is built or written (a bad value ends in one line, ``memfit.cli``), in the order that makes a mistake
cost nothing: the flags alone first, then the checkpoint (the embedded default's first build), the run dirs, a
resumed run's settings, the architecture and the tokenizer. It returns the run (``memfit.run.Run``) and the step the
estimate traces (``memfit.fake_step.ScriptStep``); the script then estimates, or starts Fabric and launches ``main``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit.budget import parse_budget
from memfit.checkpoint import resume_point
from memfit.checks import check_architecture, check_resume_settings, check_run_dirs, check_vocabulary
from memfit.data import check_sample_order, embedded_data, give_access_token
from memfit.fake_step import ScriptStep
from memfit.resolve import (
    resolve_checkpoint_dir,
    resolve_hardware,
    resolve_resume,
    resolve_training,
    run_hparams,
    run_inputs,
)
from memfit.run import Run
from memfit.strategy import resolve_strategy


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


def resolve_finetuning(flags: dict, method: FineTuning) -> tuple[Run, ScriptStep]:
    """``flags``: ``setup()``'s parameters as given (``dict(locals())`` first thing in ``setup()``), which also go to
    ``hyperparameters.yaml`` as they are, so that ``--config`` of it reruns the run."""
    given = dict(flags)
    if given["memory_budget"] is not None:  # before the embedded default's first build: a mistake costs nothing
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
    # several processes: FSDP with each block checkpointed, as litgpt's fine-tuning
    strategy, activation_checkpointing = resolve_strategy(
        given["strategy"], world_size, given["activation_checkpointing"]
    )
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
        quantize=given["quantize"] if method.quantizes else None,
    )
    method.check_flags()
    # the checkpoint (the embedded default's first build) after every check of the flags alone: a mistake costs nothing
    data, estimate, out_dir, overwrite = given["data"], given["estimate"], given["out_dir"], given["overwrite"]
    checkpoint_dir, embedded_json, model_name = resolve_checkpoint_dir(
        given["checkpoint_dir"], data, given["model_name"], estimate
    )
    give_access_token(data, given["access_token"])
    check_sample_order(given["sample_order"], data)
    resume_from = resolve_resume(given["resume"], out_dir, overwrite, given["resume_with_changed_data"])
    check_run_dirs(
        out_dir,
        given["profile_dir"],
        resume_from,
        overwrite,
        estimate,
        reads=run_inputs(data, checkpoint_dir=checkpoint_dir),
    )
    hparams = run_hparams(flags, train, precision, checkpoint_dir)
    if resume_from is not None:
        # an earlier checkpoint where the latest one's settings are damaged
        resume_from, trained_with = resume_point(resume_from)
        check_resume_settings(resume_from, trained_with, hparams)

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
    script = ScriptStep(method.gpt, method.block, config, method.mark_trainable, method.train_step)
    # every flag as resolved above and what was derived from them, by name
    run = Run.of(
        method=method.name,
        estimate=estimate,
        embedded=embedded_json is not None,
        checkpoint_dir=checkpoint_dir,
        out_dir=out_dir,
        profile_dir=given["profile_dir"],
        config=config,
        data=data,
        train=train,
        eval=given["eval"],
        optimizer=optimizer,
        optimizer_args=optimizer_args,
        optimizer_in_backward=given["optimizer_in_backward"],
        precision=precision,
        quantize=given["quantize"],
        accelerator=accelerator,
        devices=devices,
        num_nodes=given["num_nodes"],
        strategy=strategy,
        fsdp=given["fsdp"],
        activation_checkpointing=activation_checkpointing,
        accumulation=accumulation,
        profile=given["profile"],
        resume_from=resume_from,
        resume_with_changed_data=given["resume_with_changed_data"],
        overwrite=overwrite,
        seed=given["seed"],
        hparams=hparams,
        memory_budget=given["memory_budget"],
        logger_name=given["logger_name"],
        log=given["log"],
        model_name=model_name,
        sample_order=given["sample_order"],
        activation_offloading=given["activation_offloading"],
    )
    return run, script
