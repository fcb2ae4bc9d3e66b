"""memfit.training.strategy: the FSDP units a model is sharded into, and the flags it refuses (one process over gloo, in
this process: the units are the same on any number of ranks)."""

import socket

import pytest
import torch
import torch.distributed as dist
from litgpt import GPT, Config
from litgpt.model import Block
from torch.distributed.tensor import DTensor

from memfit.args import FSDPArgs
from memfit.errors import UserError
from memfit.training.strategy import check_fsdp, fsdp_replicas, make_strategy, process_group_backend, shard_model


@pytest.fixture
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def _sharded(mesh, tie_embeddings: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, padded_vocab_size=64))
    if tie_embeddings:  # as pretrain.py ties them (litgpt's pretraining)
        model.transformer.wte.weight = model.lm_head.weight
    return shard_model(
        model,
        {"data_parallel": mesh},
        block_class=Block,
        reshard_after_forward=True,
        cpu_offload=False,
        mixed_precision=None,
        activation_checkpointing=False,
    )


def test_embedding_and_head_are_units_gathered_only_around_their_use(one_process_group):
    """While the head computes, the embedding is sharded again (a DTensor: its gathered copy freed) and the head is
    gathered (plain tensors); after backward every weight is a shard. As one unit with the root (before), the
    embedding stayed gathered through the whole step."""
    model = _sharded(one_process_group)
    seen = {}

    def at_head(module, args):
        seen["embedding"] = isinstance(model.transformer.wte.weight, DTensor)
        seen["head"] = isinstance(model.lm_head.weight, DTensor)
        seen["norm"] = isinstance(model.transformer.ln_f.weight, DTensor)

    model.lm_head.register_forward_pre_hook(at_head)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert seen == {"embedding": True, "head": False, "norm": False}
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_a_tied_embedding_and_head_stay_one_unit(one_process_group):
    """litgpt's tie_embeddings shares one weight between embedding and head: it cannot be two units, so the root keeps
    both, gathered while the head computes."""
    model = _sharded(one_process_group, tie_embeddings=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(isinstance(module.weight, DTensor)))
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert seen == [False]


def test_flags_fsdp_cannot_honour_are_refused():
    with pytest.raises(UserError, match="--fsdp.accumulate_unsharded true needs --strategy fsdp"):
        check_fsdp(FSDPArgs(accumulate_unsharded=True), "32-true", "ddp")
    with pytest.raises(UserError, match="HYBRID_SHARD .* on one node"):
        check_fsdp(FSDPArgs(sharding_strategy="HYBRID_SHARD"), "32-true", "fsdp", num_nodes=1)
    check_fsdp(FSDPArgs(sharding_strategy="HYBRID_SHARD"), "32-true", "fsdp", num_nodes=2)  # accepted
    assert fsdp_replicas(FSDPArgs(sharding_strategy="HYBRID_SHARD"), 3) == 3
    assert fsdp_replicas(FSDPArgs(), 3) == 1


def test_offload_on_gpus_reduces_cpu_tensors_over_gloo_beside_nccl():
    """With --fsdp.cpu_offload on GPUs the gradient norm is taken over gradients on the host: the process group has
    gloo for CPU tensors beside NCCL (tests/test_cuda.py clips them on a GPU); elsewhere Fabric's own choice."""
    assert process_group_backend("cuda", FSDPArgs(cpu_offload=True)) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("cuda", FSDPArgs()) is None
    assert process_group_backend("cpu", FSDPArgs(cpu_offload=True)) is None
    strategy = make_strategy("fsdp", 2, FSDPArgs(cpu_offload=True), Block, False, accelerator="cuda")
    assert strategy.process_group_backend == "cuda:nccl,cpu:gloo"


def test_ddp_keeps_no_second_copy_of_the_gradients():
    """DDP's gradients are views into its all-reduce buckets (gradient_as_bucket_view), as the field's trainers set
    it: torch's default holds every gradient twice. tests/test_methods.py trains under it on 2 processes."""
    from lightning.fabric.strategies import DDPStrategy

    strategy = make_strategy("ddp", 2, FSDPArgs(), Block, False)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs == {"gradient_as_bucket_view": True}
