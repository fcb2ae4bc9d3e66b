"""Memory-efficient model building and loading.

The model is built on the meta device (no memory), the checkpoint is opened with
``torch.load(mmap=True, weights_only=True)`` (pages stay in the file's page cache, not in anonymous memory), and
tensors are adopted with ``load_state_dict(assign=True)`` instead of copied. With ``--quantize`` each linear weight
is quantized on the target device as it is loaded, so the full-precision base never sits whole on the GPU.
Parameters the checkpoint does not have (LoRA, adapters) are materialised afterwards with their own init.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from itertools import chain
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as wrap_modules,
)
from torch.profiler import record_function

from memfit.errors import UserError
from memfit.progress import layers_loaded
from memfit.trace_events import RECOMPUTE_RANGE
from memfit.training.activation_offload import offload_activations
from memfit.training.bitsandbytes_layers import is_bitsandbytes_parameter, replace_linear_layers
from memfit.training.compiled_blocks import compile_blocks
from memfit.training.quantizers import QuantizeKind
from memfit.training.torchao_nf4 import is_nf4, quantize_linears


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_on_meta(model_class: type[nn.Module], config, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"), default_dtype(dtype):
        return model_class(config)


def _unreadable(path: Path, error: BaseException) -> str:
    reason = (str(error).splitlines() or [type(error).__name__])[0][:160]
    # the embedded default's cached copy (memfit.training.embedded): nothing to download, it is rebuilt once removed
    cached = path.parent.name == "checkpoint" and path.parent.parent.name.startswith("embedded-v")
    fix = (
        f"delete {str(path.parent.parent)!r} and run again, which rebuilds it"
        if cached
        else "download or convert it again"
    )
    return f"{path} cannot be read as a PyTorch checkpoint ({type(error).__name__}: {reason}): it is damaged or truncated; {fix}"


def check_checkpoint_file(path: Path) -> None:
    """A damaged weights file, said before the run starts (seeding, reading the data) rather than when the model
    loads: a torch zip file's directory, read from its end, which a truncated or emptied file lacks; a file that is
    neither a zip nor torch's legacy pickle format is no checkpoint."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic[:1] != b"\x80":  # torch's legacy format is left to the load
            zipfile.ZipFile(path).close()
    except (OSError, zipfile.BadZipFile) as error:
        raise UserError(_unreadable(path, error)) from None


def open_checkpoint(path: Path) -> dict:
    if not path.is_file():
        raise UserError(
            f"checkpoint file {str(path)!r} does not exist; point --checkpoint_dir at a litgpt checkpoint dir"
        )
    try:
        try:
            state_dict = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except RuntimeError as error:
            if "mmap can only be used" not in str(error):
                raise
            # torch's legacy (pre-zip) format cannot be memory-mapped: read it whole, as torch.load would
            state_dict = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # noqa: BLE001  (torch raises many types for a bad file; each is the user's file)
        if "Unsupported global" in str(error):  # a class or function to call: the file would run code
            raise UserError(
                f"{path} is not a plain weights file (it carries code or objects that"
                " torch.load(weights_only=True) refuses) and was not loaded; save only the state dict"
            ) from None
        raise UserError(_unreadable(path, error)) from None
    # litgpt's own training checkpoints nest the weights under "model".
    state_dict = state_dict.get("model", state_dict) if isinstance(state_dict, dict) else state_dict
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise UserError(
            f"{path} holds a {type(state_dict).__name__}, not a state dict of tensors; give a litgpt lit_model.pth"
        )
    not_float = next((k for k, v in state_dict.items() if not v.is_floating_point() and v.dtype != torch.bool), None)
    if not_float is not None:
        raise UserError(
            f"{path}: {not_float!r} is {state_dict[not_float].dtype}, not floating point; give the"
            " model's full-precision weights (lit_model.pth as litgpt converts them)"
        )
    return state_dict


