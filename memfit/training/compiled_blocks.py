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

import operator
from collections import deque
from contextlib import nullcontext

import torch
from torch import fx, nn

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


forgotten = 0
"""How many times ``compile_blocks`` has made dynamo forget what this process compiled: the estimate keeps its fake
steps' graphs only while no run has compiled since (``memfit.prediction.fake_step.CompiledTraces``)"""


def compile_blocks(model: nn.Module, block_class: type, backend="inductor", forget_earlier: bool = True) -> int:
    """Compiles each ``block_class`` module of ``model`` in place (after checkpointing and offloading have wrapped
    it, so that their regions are part of its graph); returns how many. ``backend``: torch.compile's (the estimate's
    fake steps pass one built on ``traced_backend``). Dynamo treats a block's parameters as inputs
    (``inline_inbuilt_nn_modules``), so one compiled graph serves every block. What an earlier run in this process
    compiled (the tests run several) is forgotten first: its guards would count against the recompilation limit.
    ``forget_earlier`` false keeps it: the estimate's fake steps, whose graphs serve one plan at other sizes, forget
    for themselves (``memfit.prediction.fake_step.CompiledTraces``)."""
    global forgotten
    if forget_earlier:
        torch._dynamo.reset()
        forgotten += 1
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


def traced_backend(uncounted=nullcontext):
    """What the estimate compiles a fake step's blocks with: AOTAutograd's joint graph, decomposed as inductor
    decomposes it, split by the min-cut partitioner (what the forward saves for backward, what backward computes
    again), each half then run node by node on the fake tensors (``_FusedInterpreter``). What inductor writes to
    memory is allocated as a run allocates it: an extern kernel's output (a matmul, an attention, a fallback) and a
    fused kernel's output that an extern kernel or the graph's caller reads. A fused kernel's intermediates live in its
    registers: their operations run inside ``uncounted()`` (the estimate's counter paused,
    ``memfit.prediction.fake_step.LiveBytes.uncounted``). Like inductor, each half frees its inputs as it last reads
    them. Inductor's own partitioner is not used: it needs inductor's graph lowering around it. Its reuse of one
    buffer for another of the same size is not modelled."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def as_inductor_allocates(graph: fx.GraphModule, _example_inputs):
        allocates = _inductor_allocates(graph.graph)

        def run(args: list):
            inputs = deque(args)
            args.clear()  # inductor's calling convention: the callee owns its inputs and frees them at their last read
            return _FusedInterpreter(graph, allocates, uncounted, inputs).run(enable_io_processing=False)

        run._boxed_call = True  # torch's mark for a function that takes its inputs as one list it may clear
        return run

    return aot_autograd(
        fw_compiler=as_inductor_allocates,
        bw_compiler=as_inductor_allocates,
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )


_MATMUL_TEMPLATES = {torch.ops.aten.addmm, torch.ops.aten.baddbmm, torch.ops.aten._int_mm}
"""Lowered by inductor, but to a matmul template or an extern kernel, whose output is written to memory"""


def _inductor_allocates(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a decomposed graph whose outputs inductor writes to memory: those it runs as extern kernels (no
    lowering of its own, a fallback, or one whose inputs must be realized: matmuls, convolutions, attention; a
    higher-order operation), and those an extern kernel or the graph's output reads. The rest are fused."""
    from torch._inductor import lowering

    def extern(node: fx.Node) -> bool:
        if node.op != "call_function" or node.target is operator.getitem:
            return False
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            return True  # a higher-order operation or a Python function: not fused with its neighbours
        packet = target.overloadpacket
        lowered = target in lowering.lowerings or packet in lowering.lowerings
        fallback = target in lowering.fallbacks or packet in lowering.fallbacks
        realizes = target in lowering.needs_realized_inputs or packet in lowering.needs_realized_inputs
        return fallback or not lowered or realizes or packet in _MATMUL_TEMPLATES

    externs = {node for node in graph.nodes if extern(node)}
    read = {node for node in graph.nodes for user in node.users if user in externs or user.op == "output"}
    return externs | read


class _FusedInterpreter(fx.Interpreter):
    """Runs a graph on fake tensors with the nodes inductor fuses (not in ``allocates``) inside ``uncounted()``, its
    inputs taken from ``inputs`` as read and every value freed after its last use."""

    def __init__(self, module: fx.GraphModule, allocates: set[fx.Node], uncounted, inputs: deque) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.allocates, self.uncounted, self.inputs = allocates, uncounted, inputs

    def placeholder(self, target, args, kwargs):
        return self.inputs.popleft()

    def run_node(self, node: fx.Node):
        fused = node.op == "call_function" and node not in self.allocates
        with self.uncounted() if fused else nullcontext():
            return super().run_node(node)


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
