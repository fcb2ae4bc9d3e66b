"""Each transformer block's forward and backward as a range of the profiler's trace, so the ledger names the block an
allocation was made in (``memfit.trace_events.block_at``).

An eager block's allocations carry their operator and source line, which say little about which of 32 alike blocks
made them; a compiled block's carry neither: its kernels run inside one call of the compiled graph (``## Call
CompiledFxGraph ##``), fused operations under one name, and its backward inside ``CompiledFunctionBackward``. The
ranges are opened and closed by hooks around the block (forward) and on its output's and input's gradients
(backward), outside what torch.compile compiles, so they are the same for an eager and a compiled block.

Backward begins at the node that made the block's output and ends when the gradient of its input is complete (that
input's other uses, the residual connection, are inside the block); a block whose input needs no gradient (the first,
over a frozen embedding) ends where the next range begins, or with backward. A checkpointed block's recomputation
runs inside its backward's range.
"""

from __future__ import annotations

import re

import torch
from torch.autograd.profiler import record_function

from memfit.trace_events import BLOCK_RANGE

_BLOCK_NAME = re.compile(r"(?:^|\.)(transformer\.h\.\d+)$")
"""A litgpt block's place in the model, under Fabric's and FSDP's wrappers alike"""

_MARKED = "_memfit_block_ranges"


def mark_block_ranges(model: torch.nn.Module) -> int:
    """Hooks each transformer block of ``model`` (litgpt's ``transformer.h.N``; a checkpointing wrapper's, which holds
    it) so its forward and backward are profiler ranges named ``memfit.block transformer.h.N`` (``... backward``);
    returns how many. Once per model."""
    if getattr(model, _MARKED, False):
        return 0
    setattr(model, _MARKED, True)
    backward: list[record_function] = []  # the one block whose backward is running: at most one at a time
    marked = 0
    for qualified, module in model.named_modules():
        found = _BLOCK_NAME.search(qualified)
        if found is None:
            continue
        _hook(module, found.group(1), backward)
        marked += 1
    return marked


def _hook(block: torch.nn.Module, name: str, backward: list) -> None:
    forward: list[record_function] = []

    def close_backward(*_args) -> None:
        while backward:
            backward.pop().__exit__(None, None, None)

    def open_backward(*_args) -> None:
        close_backward()
        opened = record_function(f"{BLOCK_RANGE}{name} backward")
        opened.__enter__()
        backward.append(opened)

    def before(_module, args) -> None:
        opened = record_function(f"{BLOCK_RANGE}{name}")
        opened.__enter__()
        forward.append((opened, args[0] if args and isinstance(args[0], torch.Tensor) else None))

    def after(_module, _args, output) -> None:
        if not forward:
            return
        opened, x = forward.pop()
        opened.__exit__(None, None, None)
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.grad_fn.register_prehook(lambda grad_outputs: open_backward())
            if x is not None and x.requires_grad:
                x.register_hook(lambda grad: close_backward())
            else:
                out.grad_fn.register_prehook(
                    lambda grad_outputs: torch.autograd.Variable._execution_engine.queue_callback(close_backward)
                )

    block.register_forward_pre_hook(before)
    block.register_forward_hook(after, always_call=True)