def materialize_missing(model: nn.Module, device: torch.device) -> list[str]:
    """Creates the parameters and buffers still on the meta device, using each module's own initialisation."""
    created = []
    for name, module in model.named_modules():
        own = chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
        meta = [n for n, t in own if t.is_meta]
        if meta:
            module.to_empty(device=device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            created += [f"{name}.{n}" if name else n for n in meta]
    return created


def module_names(model: nn.Module) -> dict[int, str]:
    """Each module's name in ``model``, the same with and without activation checkpointing's wrappers."""
    return {id(m): name.replace("._checkpoint_wrapped_module", "") for name, m in model.named_modules()}


def init_from_seed(module: nn.Module, names: dict[int, str], seed: int, device: torch.device) -> None:
    """Materializes the meta tensors under ``module``, each layer initialised by its own ``reset_parameters`` (for
    pretraining: litgpt's ``initialize_weights`` installs them) from a generator seeded by ``seed`` and the layer's
    name (``names``: ``module_names`` of the whole model).

    The values then depend on neither the order nor the grouping in which layers are materialized: one process
    initialises the whole model at once, an FSDP rank one unit at a time just before sharding it
    (``memfit.training.strategy.shard_model``), so no rank holds the whole model, and both draw the same values. Drawn
    on the CPU (the same values whatever the device), then moved; the global generators are left as they were, so the
    data order and dropout do not depend on the model's size. Parameters shared by several layers (tied embedding and
    head) stay shared: the first layer's draw, in module order.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for layer in module.modules():
        for attribute, param in layer.named_parameters(recurse=False):
            if param.is_meta:
                owners.setdefault(id(param), []).append((layer, attribute))
    cpu = torch.device("cpu")
    for layer in module.modules():
        own = chain(layer.parameters(recurse=False), layer.buffers(recurse=False))
        if not any(t.is_meta for t in own):
            continue
        layer.to_empty(device=cpu, recurse=False)
        if hasattr(layer, "reset_parameters"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_layer_seed(seed, names[id(layer)]))
                layer.reset_parameters()
        if device != cpu:
            layer._apply(lambda t: t.to(device), recurse=False)  # this layer's tensors only: its children may be meta
    for shared in (group for group in owners.values() if len(group) > 1):
        first, attribute = shared[0]
        for layer, name in shared[1:]:
            setattr(layer, name, getattr(first, attribute))


def _layer_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63


def tie_embedding_to_head(model: nn.Module) -> None:
    """litgpt's pretraining with ``--train.tie_embeddings``: the token embedding becomes the head's weight, one
    parameter (its gradient and optimizer state counted once). The run and the estimate tie it here alike."""
    model.transformer.wte.weight = model.lm_head.weight


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Brings non-quantized floating tensors to the compute dtype (a checkpoint may be stored in another)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            quantized = is_bitsandbytes_parameter(param) or is_nf4(param)  # a cast would dequantize it
            if param.is_floating_point() and param.dtype != dtype and not quantized:
                setattr(module, name, nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad))
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_floating_point() and buf.dtype != dtype:
                setattr(module, name, buf.to(dtype))


_ARCHITECTURE_FROM = (
    "the model is built from --model_name when it is given, else from the checkpoint dir's"
    " model_config.yaml: give a checkpoint dir and a model config that belong together"
)


def load_model(
    model_class: type[nn.Module],
    config,
    checkpoint_path: Path | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantize: QuantizeKind | None = None,
    new_parameters: tuple[str, ...] = (),
    shards: int = 1,
    sharded: bool = False,
    show_progress: bool = True,
) -> nn.Module:
    """Builds ``model_class(config)`` on meta and fills it from ``checkpoint_path`` (if None: left on the meta
    device, for ``init_from_seed``).

    ``new_parameters`` names the parameters the method adds (``lora_A``, ``adapter_wte``): only they may be absent
    from the checkpoint, and they get their own initialisation; any other missing weight is an error, not a
    silently random-initialised layer. ``shards``: the processes FSDP will shard a ``torchao.nf4`` base over.
    ``show_progress``: a bar of the layers loaded, where loading takes a while (one process of several shows it).
    ``sharded``: FSDP shards the model next, so its floating tensors keep the checkpoint's dtype (memory-mapped: no
    copy) and are cast (and, for ``torchao.nf4``, quantized) unit by unit as they are sharded
    (``memfit.training.strategy.shard_model``): a rank never holds a cast or quantized copy of the whole model, only its
    share and the unit being sharded.
    """
    model = build_on_meta(model_class, config, dtype)
    if quantize is not None and quantize.replaces_layers:
        replace_linear_layers(model, quantize.mode, dtype, device)
    if checkpoint_path is not None:
        state_dict = open_checkpoint(checkpoint_path)
        what = f"loading and quantizing ({quantize.name})" if quantize else "loading"
        try:
            with layers_loaded(model, f"{what} {checkpoint_path.name}", enabled=show_progress):
                result = model.load_state_dict(state_dict, strict=False, assign=True)
        except RuntimeError as error:  # size mismatches: torch lists them all
            detail = next(
                (line.strip() for line in str(error).splitlines() if "size mismatch" in line), str(error)[:200]
            )
            raise UserError(
                f"{checkpoint_path} does not match the architecture {config.name!r} ({detail[:240]});"
                f" {_ARCHITECTURE_FROM}"
            ) from None
        if result.unexpected_keys:
            raise UserError(
                f"{checkpoint_path} does not match the architecture {config.name!r} (unexpected keys such as"
                f" {result.unexpected_keys[0]!r}); {_ARCHITECTURE_FROM}"
            )
        missing = [k for k in result.missing_keys if not any(part in k.split(".") for part in new_parameters)]
        if missing:
            raise UserError(
                f"{checkpoint_path} lacks {len(missing)} of the model's weights (such as {missing[0]!r}): it is"
                " incomplete or for another model_config.yaml; they would be trained from random values"
            )
    if checkpoint_path is None:  # pretraining from scratch: left on meta for ``init_from_seed``
        return model
    materialize_missing(model, device)
    if (
        sharded
    ):  # cast and (torchao.nf4) quantized a unit at a time as FSDP shards it (memfit.training.strategy.shard_model)
        return model
    cast_floating(model, dtype)
    if quantize is not None and quantize.quantizes_loaded_weights:  # each weight quantized, then the copy dropped
        quantize_linears(model, shards, head=model.lm_head)
    return model


def prepare_model(
    model: nn.Module,
    script,
    *,
    activation_checkpointing: int,
    max_seq_length: int,
    initialize: Callable[[nn.Module], None] | None = None,
    activation_offloading: bool = False,
    compile: bool = False,
    compile_backend="inductor",
    compile_afresh: bool = True,
) -> nn.Module:
    """What a script does to its model between building it and handing it to Fabric, the same for the run and for the
    estimate's fake step (``memfit.prediction.fake_step``), so the two cannot drift: the embedding tied to the head
    (pretraining's
    --train.tie_embeddings), ``initialize`` (pretraining from scratch: drawn after tying and before checkpointing wraps
    the blocks, whose layer names seed the draws), the method's trainable parameters marked,
    ``activation_checkpointing`` blocks checkpointed (0 where FSDP applies its own policy as it shards), the saved
    activations offloaded to the host (``activation_offloading``, ``memfit.training.activation_offload``), each block
    compiled (``compile``, with ``compile_backend``, ``memfit.training.compiled_blocks``: around its checkpointing and
    offloading; ``compile_afresh`` false keeps what this process compiled before), and the rope
    cache sized for ``max_seq_length`` tokens (at most the context). ``script``: the script's
    ``memfit.settings.run.ScriptStep``."""
    if script.tie_embeddings:
        tie_embedding_to_head(model)
    if initialize is not None:
        initialize(model)
    if script.mark_trainable is not None:
        script.mark_trainable(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model, script.block_class, activation_checkpointing)
    if activation_offloading:
        offload_activations(model)
    if compile:
        compile_blocks(model, script.block_class, compile_backend, forget_earlier=compile_afresh)
    model.max_seq_length = min(max_seq_length, script.config.block_size)
    return model


def checkpointed_blocks(setting: bool | int, blocks: int) -> int:
    """How many of a model's ``blocks`` transformer blocks ``--activation_checkpointing`` recomputes: all (true),
    none (false) or the number given, refused in one line past the model's depth."""
    if isinstance(setting, bool):
        return blocks if setting else 0
    if not 0 <= setting <= blocks:
        raise UserError(
            f"--activation_checkpointing {setting}: the model has {blocks} blocks; give true (all), false (none) or"
            f" a number of blocks from 0 to {blocks}"
        )
    return setting


