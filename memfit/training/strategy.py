"""Fabric's strategy for ``--strategy``/``--fsdp`` and its logger for ``--logger_name``.

``--strategy fsdp`` is torch's second FSDP (``fully_shard``, parameters as ``DTensor`` shards) through Fabric's
``ModelParallelStrategy``: Lightning's ``FSDPStrategy`` wraps torch's first FSDP, which both Lightning and torch refuse
without a GPU, so it could never be tested where CI runs. The second runs on CPU processes over gloo as on GPUs over
NCCL, with the same code. Each transformer block is sharded, then the embedding, then the final norm with the head,
then the root (what is left), as torchtitan does; a unit is gathered just before its forward and (with
``reshard_after_forward``) freed after it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl

from memfit.args import DDPArgs, FSDPArgs
from memfit.errors import UserError
from memfit.training.loading import apply_activation_checkpointing, cast_floating, init_from_seed, module_names
from memfit.training.precision import compute_dtype
from memfit.training.quantizers import QuantizeKind
from memfit.training.torchao_nf4 import quantize_linears

# litgpt's --fsdp.sharding_strategy values (torch's first FSDP) that the second FSDP has an equivalent for: whether a
# block's parameters are freed after its forward (FULL_SHARD, HYBRID_SHARD) or kept gathered until its backward
# (SHARD_GRAD_OP). HYBRID_SHARD also shards over a node's processes only (``replicas``).
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True}


def fsdp_replicas(fsdp: FSDPArgs, num_nodes: int) -> int:
    """The copies of the sharded model: one per node under HYBRID_SHARD (each shards over its node's processes), else
    one (every rank holds its own 1/N share)."""
    return num_nodes if fsdp.sharding_strategy == "HYBRID_SHARD" else 1


def check_fsdp(fsdp: FSDPArgs, precision: str, strategy: str, num_nodes: int = 1) -> None:
    """Refuses what the second FSDP through Fabric cannot do, in one line each."""
    if strategy != "fsdp":
        if fsdp.cpu_offload:
            raise UserError("--fsdp.cpu_offload true needs --strategy fsdp")
        if fsdp.accumulate_unsharded:
            raise UserError("--fsdp.accumulate_unsharded true needs --strategy fsdp (DDP's gradients are whole anyway)")
        return
    if fsdp.sharding_strategy == "NO_SHARD":
        raise UserError("--fsdp.sharding_strategy NO_SHARD shards nothing: that is --strategy ddp; use it instead")
    if fsdp.sharding_strategy == "HYBRID_SHARD" and num_nodes == 1:
        raise UserError(
            "--fsdp.sharding_strategy HYBRID_SHARD shards within a node and replicates across nodes: on one node"
            " (--num_nodes 1) that is FULL_SHARD; use it, or give --num_nodes"
        )
    if precision == "16-mixed":  # Fabric's ModelParallelStrategy refuses it: no sharded gradient scaler
        raise UserError(
            "--precision 16-mixed with --strategy fsdp: the second FSDP has no gradient scaler through"
            " Fabric; use bf16-mixed, bf16-true or 16-true"
        )


BUCKET_COPIES = "memfit_bucket_copies"
"""The attribute of a DDP module (or of the estimate's fake model) holding its all-reduce buckets, by index, where
they are a copy of the gradients beside them (``--ddp.gradient_as_bucket_view false``): the ledger counts them as
gradients, the second copy they are (``memfit.observatory.roles.bucket_copies``)"""


def check_ddp(ddp: DDPArgs, strategy: str, world_size: int) -> None:
    """Refuses a DDP setting where the run is not DDP's (``replicates_with_ddp``), in one line."""
    if not ddp.gradient_as_bucket_view and not replicates_with_ddp(strategy, world_size):
        raise UserError(
            f"--ddp.gradient_as_bucket_view false needs DDP: --strategy ddp on 2 processes or more (this run is"
            f" {'FSDP' if strategy == 'fsdp' else 'one process'}); drop it"
        )


def shard_model(
    model: torch.nn.Module,
    device_mesh,
    *,
    block_class: type,
    reshard_after_forward: bool,
    cpu_offload: bool,
    mixed_precision: torch.dtype | None,
    activation_checkpointing: int,
    replicas: int = 1,
    dtype: torch.dtype | None = None,
    init_seed: int | None = None,
    quantize: QuantizeKind | None = None,
) -> torch.nn.Module:
    """Fabric's ``parallelize_fn``: ``fully_shard`` on each block, the embedding, the final norm with the head, then the
    root, over the data-parallel mesh. A model still on the meta device (pretraining from scratch) is initialised a
    unit at a time, each just before it is sharded (``memfit.training.loading.init_from_seed`` with ``init_seed``); so
    is a ``--quantize torchao.nf4`` base quantized, from the unit's cast copy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if activation_checkpointing:  # wrapped first, so a block's recomputation gathers it again inside backward
        apply_activation_checkpointing(model, block_class, activation_checkpointing)
    mesh = device_mesh["data_parallel"]
    shards = mesh.size() // replicas  # the processes a weight is split over (a node's, under HSDP)
    if replicas > 1:
        # HSDP, as torchtitan's and torchtune's data-parallel mesh has it: shard within a node (all-gathers and
        # reduce-scatters over the fast links), replicate across nodes (one all-reduce of the shards' gradients).
        # Fabric's mesh is one data-parallel dimension; a 2-D one over the same ranks is made here.
        from torch.distributed.device_mesh import init_device_mesh

        shape = (replicas, mesh.size() // replicas)  # nodes x processes per node: a node's ranks are consecutive
        mesh = init_device_mesh(mesh.device_type, shape, mesh_dim_names=("replicate", "shard"))
    # -mixed: the gathered copy is cast to the compute dtype (half the all-gather and the gathered block's memory);
    # the shards, their gradients and the reduction stay float32, as the optimizer steps on them.
    policy = (
        MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
        if mixed_precision is not None
        else MixedPrecisionPolicy()
    )
    # pinned host memory needs an accelerator; on CPU processes the offload is a no-op move, kept so it runs as on GPU
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()

    names = module_names(model)

    def shard(modules, reshard_after_forward: bool = reshard_after_forward) -> None:
        # ``dtype``: the model came from the checkpoint uncast (``load_model(sharded=True)``); each unit is cast just
        # before fully_shard keeps the rank's slice of it, so a cast copy of one unit at a time exists, never the
        # whole model's
        for module in modules if isinstance(modules, list) else [modules]:
            if init_seed is not None:
                init_from_seed(module, names, init_seed, torch.device("cpu"))
            if dtype is not None:
                cast_floating(module, dtype)
            if quantize is not None and quantize.quantizes_loaded_weights:
                quantize_linears(module, shards, head=model.lm_head)
        fully_shard(
            modules,
            mesh=mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=reshard_after_forward,
        )

    for module in list(model.modules()):
        # the checkpoint wrapper around a block is the unit, so the block's recomputation is inside it
        inner = getattr(module, "_checkpoint_wrapped_module", module)
        if isinstance(inner, block_class) and (module is not inner or not _is_wrapped(model, module)):
            shard(module)
    embedding, norm, head = model.transformer.wte, model.transformer.ln_f, model.lm_head
    if not {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}:  # not tied
        # The embedding and the head (with the final norm) are units of their own, as torchtitan shards them: each
        # is gathered around its use only, never the whole vocabulary's weights through the step. The embedding is
        # freed after its forward (gathered again for the backward's last op); backward starts with the head.
        shard(embedding)
        shard([norm, head], reshard_after_forward=False)
        head.register_forward_pre_hook(_free_the_deferred_all_gather)  # after FSDP's own, which gathers it
    # the root holds what no unit took (a tied embedding and head): the first and last thing the forward runs
    shard(model, reshard_after_forward=False)
    return model


def _free_the_deferred_all_gather(module: torch.nn.Module, args) -> None:
    """Frees the head unit's all-gather buffer as soon as its weights are copied out of it, before the head runs.

    In forward FSDP2 keeps each unit's all-gather output (a copy of the unit's gathered weights) until the next unit
    is gathered, so that the copy-out overlaps the next all-gather; the last unit's is freed when the model's forward
    returns. The head is the last unit, and the loss (``memfit.training.loss``) runs inside the head's forward, a chunk
    of tokens at a time: the forward's peak, and its buffer, a second copy of the largest unit, would be alive through
    it (measured on 2 CPU ranks: the gathered weights at the forward peak were twice the head unit's). No all-gather
    follows the head's in forward, so there is nothing to overlap. torch has no public call for it: this is its own
    end-of-forward code, run earlier."""
    state = module._get_fsdp_state()
    context = state._comm_ctx
    deferred = context.all_gather_state
    if deferred is None:
        return
    for stream in ("all_gather_copy_in_stream", "all_gather_stream"):
        if hasattr(context, stream) and deferred.event is not None:
            getattr(context, stream).wait_event(deferred.event)
    context.all_gather_state = None


def process_group_backend(accelerator: str, fsdp: FSDPArgs) -> str | None:
    """NCCL with gloo beside it for CPU tensors where FSDP offloads to the host on GPUs (as torchtitan does): the
    gradient norm and clipping then run on offloaded CPU gradients, which NCCL alone cannot reduce. Else Fabric's
    choice (NCCL on GPUs, gloo on CPUs)."""
    return "cuda:nccl,cpu:gloo" if accelerator == "cuda" and fsdp.cpu_offload else None


class ReduceEveryMicroBatch(_BackwardSyncControl):
    """``fabric.no_backward_sync`` that skips nothing: FSDP reduce-scatters every micro-batch's gradients."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


def replicates_with_ddp(strategy: str, world_size: int) -> bool:
    """Whether a run of ``strategy`` (as ``resolve_strategy`` gives it) on ``world_size`` processes is DDP's: asked
    for, or any other several-process run that is not FSDP's."""
    return strategy != "fsdp" and (strategy == "ddp" or world_size > 1)


def keeps_gradient_buckets(fabric, model, micro_batches: int) -> bool:
    """Whether a step's zero_grad zeroes the gradients in place instead of freeing them: under DDP they are views
    into its all-reduce buckets (``gradient_as_bucket_view``), which stay allocated whatever zero_grad does. Freed,
    the next step's micro-batches before its last (whose all-reduce DDP skips) accumulate into new tensors beside
    the buckets, a second copy of the gradients until that last one's all-reduce copies them in (measured on 2 CPU
    ranks, full fine-tuning of the embedded default with two micro-batches a rank: 8.01 MiB of gradients in the last
    forward where the buckets hold 4.00, docs/distributed.md). Zeroed, they stay the buckets' views.

    Except before DDP's second step, where a step is one micro-batch (``micro_batches``): DDP trains its first step
    with every gradient in one bucket and rebuilds the buckets at the next forward (torch's ``_rebuild_buckets``);
    gradients that are still views of the first bucket keep it alive while the new ones are made, one more copy of
    the gradients at that step's start, which freed gradients do not (``benchmarks/ddp_first_bucket.py``: 8.41 MB
    above the step's start, against 2.10 MB in every later step and with the gradients freed). ``model`` is the
    Fabric module around DDP's; its DDP module says whether the buckets were rebuilt (after a resume too)."""
    from lightning.fabric.strategies import DDPStrategy

    if not isinstance(getattr(fabric, "strategy", None), DDPStrategy):
        return False
    ddp = getattr(model, "_forward_module", None)
    if not getattr(ddp, "gradient_as_bucket_view", True):
        return False  # the gradients are not the buckets' views: freed as litgpt frees them, the buckets stay
    rebuilt = getattr(ddp, "_has_rebuilt_buckets", True)
    return rebuilt or micro_batches > 1


def note_bucket_copies(model) -> None:
    """Under DDP with ``--ddp.gradient_as_bucket_view false``, keeps a reference to each all-reduce bucket on the
    DDP module (``BUCKET_COPIES``), so the ledger counts them: they are a second copy of
    the gradients, allocated when DDP wraps the model, where a CPU profiler window sees nothing. torch gives Python
    no other way to them than a communication hook, which sees each bucket as it is all-reduced; this one all-reduces
    as DDP's own does (``allreduce_hook``: the sum divided by the processes). ``model``: Fabric's module."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = getattr(model, "_forward_module", None)
    if ddp is None or getattr(ddp, "gradient_as_bucket_view", True):
        return
    copies: dict[int, torch.Tensor] = {}
    setattr(ddp, BUCKET_COPIES, copies)

    def noting_allreduce(process_group, bucket):
        copies[bucket.index()] = bucket.buffer()  # DDP rebuilds its buckets at the second step: the latest kept
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, noting_allreduce)


def _is_wrapped(model: torch.nn.Module, block: torch.nn.Module) -> bool:
    return any(getattr(m, "_checkpoint_wrapped_module", None) is block for m in model.modules())


def resolve_strategy(
    strategy: str, world_size: int, activation_checkpointing: bool, checkpoint_blocks: bool = True
) -> tuple[str, bool]:
    """``(strategy, activation_checkpointing)`` for the run. ``--strategy auto`` on several processes is litgpt's
    choice there: FSDP, each block sharded, and in fine-tuning each block's activations checkpointed
    (``checkpoint_blocks``; litgpt's pretraining shards without checkpointing). litgpt's hub files with ``devices: 4``
    mean that; ``--strategy ddp`` replicates the model instead. One process: unchanged."""
    if strategy == "auto" and world_size > 1:
        return "fsdp", activation_checkpointing or checkpoint_blocks
    return strategy, activation_checkpointing


def make_strategy(
    strategy: str,
    world_size: int,
    fsdp: FSDPArgs,
    block_class: type,
    activation_checkpointing: bool,
    precision: str = "32-true",
    ddp: DDPArgs = DDPArgs(),
    num_nodes: int = 1,
    accelerator: str = "cpu",
    init_seed: int | None = None,
    quantize: QuantizeKind | None = None,
) -> Any:
    """``init_seed``: a model built on the meta device to be initialised as it is sharded (pretraining from scratch,
    ``memfit.training.loading.init_from_seed``)."""
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy  # FSDP runs only: it pulls in torch.distributed

        parallelize = partial(
            shard_model,
            block_class=block_class,
            reshard_after_forward=RESHARD_AFTER_FORWARD[fsdp.sharding_strategy],
            cpu_offload=fsdp.cpu_offload,
            activation_checkpointing=activation_checkpointing,
            mixed_precision={"bf16-mixed": torch.bfloat16}.get(precision),
            replicas=fsdp_replicas(fsdp, num_nodes),
            dtype=compute_dtype(precision),
            init_seed=init_seed,
            quantize=quantize,
        )
        # every process is one data-parallel shard (no tensor parallelism); step-* checkpoints are one file per rank
        # (sharded) or one consolidated file (full); final/ is always consolidated (memfit.training.checkpoint)
        model_parallel = ModelParallelStrategy(
            parallelize,
            data_parallel_size=world_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=fsdp.state_dict_type == "sharded",
            process_group_backend=process_group_backend(accelerator, fsdp),
        )
        if not fsdp.accumulate_unsharded:
            # Fabric's no_backward_sync turns FSDP's reduce-scatter off for all but a step's last micro-batch, so
            # every rank would hold the whole model's unsharded gradients through the step. As torchtitan and
            # torchtune accumulate, each micro-batch's gradients are reduce-scattered into the rank's shard instead:
            # the strategy's hook for skipping the sync is the one place Fabric lets that be chosen.
            model_parallel._backward_sync_control = ReduceEveryMicroBatch()
        return model_parallel
    if replicates_with_ddp(strategy, world_size):
        from lightning.fabric.strategies import DDPStrategy

        # true: the gradients are views into DDP's all-reduce buckets, not a second copy of them; torch's default
        # (false, --ddp.gradient_as_bucket_view false, as litgpt runs DDP) holds the trained gradients twice
        return DDPStrategy(gradient_as_bucket_view=ddp.gradient_as_bucket_view)
    return "auto"


def run_strategy(run, block_class: type, init_seed: int | None = None) -> Any:
    """Fabric's strategy for the settings of ``run`` (a ``memfit.settings.run.Run``, which reads this module: not
    imported)."""
    return make_strategy(
        strategy=run.strategy,
        world_size=run.world_size,
        fsdp=run.fsdp,
        ddp=run.ddp,
        block_class=block_class,
        activation_checkpointing=run.activation_checkpointing,
        precision=run.precision,
        num_nodes=run.num_nodes,
        accelerator=run.accelerator,
        init_seed=init_seed,
        quantize=run.quantize,  # torchao.nf4: each unit quantized as it is sharded
    )
