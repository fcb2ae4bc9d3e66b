"""Fabric precision for ``--precision`` and ``--quantize``, including bitsandbytes quantization on CPU.

Lightning's ``BitsandbytesPrecision`` is used as-is on CUDA. Fabric refuses it on any other accelerator
("Bitsandbytes is only supported on CUDA GPUs"), and its 4-bit layers only quantize when moved to CUDA, although
bitsandbytes >= 0.49 quantizes, runs forward/backward and steps 8-bit optimizers on CPU. On CPU we therefore wrap
the same plugin in a ``Precision`` that is *not* a ``BitsandbytesPrecision`` subclass (that isinstance check is
Fabric's guard), and quantize the layers ourselves (see ``memfit.training.bitsandbytes_layers``).
"""

from __future__ import annotations

import os
import platform
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import BitsandbytesPrecision, Precision

from memfit.errors import UserError
from memfit.training.bitsandbytes_layers import import_bitsandbytes, quantize_pending_layers
from memfit.training.quantizers import QuantizeKind, quantize_kind

PrecisionChoice = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "32", "16", "bf16", 32, 16]
# Lightning's older names, which litgpt's commands pass on to Fabric and Fabric still takes (with a warning); a
# YAML config or the command line may give the first two as numbers
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}

_TRUE_DTYPES = {"32-true": torch.float32, "16-true": torch.float16, "bf16-true": torch.bfloat16}


def default_precision(accelerator: str, planned: bool = False) -> str:
    """bf16-true on a GPU with bf16 (16-true on an older one), 32-true on a CPU; ``planned``: for an estimate of a GPU
    run on a machine without one, as on a bf16 GPU."""
    if accelerator != "cpu" and torch.cuda.is_available():
        return "bf16-true" if torch.cuda.is_bf16_supported() else "16-true"
    if accelerator != "cpu" and planned:
        return "bf16-true"
    return "32-true"


def sixteen_bit_matmul_instructions() -> list[str] | None:
    """Which of AVX512-BF16 and AMX this CPU has, by torch's own probes; None where this torch lacks them (they are
    private). Without either, oneDNN emulates bf16 and float16 matmuls."""
    cpu = getattr(torch, "cpu", None)
    probes = {
        "AVX512-BF16": getattr(cpu, "_is_avx512_bf16_supported", None),
        "AMX": getattr(cpu, "_is_amx_tile_supported", None),
    }
    if None in probes.values():
        return None
    return [name for name, probe in probes.items() if probe()]


def cpu_description() -> str:
    """This machine's CPU, for a benchmark's record: its model, the cores this process may use, and its 16-bit matmul
    instructions, on which a CPU's bf16 and float16 speed depends (``slow_half_precision_on_this_cpu``)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
        if line.startswith("model name")
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    found = sixteen_bit_matmul_instructions()
    instructions = "unknown" if found is None else ", ".join(found) or "none (bf16 and float16 emulated)"
    return (
        f"CPU: {names[0] if names else platform.processor() or platform.machine()}, {cores} cores,"
        f" 16-bit matmul instructions: {instructions}"
    )


def slow_half_precision_on_this_cpu(precision: str, accelerator: str) -> str | None:
    """A warning where a CPU run computes in 16 bits on a CPU without 16-bit matmul instructions. On a 2-core AMD EPYC
    with AVX2 only, a (512 x 128) @ (128 x 384) matmul took 24-37x the float32 one's time in bf16 and float16, and
    the signature command trained at 2,191 tokens/s in bf16-true against 3,599 in 32-true (30 s against 26 s), with
    bitsandbytes' backward already moved to torch's faster layout (``memfit.training.bitsandbytes_layers``)."""
    if accelerator != "cpu" or precision == "32-true" or sixteen_bit_matmul_instructions() != []:
        return None
    return (
        f"warning: --precision {precision} on a CPU without 16-bit matmul instructions (AVX512-BF16, AMX): PyTorch"
        " emulates them, many times slower than float32; --precision 32-true trains faster on this CPU"
    )


def resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "gpu":
        accelerator = "cuda"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise UserError("--accelerator cuda was given but no CUDA GPU is visible; use --accelerator cpu or auto")
    return accelerator


def check_combination(precision: str, quantize: str | None) -> None:
    """Stops impossible settings before anything is built or written."""
    if precision not in _TRUE_DTYPES and precision not in ("16-mixed", "bf16-mixed"):
        raise UserError(f"--precision {precision!r} is not one of 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true")
    if quantize is None:
        return
    kind = quantize_kind(quantize)
    if precision.endswith("-mixed"):
        raise UserError(
            f"--quantize {quantize} cannot be combined with --precision {precision}: quantized layers compute in one"
            " dtype; use --precision bf16-true (or 16-true / 32-true)"
        )
    if kind.needs_precision and precision != kind.needs_precision:
        raise UserError(
            f"--quantize {quantize} needs --precision {kind.needs_precision} ({kind.library}'s {kind.mode} computes"
            f" in it), got {precision}"
        )


def compute_dtype(precision: str) -> torch.dtype:
    return _TRUE_DTYPES.get(precision, torch.float32)


class CPUBitsandbytesPrecision(Precision):
    """Lightning's bitsandbytes plugin, usable on CPU. Delegates everything; quantizes what it converts."""

    def __init__(self, mode: str, dtype: torch.dtype) -> None:
        self._bnb = BitsandbytesPrecision(mode, dtype)
        self.mode = mode
        self.dtype = dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = self._bnb.convert_module(module)
        # Lightning defers 4-bit quantization to the first move to CUDA; on CPU that move never happens.
        quantize_pending_layers(module, torch.device("cpu"))
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return self._bnb.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        return self._bnb.module_init_context()

    def forward_context(self) -> AbstractContextManager:
        return self._bnb.forward_context()

    def convert_input(self, data: Any) -> Any:
        return self._bnb.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self._bnb.convert_output(data)


def fabric_precision(precision: str, quantize: QuantizeKind | None, accelerator: str, checkpoint_io=None) -> dict:
    """Keyword arguments for ``L.Fabric``: ``precision=``, or bitsandbytes' precision plugin in ``plugins=``; with
    ``checkpoint_io`` (a Lightning ``CheckpointIO``) in ``plugins=`` too. Call ``check_combination`` first."""
    plugins = [checkpoint_io] if checkpoint_io is not None else []
    if quantize is None or not quantize.replaces_layers:  # torchao's NF4Tensor dequantizes in F.linear: no plugin
        return {"precision": precision, "plugins": plugins}
    mode, dtype = quantize.mode, compute_dtype(precision)
    import_bitsandbytes()  # before Lightning's plugin imports it
    if accelerator == "cuda":
        return {"plugins": [BitsandbytesPrecision(mode, dtype), *plugins]}
    return {"plugins": [CPUBitsandbytesPrecision(mode, dtype), *plugins]}