def checkpointed_indices(count: int, blocks: int) -> list[int]:
    """Which blocks ``count`` of ``blocks`` checkpointed are: spread evenly from the first (every second of 32 for 16,
    blocks 0, 2, ..., 30, as torchtune's and torchtitan's every-Nth-layer options pick them). From the first: backward
    recomputes the last block as soon as it starts, while every other activation is still alive, so a checkpointed
    last block saves little at backward's start; an early one is recomputed when most activations are gone (the
    embedded model, one of 4 blocks: 1.9 MiB saved checkpointing the last, against about 6 MiB for any other)."""
    return [j * blocks // count for j in range(count)]


def _checkpoint_marking_recomputation(function, *args, **kwargs):
    """torch's non-reentrant checkpoint of ``function``, its run again in backward inside a profiler range
    (``RECOMPUTE_RANGE``): what it makes there that backward keeps has the activations' role in the ledger and the
    picture (``memfit.observatory.block_lifetimes``), not ``unattributed``. torch's own recomputation saves through
    hooks of its own, so
    the saved-tensor hooks that find forward's activations never see these."""

    def run(*inner_args, **inner_kwargs):
        if torch._C._current_graph_task_id() == -1:  # forward: no backward is running
            return function(*inner_args, **inner_kwargs)
        with record_function(RECOMPUTE_RANGE):
            return function(*inner_args, **inner_kwargs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module, block_class: type, count: int | None = None) -> int:
    """Wraps ``count`` of the ``block_class`` blocks (all where None), spread over the depth, so their activations are
    recomputed in backward (non-reentrant checkpointing); returns how many were wrapped.

    Lightning applies this only inside FSDP; the same PyTorch wrapper works on a plain module.
    """
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    chosen = {id(blocks[i]) for i in checkpointed_indices(len(blocks) if count is None else count, len(blocks))}
    wrap_modules(
        model,
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper,
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            checkpoint_fn=_checkpoint_marking_recomputation,
        ),
        check_fn=lambda module: id(module) in chosen,
    )
    return len(chosen)
