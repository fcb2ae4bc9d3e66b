"""``--compile true``: the model's transformer blocks compiled one by one with ``torch.compile``, as torchtune and
torchtitan compile theirs: every block has the same code, so the first block's compilation serves the others (its
FX graph is cached), and compile time does not grow with the model's depth.

Each block's forward is compiled in place: its parameters keep their names, so checkpoints, LoRA's filters and FSDP
see the same model. The compilation itself happens in the first step, which is why the run says so before it and how
long it took after it. On a CPU, inductor writes and builds C++: it needs a C++ compiler.

A fine-tuning batch is as long as its longest sample, so the sequence length is marked dynamic: full fine-tuning,
the adapters and pretraining compile once for every length (and once more for validation, without gradients).
LoRA does not: litgpt's LoRA update of the query, key and value projections is a grouped convolution, and inductor
compiles a convolution's backward for one length, so each new length compiles again (``benchmarks/compile.py``: 17
compilations in 12 steps of the embedded default), until the limit below; then dynamo runs the blocks eager.
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


def compile_blocks(model: nn.Module, block_class: type, backend="inductor") -> int:
    """Compiles each ``block_class`` module of ``model`` in place (after checkpointing and offloading have wrapped
    it, so that their regions are part of its graph); returns how many. ``backend``: torch.compile's (the estimate's
    fake step passes ``traced_backend``'s). Dynamo treats a block's parameters as inputs
    (``inline_inbuilt_nn_modules``), so one compiled graph serves every block. What an earlier run in this process
    compiled (the tests run several) is forgotten first: its guards would count against the recompilation limit."""
    torch._dynamo.reset()
    blocks = [module for module in model.modules() if isinstance(module, block_class)]
    # Code that branches on a block's index (litgpt's adapters: which blocks have a prefix) is compiled once per
    # block, and training and validation (no grad) once each: past torch's limit of 8 compilations of one function,
    # dynamo would run the remaining blocks eager, saying so only in a log line
    limit = 2 * len(blocks) + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    for block in blocks:
        block.register_forward_pre_hook(_sequence_length_varies)
        # the forward compiled, not the call (``nn.Module.compile``): the hook above then runs before the compiled
        # frame is entered, where marking a size dynamic still counts
        block.forward = torch.compile(block.forward, backend=backend)
    return len(blocks)


def traced_backend():
    """What the estimate compiles a fake step's blocks with: AOTAutograd's joint graph split by the min-cut partitioner
    that inductor uses (what the forward saves for backward, what backward computes again), each half then run as it
    is, operation by operation, on the fake tensors. What it leaves out is inductor's own work: fusing operations, so
    that their intermediates never exist, and its buffer reuse; the transients it counts are an upper bound."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def as_it_is(graph, _example_inputs):
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=as_it_is, bw_compiler=as_it_is, partition_fn=min_cut_rematerialization_partition)


def _sequence_length_varies(_block, args) -> None:
    # A fine-tuning batch is as long as its longest sample, so the sequence length changes from step to step; told
    # so, dynamo compiles one graph for every length instead of one per length (which it did until its limit of 8
    # recompilations, then ran the rest eager). The hook runs before the compiled call: the block's input x is
    # (B, T, n_embd); the rope's cos and sin hold T in one of their dimensions (litgpt's layout differs by version).
    x, cos, sin = args[:3]
    tokens = x.size(1)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    for rope in (cos, sin):
        for dim, size in enumerate(rope.shape):
            if size == tokens:
                torch._dynamo.maybe_mark_dynamic(rope, dim)
