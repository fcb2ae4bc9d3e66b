"""One resolved run: every flag of a script after its ``setup()`` has resolved and checked it, in one frozen value.

``main()``, ``fit()``, the estimate and the out-of-memory explanation read the run from here; the estimate's ``Plan``
is derived from it (``memfit.prediction.estimate.plan_of``), never restated; this module imports no part of the
estimator. A script's ``setup()`` resolves what needs resolving (``memfit.settings.resolve``) and hands every value over
by name (``Run.of``): a new flag is its parameter in ``setup()``, its help (``memfit.settings.flag_help`` or the script's
docstring), its name in ``Run.of``, and where it is used (and its field here, once for every script).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memfit.args import DDPArgs, EvalArgs, FSDPArgs, LogArgs, ProfileArgs, TrainArgs
from memfit.errors import UserError
from memfit.settings.resolve import run_name
from memfit.training.loading import checkpointed_blocks
from memfit.training.optim import OptimizerKind, optimizer_kind
from memfit.training.quantizers import QuantizeKind, quantize_kind


@dataclass(frozen=True)
class Run:
    method: str
    """The script's method (lora, adapter, adapter_v2, full, pretrain): it names the run's profile dir and lines"""
    checkpoint_dir: Path
    """The checkpoint dir (the embedded default's where none was given)"""
    out_dir: Path
    profile_dir: Path
    run_dir: Path
    """This run's profile dir under ``profile_dir`` (each process names one; ``main`` takes rank 0's); ``Run.of``
    names it unless given"""
    config: object
    """The litgpt ``Config`` the model is built from"""
    data: object
    """The litgpt ``DataModule`` (the embedded data's where none was given)"""
    train: TrainArgs
    eval: EvalArgs
    optimizer: OptimizerKind
    """``--optimizer``'s entry in ``memfit.training.optim.OPTIMIZERS`` (litgpt's block resolved to one)"""
    optimizer_args: dict
    """Constructor arguments beside lr and weight decay (a litgpt block's betas, eps, ...)"""
    optimizer_in_backward: bool
    precision: str
    quantize: QuantizeKind | None
    """``--quantize``'s entry in ``memfit.training.quantizers.QUANTIZERS`` (None: not quantized)"""
    accelerator: str
    devices: int
    num_nodes: int
    strategy: str
    fsdp: FSDPArgs
    ddp: DDPArgs
    activation_checkpointing: int
    """The blocks whose activations are recomputed (``--activation_checkpointing``'s true, false or number as a count:
    ``memfit.training.loading.checkpointed_blocks``)"""
    accumulation: int
    """Micro-batches per optimizer step on each process"""
    profile: ProfileArgs
    resume_from: Path | None
    resume_with_changed_data: bool
    overwrite: bool
    seed: int
    hparams: dict
    """The settings a checkpoint records (``memfit.settings.resolve.run_hparams``)"""
    memory_budget: str | None
    logger_name: str
    log: LogArgs
    model_name: str | None
    """The name the run is labelled with (--model_name, or a pretraining model_config's)"""
    embedded: bool
    """The run trains the embedded default"""
    label: str | None = None
    """What the run is called where that is not its model_name (pretraining's model_config names it)"""
    sample_order: str = "longest_early"
    tokenizer_dir: Path | None = None
    initial_checkpoint_dir: Path | None = None
    activation_offloading: bool = False
    compile: bool = False
    """Each transformer block compiled with torch.compile (``memfit.training.compiled_blocks``)"""
    """The saved activations wait in host memory (``memfit.training.activation_offload``)"""

    @classmethod
    def of(cls, *, estimate: bool = False, **settings) -> Run:
        """The run from what ``setup()`` resolved, each value given by its field's name (a name that is no field, or a
        field left out, is a ``TypeError``: nothing enters the run unnamed). ``activation_checkpointing`` may be the
        flag's true, false or number; ``run_dir`` is named here unless given (``estimate``: an estimate's picture
        has a dir of its own, named apart from runs)."""
        settings["activation_checkpointing"] = checkpointed_blocks(
            settings["activation_checkpointing"], settings["config"].n_layer
        )
        # the flags' names: from here on, their registry entries
        if isinstance(settings["quantize"], str):
            settings["quantize"] = quantize_kind(settings["quantize"])
        if isinstance(settings["optimizer"], str):
            settings["optimizer"] = optimizer_kind(settings["optimizer"])
        if settings.get("activation_offloading") and settings["accelerator"] == "cpu":
            raise UserError(
                "--activation_offloading true moves saved activations from a GPU to host memory; a CPU run's host is"
                " its device, so nothing would move: leave it out, or run on a GPU (--accelerator cuda)"
            )
        if "run_dir" not in settings:
            script = settings["method"] + ("-estimate" if estimate else "")
            name = settings.get("label") or settings["model_name"]
            where = settings["profile_dir"]
            settings["run_dir"] = where / run_name(
                script, settings["checkpoint_dir"], name, settings["embedded"], where
            )
        return cls(**settings)

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def max_seq_length(self) -> int:
        """Samples longer than the model's context are truncated to it, as the model could not take them."""
        return min(self.train.max_seq_length or self.config.block_size, self.config.block_size)


@dataclass
class ScriptStep:
    """What a script is, for its run and its estimate: its model, what trains, and its own ``train_step``, which
    ``--estimate`` runs on fake tensors (``memfit.prediction.fake_step``)."""

    model_class: type
    block_class: type
    config: object
    mark_trainable: Callable | None
    """Freezes all but the method's parameters (and applies the method's workarounds); None: every weight trains"""
    train_step: Callable
    """The script's step: ``train_step(fabric, model, optimizer, micro_batches, shares, settings, phases, step)``, its
    ``settings`` a ``memfit.args.StepSettings``"""
    validate: Callable | None = None
    """The script's ``validate(fabric, model, val_loader, max_iters)``, which ``--estimate`` runs on fake tensors too"""
    text_batches: bool = False
    """Pretraining: a batch is ``input_ids`` of T + 1 tokens (inputs and shifted targets); else SFT ``labels``"""
    tie_embeddings: bool = False
    """Pretraining's --train.tie_embeddings: the head and the embedding are one parameter (``tie_embedding_to_head``)"""
    traced: dict = field(default_factory=dict, repr=False, compare=False)
    """The steps traced for this script, by what a trace depends on (``traced_step``): the planner tries many plans
    that share one, and they last as long as the script's step does"""
