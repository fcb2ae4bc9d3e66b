"""The physical floor of a training step, for benchmarks to report measured / floor.

Memory: the weights as stored (4-bit layers at half a byte per weight plus their quantization constants, everything
else in the compute dtype), the trainable parameters' gradients and AdamW's two moments (in the parameter dtype, as
``torch.optim.AdamW`` keeps them), and the activations backward cannot do without: each block's input, with every
block recomputed (what activation checkpointing keeps). No implementation of the same training stores less.

Speed: a token costs about 2·P FLOPs forward and 2·P backward through the activations, plus 2·P more for the weight
gradients when every weight trains (P: the parameters that multiply, so not the embedding lookup). Over the card's
own measured matmul rate that is the most tokens per second the step can reach.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

# bytes per weight of a 4-bit layer: the packed weight, plus one fp32 absmax per 64 weights (nf4), or one uint8
# absmax per 64 and one fp32 per 256 of those (nf4-dq: bitsandbytes' compress_statistics)
FOUR_BIT_BYTES = {
    "bnb.nf4": 0.5 + 4 / 64,
    "bnb.fp4": 0.5 + 4 / 64,
    "bnb.nf4-dq": 0.5 + 1 / 64 + 4 / (64 * 256),
    "bnb.fp4-dq": 0.5 + 1 / 64 + 4 / (64 * 256),
}


@dataclass
class MemoryFloor:
    weights: int
    trainable_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.trainable_state + self.activations


def memory_floor(
    model: nn.Module, quantize: str | None, dtype: torch.dtype, tokens_per_micro_batch: int, n_layer: int, n_embd: int
) -> MemoryFloor:
    """``model``: built on the meta device with its trainable parameters marked; Memfit quantizes every
    ``nn.Linear`` weight that does not train (the embedding stays in ``dtype``)."""
    size = torch.empty((), dtype=dtype).element_size()
    quantized = {id(module.weight) for module in model.modules() if type(module) is nn.Linear}
    weights = trainable_state = 0
    for parameter in model.parameters():
        n = parameter.numel()
        if parameter.requires_grad:
            weights += n * size
            trainable_state += 3 * n * size  # gradient, exp_avg, exp_avg_sq
        elif quantize in FOUR_BIT_BYTES and id(parameter) in quantized:
            weights += int(n * FOUR_BIT_BYTES[quantize])
        else:
            weights += n * size
    activations = n_layer * tokens_per_micro_batch * n_embd * size  # (B, T, n_embd) per block input
    return MemoryFloor(weights, trainable_state, activations)


def matmul_parameters(model: nn.Module) -> int:
    """The parameters a token is multiplied by (every weight of a matrix product; the embedding is a lookup)."""
    return sum(module.in_features * module.out_features for module in model.modules() if isinstance(module, nn.Linear))


def flops_per_token(matmul_params: int, full: bool) -> float:
    return (6 if full else 4) * matmul_params


def measured_matmul_flops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192, repeats: int = 20
) -> float:
    """The card's own dense matmul rate (FLOP/s), measured now: the speed floor's denominator."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - started)
