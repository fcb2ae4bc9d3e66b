"""The ``--quantize`` choices, each described once: what stores its weights, how many bytes they take, what it
needs of the precision and the strategy, how the estimate prices it and how the planner ranks it.

The flag's choices (``QuantizeChoice``) come from ``QUANTIZERS``; the code that quantizes asks an entry's
behaviour (``replaces_layers``: bitsandbytes' layers in ``memfit.training.bitsandbytes_layers``;
``quantizes_loaded_weights``: torchao's NF4 in ``memfit.training.torchao_nf4``), never compares names; past a script's
``setup()`` the run holds the entry itself (``memfit.settings.run.Run.quantize``).
Adding a method is one entry here where its library's layers already build its mode (tests/test_quantize.py trains
every entry); a new storage also needs its layer (docs/design.md counts both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memfit.errors import UserError
from memfit.training.torchao_nf4 import packed_bytes


@dataclass(frozen=True)
class QuantizeKind:
    name: str
    library: Literal["bitsandbytes", "torchao"]
    mode: str
    """The library's name for it: bitsandbytes' precision-plugin mode (nf4, nf4-dq, int8-training), torchao's nf4"""
    bits: int
    """Bits a stored weight element takes (4: the weights are replaced by packed codes; 8: bitsandbytes keeps an int8
    copy beside float16 weights, ``memfit.prediction.estimate.with_int8_copies``)"""
    double_quant: bool = False
    """The per-block scales are themselves quantized (8-bit, with a float32 scale per 256 blocks)"""
    needs_precision: str | None = None
    """The one --precision it computes in"""
    step_cost: float = 1.0
    """The planner's time factor against no quantization"""
    planner_tries: bool = False
    """The planner offers it in place of unquantized weights (on the strategy it runs with)"""
    dequantized_copies: int = 1
    """Copies of a quantized layer's dequantized weight alive at once while the layer multiplies by it (torchao's NF4
    dequantization holds about three more: measured on CPU, torchao 0.18, 3.8 MiB beside a 1 MiB weight)"""

    @property
    def replaces_layers(self) -> bool:
        """Its layers stand in for ``nn.Linear`` before the weights load, quantizing each weight as it is assigned,
        and Fabric's precision plugin (bitsandbytes') converts the rest (``memfit.training.bitsandbytes_layers``)."""
        return self.library == "bitsandbytes"

    @property
    def quantizes_loaded_weights(self) -> bool:
        """Each ``nn.Linear``'s weight (not the head's) is quantized once it is loaded in the compute dtype, a unit at
        a time as FSDP shards it (``memfit.training.torchao_nf4.quantize_linears``); F.linear dequantizes it, no plugin
        needed."""
        return self.library == "torchao"

    @property
    def shards_with_fsdp(self) -> bool:
        """torchao's NF4 tensors shard under FSDP; bitsandbytes' 4-bit weights lose their quantization state there
        (benchmarks/qlora_fsdp_routes.py reproduces it), so they train on one device."""
        return self.library == "torchao"

    def stored_bytes(self, numel: int) -> int:
        """Bytes of a ``numel``-element weight as stored (4-bit codes and their scales)."""
        if self.library == "torchao":
            return packed_bytes(numel)
        if self.double_quant:  # a byte per 2 codes, a uint8 scale per 64-block, a float32 per 256 of those
            return numel // 2 + numel // 64 + (numel // (64 * 256)) * 4
        return numel // 2 + (numel // 64) * 4  # a float32 scale per 64-block


QUANTIZERS: dict[str, QuantizeKind] = {
    kind.name: kind
    for kind in (
        QuantizeKind("bnb.nf4", "bitsandbytes", "nf4", bits=4, step_cost=1.15, planner_tries=True),
        QuantizeKind(
            "bnb.nf4-dq", "bitsandbytes", "nf4-dq", bits=4, double_quant=True, step_cost=1.2, planner_tries=True
        ),
        QuantizeKind("bnb.fp4", "bitsandbytes", "fp4", bits=4, step_cost=1.15),
        QuantizeKind("bnb.fp4-dq", "bitsandbytes", "fp4-dq", bits=4, double_quant=True, step_cost=1.2),
        QuantizeKind("bnb.int8-training", "bitsandbytes", "int8-training", bits=8, needs_precision="16-true"),
        # dequantized in plain PyTorch ops (no fused kernel): priced as double-quantized bitsandbytes
        QuantizeKind("torchao.nf4", "torchao", "nf4", bits=4, step_cost=1.2, planner_tries=True, dequantized_copies=4),
    )
}
QuantizeChoice = Literal[tuple(QUANTIZERS)]  # --quantize's choices, as --help lists them


def quantize_kind(name: str) -> QuantizeKind:
    if name not in QUANTIZERS:
        raise UserError(f"--quantize {name!r} is not one of {', '.join(QUANTIZERS)}")
    return QUANTIZERS[name]
