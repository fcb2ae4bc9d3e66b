"""``--compile true``: the model's transformer blocks compiled one by one with ``torch.compile``, as torchtune and
torchtitan compile theirs: every block has the same code, so the first block's compilation serves the others (its
FX graph is cached), and compile time does not grow with the model's depth.

Each block is compiled in place (``nn.Module.compile``): its parameters keep their names, so checkpoints, LoRA's
filters and FSDP see the same model. The compilation itself happens in the first step, which is why the run says
so before it and how long it took after it. On a CPU, inductor writes and builds C++: it needs a C++ compiler.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.errors import UserError


def check_compiler(accelerator: str) -> None:
    """On a CPU, the C++ compiler inductor builds its kernels with (``$CXX``, else g++), refused in one line where
    there is none: torch's own error came only in the first step, as a traceback."""
    if accelerator != "cpu":
        return
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        raise UserError(
            "--compile true on a CPU: torch.compile's inductor builds C++ kernels and found no C++ compiler ($CXX,"
            " else g++); install g++ (apt-get install g++), set CXX, or drop --compile"
        ) from None


def compile_blocks(model: nn.Module, block_class: type) -> int:
    """Compiles each ``block_class`` module of ``model`` in place (after checkpointing and offloading have wrapped
    it, so that their regions are part of its graph); returns how many. Dynamo treats a block's parameters as inputs
    (``inline_inbuilt_nn_modules``), so one compiled graph serves every block. What an earlier run in this process
    compiled (the tests run several) is forgotten first: its guards would count against the recompilation limit."""
    torch._dynamo.reset()
    blocks = [module for module in model.modules() if isinstance(module, block_class)]
    for block in blocks:
        block.compile()
    return len(blocks)
