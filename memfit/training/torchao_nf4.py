"""``--quantize torchao.nf4``: a 4-bit NF4 base that torch's second FSDP can shard (QLoRA across devices).

bitsandbytes' ``Params4bit`` cannot be sharded by ``fully_shard``: the shard is a plain ``DTensor`` of the packed
bytes, and the quantization state (absmax, code, shape) stays with the original parameter, so the gathered weight's
forward fails ("quant_state is required"; ``benchmarks/qlora_fsdp_routes.py`` reproduces it). torchao's
``NF4Tensor`` implements FSDP's all-gather hooks (``fsdp_pre_all_gather``/``fsdp_post_all_gather``): the packed data,
its per-block scalers and their quantization factors are sharded and gathered together. It is what torchtune shards.
The format is the same NF4 as bitsandbytes' ``nf4-dq`` (blocks of 64 values, scalers double-quantized in blocks of
256); the linear layers stay ``nn.Linear`` and ``F.linear`` dequantizes the weight at each matmul.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from memfit.errors import UserError

BLOCK_SIZE = 64  # values per 4-bit block
SCALER_BLOCK_SIZE = 256  # blocks per double-quantization block
ELEMENTS_PER_SCALER_BLOCK = BLOCK_SIZE * SCALER_BLOCK_SIZE


def import_nf4():
    """torchao's ``to_nf4`` and ``NF4Tensor``; a one-line refusal where torchao is not installed.

    torchao logs a warning at import for each of its CUDA kernel libraries that this torch cannot load (on a CPU
    torch: all of them); NF4 is plain PyTorch and uses none of them, so those lines are not shown.
    """
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:  # torch's pytree also warns that torchao registers an enum the way torch deprecates
        log.setLevel(logging.ERROR)
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    except ImportError:
        raise UserError(
            "--quantize torchao.nf4 needs torchao, which is not installed: pip install torchao (or"
            " pip install -e '.[torchao]'), or use a bnb.* mode on one device"
        ) from None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    return to_nf4, NF4Tensor


def is_nf4(tensor) -> bool:
    # Never imports torchao: if nothing did, no tensor is an NF4Tensor (the ledger asks this inside the profiled step)
    module = sys.modules.get("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    return module is not None and isinstance(tensor, module.NF4Tensor)


def inner_tensors(tensor) -> list[torch.Tensor]:
    """Where an NF4 weight's memory is: the packed values, their scalers and the scalers' factors."""
    return [tensor.quantized_data, tensor.quantized_scalers, tensor.quantization_factor, tensor.nf4]


def quantizable(weight_shape: torch.Size | tuple, shards: int) -> bool:
    """Whether a weight can be NF4 and sharded over ``shards`` processes: torchao quantizes whole double-quantization
    blocks, and FSDP splits every inner tensor along the first dimension into equal shards."""
    rows, *rest = weight_shape
    numel = rows * (rest[0] if rest else 1)
    return len(weight_shape) == 2 and rows % shards == 0 and numel % (ELEMENTS_PER_SCALER_BLOCK * shards) == 0


def packed_bytes(numel: int) -> int:
    """Bytes of an NF4 weight of ``numel`` values: 4 bits each, an int8 scaler per block, a float32 factor per 256."""
    return numel // 2 + numel // BLOCK_SIZE + numel // ELEMENTS_PER_SCALER_BLOCK * 4


def quantize_linears(model: nn.Module, shards: int, head: nn.Module) -> tuple[int, int]:
    """Replaces the weight of every ``nn.Linear`` (the frozen base: LoRA's and the adapters' own weights are not
    linear layers) but the model's ``head`` by its NF4 form, in place, layer by layer. A weight whose shape NF4 cannot
    take whole blocks of, or FSDP cannot split evenly over ``shards``, stays in the compute dtype. A weight FSDP has
    already sharded (a unit quantized before the one that holds it) is left as it is. Returns (quantized, kept) layer
    counts.

    The head stays in the compute dtype, as torchtune keeps its output projection: the loss runs the head a chunk of
    tokens at a time (``memfit.training.loss``), and torchao dequantizes the whole weight for each chunk's matmul,
    holding about four dequantized copies while it does (measured on CPU, a 65,536 x 1,024 head in float32: 1.29 GiB of
    temporaries at the forward's peak, where the weight is 256 MiB; docs/memory.md)."""
    from torch.distributed.tensor import DTensor

    to_nf4, _ = import_nf4()
    quantized = kept = 0
    in_head = set(head.modules())
    for module in model.modules():
        if type(module) is not nn.Linear or isinstance(module.weight, DTensor) or is_nf4(module.weight):
            continue
        if module in in_head or not quantizable(module.weight.shape, shards):
            kept += 1
            continue
        weight = module.weight.detach()
        module.weight = nn.Parameter(to_nf4(weight, BLOCK_SIZE, SCALER_BLOCK_SIZE), requires_grad=False)
        del weight
        quantized += 1
    return quantized, kept
