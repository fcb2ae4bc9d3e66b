"""The script's own training step run on fake tensors, for the estimate (``memfit.prediction.estimate``).

``trace_step`` builds the script's litgpt model under ``FakeTensorMode`` (shapes and dtypes, no memory) and calls the
script's own ``train_step`` (the function its ``fit()`` calls for each optimizer step: forward with its loss,
backward scaled by the micro-batch's share, clipping, optimizer step, zero_grad) for two optimizer steps, through
``TracingFabric``, a stand-in for the few Fabric calls a step makes. Live tensor bytes are counted with a
dispatch-mode tracker that serves as the phases' memory probe. The tracker sees what PyTorch allocates: activations,
logits chunks, gradient buffers, optimizer state and foreach scratch, exactly as the real step would. The result is
split by role with the ledger's own attribution, so a prediction and a measured ledger read the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from lightning.fabric.strategies import DDPStrategy
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # private to torch: the tracer's fake tensors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.args import StepSettings
from memfit.errors import UserError
from memfit.observatory.ledger import Ledger, PhaseRecord
from memfit.observatory.phase_names import FIRST_OPTIMIZER_STEP
from memfit.observatory.phases import PhaseMemory
from memfit.observatory.roles import role_addresses, sizes_by_role
from memfit.observatory.timeline import stack_by_role
from memfit.settings.run import ScriptStep
from memfit.training import compiled_blocks
from memfit.training.cuda_autocast import CudaAutocastRules
from memfit.training.loading import default_dtype, prepare_model
from memfit.training.loss import only_chunks
from memfit.training.optim import OptimizerInBackward, OptimizerKind, build_optimizer, optimizer_kind
from memfit.training.precision import compute_dtype
from memfit.training.quantizers import QuantizeKind
from memfit.training.sample import kv_cached
from memfit.training.strategy import BUCKET_COPIES, replicates_with_ddp

_DEVICE = torch.ops.prim.device.default
_ADD = torch.ops.aten.add.Tensor
_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
_CASTS = (torch.ops.aten._to_copy.default,)
_WITH_WEIGHTS = frozenset(_PRODUCTS + _CASTS)
"""The operators every traced op is checked against (``LiveBytes._note_weight_product``): one set lookup per op"""


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, for everything created while active (or ``track``ed).

    It is also the memory probe of the traced step's phases (``memfit.observatory.phases.PhaseMemory``).
    """

    kind = "predicted"
    cuda = False

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self._peaks: list = [0]
        """The values the peak is the largest of: one int in a concrete trace; in a symbolic one, the live bytes at
        each allocation that no other one is at least for every size (``_at_least``)"""
        self._peak = None
        self._refs: dict[int, weakref.ref] = {}
        self.clock = 0
        """Counts allocations and frees: the time axis of a fake step"""
        self.log: list[tuple] | None = None
        """While a list: every allocation and free as a profiler trace's memory event
        (``memfit.observatory.block_lifetimes``): ``(clock, bytes alive, +/-bytes, storage id, None)``, for the step's
        picture"""
        self.counting = True
        """False inside ``uncounted``"""
        self.shared_parameters: set[int] = set()
        """The ids of the parameters a model uses twice (a head tied to its embedding, ``shared_parameters``), whose
        two gradients a run sums in place (``_sums_in_place``)"""
        self.linear_weights: dict[int, tuple[weakref.ref, tuple]] = {}
        """The storages of the ``nn.Linear`` layers' weights (those quantization replaces) and their copies in another
        dtype, by the storage's id: the weak reference and the layer's ``(rows, columns, in the head)``"""
        self.weight_products: dict[tuple, int] = {}
        """The most bytes alive at a product with each shape of linear weight since the phase began (``reset_peak``),
        by ``(rows, columns, in the head, an input's gradient)``: where a quantized layer's dequantized copy of that
        weight sits beside them (``memfit.observatory.ledger.PhaseRecord.beside_weights``)"""

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._refs:
            return
        size = storage.nbytes()
        self._watch(storage, size)
        self.live += size
        self._raise_peak(self.live)
        self._note(size, key)

    @property
    def peak(self):
        """The most bytes alive since the phase began (``reset_peak``): in a symbolic trace a max of expressions, not
        a comparison, which would make the answer a guard and each new peak a new piece of the formula
        (``memfit.prediction.symbolic_step``)"""
        if self._peak is None:
            self._peak = functools.reduce(torch.sym_max, self._peaks)
        return self._peak

    def _raise_peak(self, live) -> None:
        if isinstance(live, int) and len(self._peaks) == 1 and isinstance(self._peaks[0], int):
            if live > self._peaks[0]:
                self._peaks[0], self._peak = live, None
            return
        # A symbolic maximum of every allocation's live bytes grows an argument each time two are not comparable by
        # sympy, and torch simplifies it again at each allocation: 40% of a symbolic trace. Kept as a list instead,
        # without the values some other one is at least for every size, and made a maximum once, when it is read.
        if any(_at_least(kept, live) for kept in self._peaks):
            return
        self._peaks = [kept for kept in self._peaks if not _at_least(live, kept)] + [live]
        self._peak = None

    @contextmanager
    def uncounted(self):
        """What is made inside is not counted: the intermediates of a kernel inductor fuses, which live in its
        registers (``memfit.training.compiled_blocks.traced_backend``)."""
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

    def _watch(self, storage, size: int) -> None:
        """Counts ``size`` bytes off when ``storage`` is freed."""
        key = id(storage)

        def freed(ref, key=key, size=size):
            if self._refs.get(key) is not ref:
                return  # handed over to another storage (``_hand_over``), whose free counts these bytes off
            self.live -= size
            del self._refs[key]
            self._note(-size, key)

        self._refs[key] = weakref.ref(storage, freed)

    def _sums_in_place(self, func, args) -> bool:
        """Whether ``func(*args)`` is autograd's sum of two gradients of a parameter used twice. A run adds the second
        into the first in place (the engine's input buffer steals a tensor nobody else holds), but never a tensor
        subclass's, so on fake tensors the sum is a new tensor: a tied head's weight more at backward's peak than a
        run holds (pythia-14m's architecture tied, 2 x 128 tokens: 165.54 MiB predicted, 141.11 measured). The sum is
        the engine's when it runs between nodes, grad mode off, for the node that feeds the parameter's
        ``AccumulateGrad``."""
        if func is not _ADD or torch.is_grad_enabled() or not isinstance(args[0], torch.Tensor):
            return False
        node = torch._C._current_autograd_node()
        if node is None:
            return False
        for feeds, _ in node.next_functions:
            variable = getattr(feeds, "variable", None)
            if variable is not None and id(variable) in self.shared_parameters and variable.shape == args[0].shape:
                return True
        return False

    def _hand_over(self, first: torch.Tensor, total: torch.Tensor) -> None:
        """``total`` takes the place of ``first``, as an in-place sum leaves the one tensor: its bytes are counted off
        when ``total`` is freed, not ``first``."""
        storage = first.untyped_storage()
        if id(storage) not in self._refs:
            self.track(total)
            return
        del self._refs[id(storage)]
        self._watch(total.untyped_storage(), storage.nbytes())

    def _note(self, size: int, key: int) -> None:
        self.clock += 1
        if self.log is not None:
            self.log.append((self.clock, self.live, size, key, None))

    def reset_peak(self) -> None:
        self._peaks, self._peak = [self.live], None
        self.weight_products = {}

    def note_linear_weight(self, weight: torch.Tensor, key: tuple) -> None:
        storage = weight.untyped_storage()
        self.linear_weights[id(storage)] = (weakref.ref(storage), key)

    def _linear_weight(self, tensor) -> tuple | None:
        """The layer shape ``tensor`` is a weight of (or a view or cast of it), None where it is none's."""
        if not isinstance(tensor, torch.Tensor):
            return None
        storage = tensor.untyped_storage()
        ref, key = self.linear_weights.get(id(storage), (None, None))
        return key if ref is not None and ref() is storage else None  # an id can be a freed storage's again

    def _note_weight_product(self, func, args, out) -> None:
        """A linear layer computing with its weight: a matrix product with it (forward's output, or backward's gradient
        of the input), or a cast of it (mixed precision's), whose copy is the weight the product then takes. Where the
        layer is quantized, the product is where its dequantized copy is alive, with the product's output beside it."""
        if func in _CASTS:
            key = self._linear_weight(args[0])
            if key is not None and isinstance(out, torch.Tensor):
                self.note_linear_weight(out, key)
            return
        for arg in args:
            key = self._linear_weight(arg)
            if key is not None:
                # forward multiplies by the weight transposed, backward's input gradient by the weight as it is
                key = (*key, arg.is_contiguous())
                self.weight_products[key] = torch.sym_max(self.weight_products.get(key, 0), self.live)

    def allocated(self) -> int:
        return self.live

    def peak_and_current(self) -> tuple[int, int]:
        return self.peak, self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:
            # the autograd engine asks each tensor's device, two calls in three of a traced step: answered as
            # FakeTensor answers it, without a second dispatch (nothing is allocated)
            tensor = args[0]
            if isinstance(tensor, FakeTensor) and not tensor.fake_mode.in_kernel_invocation:
                return tensor.fake_device
            return func(*args)
        out = func(*args, **(kwargs or {}))
        if not self.counting:
            return out
        if self.shared_parameters and self._sums_in_place(func, args):
            self._hand_over(args[0], out)
            return out
        if isinstance(out, torch.Tensor):
            self.track(out)
        elif isinstance(out, (tuple, list)) and all(isinstance(leaf, torch.Tensor) or leaf is None for leaf in out):
            for leaf in out:
                if leaf is not None:
                    self.track(leaf)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.track(leaf)
        if func in _WITH_WEIGHTS and self.linear_weights:
            self._note_weight_product(func, args, out)
        return out


def _at_least(a, b) -> bool:
    """Whether byte count ``a`` is at least ``b`` for every size, where either may be a symbolic trace's expression in
    sizes (positive): their difference, multiplied out, is a sum of products of sizes with no negative coefficient.
    False where that does not show it, which only keeps a value that was not needed: a term with a function of the
    sizes (a chunk's rows, ``FloorDiv(B * (1 - T), 8)``, or a maximum) may be negative whatever its coefficient."""
    if isinstance(a, int) and isinstance(b, int):
        return a >= b
    import sympy  # symbolic traces only

    difference = sympy.expand(as_expression(a) - as_expression(b))
    if difference.is_Number:
        return difference >= 0
    return all(
        coefficient >= 0 and term.is_polynomial(*term.free_symbols) is True
        for term, coefficient in difference.as_coefficients_dict().items()
    )


def as_expression(value):
    """A byte count as a sympy expression: a symbolic trace's SymInt's own, or an int's constant."""
    import sympy

    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value)


class CompilingLiveBytes(LiveBytes):
    """``LiveBytes`` for a step whose blocks are compiled: torch.compile declines to trace beneath a dispatch mode
    unless the mode says it is part of the machinery (as FakeTensorMode does), and this one only counts what is
    allocated, so the compiled graphs run beneath it as they run in a step."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True


class CompiledTraces:
    """The one backend every compiled fake step of this process compiles its blocks with, and the plan it compiled
    them for. Dynamo keeps a block's compiled graphs per code object and backend, the sequence length is dynamic
    (``memfit.training.compiled_blocks``) and a second micro-batch size makes the batch dynamic too, so the graphs
    compiled for one plan serve a search's next lengths, micro-batches, depths and checkpointed blocks: compiled
    afresh, each estimate of the 1.1B architecture's compiled plan took 5-16 s of this CPU (13 of them, 120 s of its
    planner's 144), reused about 1-2 s, to the same byte (``tests/test_compile.py``). So the backend outlives a trace
    and counts into whichever trace runs it (``live``). Where anything else about the plan or the model changed,
    what dynamo compiled is forgotten first, as a run forgets it, and again once ``GRAPHS_KEPT`` graphs are kept:
    past the recompilation limit dynamo would run a block eager, silently."""

    GRAPHS_KEPT = 32
    """Graphs compiled since dynamo last forgot them past which a trace starts afresh: each trace adds a few at most
    (training, validation, the sample's prefill and decoding, each static then dynamic), and the recompilation limit
    is kept above this and them (``RECOMPILE_LIMIT``) so that no block ever runs eager in a compiled plan's trace"""
    RECOMPILE_LIMIT = 64

    def __init__(self) -> None:
        self.live: LiveBytes | None = None
        self.compiled_for: tuple | None = None
        self.forgotten = 0  # compiled_blocks.forgotten when this last readied a trace
        self.graphs = 0
        self._traced_backend = None

    def backend(self, graph, example_inputs):
        """torch.compile's backend for the fake steps' blocks: ``traced_backend``'s, counting the graphs it compiles"""
        if self._traced_backend is None:  # AOTAutograd's imports, only where a step compiles
            self._traced_backend = compiled_blocks.traced_backend(self._uncounted)
        self.graphs += 1
        return self._traced_backend(graph, example_inputs)

    def _uncounted(self):
        return self.live.uncounted()

    def begin(self, script: ScriptStep, plan: Plan, live: LiveBytes, symbolic: bool = False) -> None:
        """Readies dynamo for a trace of ``plan`` that counts into ``live``: what it compiled is kept for the plan
        compiled for last at another sequence length, micro-batch size, depth or number of checkpointed blocks, and
        forgotten otherwise, and wherever a run compiled since (``compile_blocks`` forgot it, then compiled with
        inductor). A ``symbolic`` trace (``memfit.prediction.symbolic_step``) always starts afresh, and so does the
        trace after it: its sizes are another ShapeEnv's symbols, which no concrete trace's graph was compiled for."""
        self.live = live
        compiled_for = None
        if not symbolic:
            compiled_for = (
                script.model_class,
                script.block_class,
                script.mark_trainable,
                script.tie_embeddings,
                dataclasses.replace(script.config, n_layer=0),
                dataclasses.replace(
                    plan,
                    sequence_length=0,
                    validation_length=0,
                    micro_batch_size=1,
                    accumulation=1,
                    blocks=0,
                    activation_checkpointing=0,
                ),
            )
        kept = (
            compiled_for is not None
            and compiled_for == self.compiled_for
            and self.forgotten == compiled_blocks.forgotten
            and self.graphs <= self.GRAPHS_KEPT
        )
        if not kept:
            torch._dynamo.reset()
            self.graphs = 0
        self.compiled_for, self.forgotten = compiled_for, compiled_blocks.forgotten
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, self.RECOMPILE_LIMIT)


COMPILED_TRACES = CompiledTraces()


class TracingFabric:
    """The Fabric calls a script's ``train_step`` makes, for fake tensors on one process. Mixed precision is the
    autocast Fabric's module wrapper would enter around forward. ``strategy``: the run's where a step asks for it
    (DDP's, whose buckets keep the gradients), else None."""

    device = torch.device("cpu")
    world_size = 1
    global_rank = 0

    def __init__(self, strategy=None) -> None:
        self.strategy = strategy

    def no_backward_sync(self, module, enabled: bool = True):
        return nullcontext()  # one process: there is no gradient all-reduce to skip

    def backward(self, tensor: torch.Tensor) -> None:
        tensor.backward()

    def clip_gradients(
        self,
        module,
        optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        # Fabric's signature, so a step may clip either way
        gradients = [p for p in module.parameters() if p.grad is not None]
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(gradients, clip_val)
            return None
        return torch.nn.utils.clip_grad_norm_(gradients, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def all_reduce(self, tensor, reduce_op: str = "mean"):
        return tensor


class _Autocast(torch.nn.Module):
    """The model under a -mixed precision's autocast, as Fabric's module wrapper runs it; like that wrapper, it lends
    the model's attributes (the loss reads ``lm_head`` and ``config``: without them every -mixed estimate failed).
    ``cuda_rules``: the run is on a GPU, whose autocast computes more functions in float32 than the CPU's
    (``memfit.training.cuda_autocast``)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, cuda_rules: bool) -> None:
        super().__init__()
        self.module, self.dtype, self.cuda_rules = module, dtype, cuda_rules

    def forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=self.dtype), CudaAutocastRules() if self.cuda_rules else nullcontext():
            return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # this wrapper's own: the module it holds
        except AttributeError:
            return getattr(self.module, name)


@dataclass
class Plan:
    """The settings an estimate depends on beyond the model."""

    micro_batch_size: int
    accumulation: int
    sequence_length: int
    precision: str
    quantize: QuantizeKind | None
    """The ``--quantize`` entry (``memfit.training.quantizers.QUANTIZERS``); None: the base is not quantized"""
    optimizer: OptimizerKind
    """The ``--optimizer`` entry (``memfit.training.optim.OPTIMIZERS``)"""
    activation_checkpointing: int
    """Blocks whose activations are recomputed, of ``blocks`` (True and False, as a flag gives them, become all and
    none)"""
    optimizer_in_backward: bool
    strategy: str
    cpu_offload: bool
    world_size: int
    step_settings: StepSettings = StepSettings()
    """What the script's step reads from the flags (``memfit.args.StepSettings``)"""
    accumulate_unsharded: bool = False
    """FSDP: gradients kept unsharded through a step's micro-batches, reduce-scattered once
    (--fsdp.accumulate_unsharded)"""
    fsdp_replicas: int = 1
    """FSDP: copies of the sharded model (HYBRID_SHARD: one per node), each sharded over world_size / fsdp_replicas"""
    cublas_workspaces: int = 0
    """Bytes of cuBLAS workspaces the device's allocator holds (``cublas_workspace_bytes``; 0 on CPU)"""
    accelerator: str = "cuda"
    """Where the run would train: what the prediction is to be compared with depends on it"""
    blocks: int = 0
    """The model's transformer blocks (``config.n_layer``)"""
    activation_offloading: bool = False
    """The activations saved for backward wait in host memory (``memfit.training.activation_offload``)"""
    validation_length: int = 0
    """The run's phases beside its steps (``memfit.observatory.phase_names.RUN_PHASES``), traced after the step: a
    validation's samples are this many tokens, in batches of ``micro_batch_size`` (0: the run does not validate)"""
    sample_new_tokens: int = 0
    """The sample generated after a validation: its new tokens (``--eval.max_new_tokens``; 0: none)"""
    sample_prompt_tokens: int = 0
    """Its prompt's tokens: plain text's first ones (``memfit.training.sample.TEXT_PROMPT_TOKENS``); 0: an
    instruction's, not read before launch, taken as long as a validation sample within the context (the most it can
    be)"""
    resumes: bool = False
    """The run resumes from a checkpoint: its weights and optimizer state are loaded beside the model's"""
    profiled: bool = False
    """The run records a profiler window (``--profile.enabled``), whose host memory a CPU run's tensors share"""
    profile_with_stack: bool = False
    """The window records every Python call too (``--profile.with_stack``): its host memory a traced allocation is
    larger (``memfit.observatory.profiling.window_host_bytes``)"""
    compile: bool = False
    """The blocks compiled (``--compile``): traced as AOTAutograd's min-cut partition of each block's graph, what
    inductor fuses left uncounted (``memfit.training.compiled_blocks.traced_backend``)"""
    gradient_as_bucket_view: bool = True
    """DDP: each gradient a view into its all-reduce buckets (``--ddp.gradient_as_bucket_view``); false: the buckets
    are a copy of the gradients beside them (``bucket_copies``)"""

    def at_length(self, tokens: int) -> Plan:
        """This plan with ``--train.max_seq_length`` ``tokens``, which cuts validation samples as it cuts training
        ones: a validation sample is taken as long as a training one (the most it can be, where the data's lengths
        are not read)."""
        return dataclasses.replace(
            self, sequence_length=tokens, validation_length=tokens if self.validation_length else 0
        )

    def __post_init__(self) -> None:
        # a count, never a bool: True == 1 would make "every block" and "one block" one plan (and one trace)
        if isinstance(self.activation_checkpointing, bool):
            if self.activation_checkpointing and not self.blocks:
                raise ValueError("Plan(activation_checkpointing=True) needs blocks, the model's depth")
            self.activation_checkpointing = self.blocks if self.activation_checkpointing else 0

    @property
    def gradient_buckets(self) -> bool:
        """DDP: the gradients are views into its all-reduce buckets, alive from the first step to the last
        (``memfit.training.strategy.keeps_gradient_buckets``)."""
        return replicates_with_ddp(self.strategy, self.world_size) and self.gradient_as_bucket_view

    @property
    def bucket_copies(self) -> bool:
        """DDP with ``--ddp.gradient_as_bucket_view false`` (torch's default, as litgpt runs DDP): its buckets, made
        when it wraps the model, are a copy of the trained gradients for the whole run, and the gradients are freed
        between steps (``memfit.training.strategy.keeps_gradient_buckets``)."""
        return replicates_with_ddp(self.strategy, self.world_size) and not self.gradient_as_bucket_view

    @property
    def checkpointing_flag(self) -> str:
        """``--activation_checkpointing``'s value for this plan: true, false or the number of blocks."""
        if self.activation_checkpointing in (0, self.blocks):
            return str(self.activation_checkpointing == self.blocks).lower()
        return str(self.activation_checkpointing)

    def describe(self) -> str:
        parts = [f"micro_batch_size {self.micro_batch_size} x {self.accumulation}", self.precision]
        parts += [self.quantize.name] if self.quantize else []
        parts += [self.optimizer.name]
        if self.activation_checkpointing:
            every = self.activation_checkpointing == self.blocks
            parts.append(
                "activation_checkpointing" + ("" if every else f" {self.checkpointing_flag}/{self.blocks} blocks")
            )
        parts += ["optimizer_in_backward"] if self.optimizer_in_backward else []
        parts += ["activation_offloading"] if self.activation_offloading else []
        parts += ["compiled"] if self.compile else []
        if self.strategy == "fsdp":
            replicated = f" (hybrid: {self.fsdp_replicas} x {self.world_size // self.fsdp_replicas})"
            parts.append(
                f"fsdp x{self.world_size}"
                + (replicated if self.fsdp_replicas > 1 else "")
                + (" + cpu_offload" if self.cpu_offload else "")
            )
            parts += ["unsharded accumulation"] if self.accumulate_unsharded and self.accumulation > 1 else []
        elif self.world_size > 1:  # DDP: each process holds the whole model
            parts.append(
                f"ddp x{self.world_size}" + (" (buckets a copy of the gradients)" if self.bucket_copies else "")
            )
        return ", ".join(parts)

    def as_flags(self) -> str:
        """The flags that run these settings; the global batch is left as it is, so the accumulation follows from
        the micro-batch size."""
        flags = [f"--train.micro_batch_size {self.micro_batch_size}", f"--precision {self.precision}"]
        # --quantize null too: pasted after a --config that quantizes, the flags must still run this plan
        flags += [f"--quantize {self.quantize.name if self.quantize else 'null'}"]
        flags += [f"--optimizer {self.optimizer.name}"]
        flags += [f"--activation_checkpointing {self.checkpointing_flag}"]
        flags += ["--optimizer_in_backward true"] if self.optimizer_in_backward else []
        flags += ["--activation_offloading true"] if self.activation_offloading else []
        flags += ["--compile true"] if self.compile else []
        if self.strategy == "fsdp":
            flags += ["--strategy fsdp", f"--fsdp.cpu_offload {str(self.cpu_offload).lower()}"]
            flags += [f"--devices {self.world_size}"] if self.fsdp_replicas == 1 else []
            flags += ["--fsdp.accumulate_unsharded true"] if self.accumulate_unsharded else []
        flags += ["--ddp.gradient_as_bucket_view false"] if self.bucket_copies else []
        return " ".join(flags)

    def as_dict(self) -> dict:
        """The plan as JSON holds it: the quantizer and the optimizer by their flag values."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return values | {
            "quantize": self.quantize.name if self.quantize else None,
            "optimizer": self.optimizer.name,
            "step_settings": dataclasses.asdict(self.step_settings),
        }


def create_optimizer_state(model, optimizer, params: list[torch.nn.Parameter], phase=None) -> dict[str, int]:
    """One step of ``optimizer`` (each inner one for ``OptimizerInBackward``) on zero gradients, which are then freed:
    its state exists afterwards, as after a run's first step. ``phase``: ``PhaseMemory.phase``, to measure that step
    as a run's first ``optimizer_step`` (the weights and every gradient alive, the state made inside it). Returns what
    each role held at that step's end, its gradients still alive."""
    for param in params:
        param.grad = torch.zeros_like(param)
    inners = optimizer.inner if isinstance(optimizer, OptimizerInBackward) else [optimizer]
    with nullcontext() if phase is None else phase("optimizer_step"):
        for inner in inners:
            inner.step()
    at_end = sizes_by_role(role_addresses(model, optimizer))
    for inner in inners:
        inner.zero_grad(set_to_none=True)
    return at_end


def traced_optimizer(plan: Plan) -> OptimizerKind:
    """The optimizer the fake step runs (``OptimizerKind.traced_as``): 8-bit and paged ones are AdamW-shaped and
    adjusted analytically after. One the registry gives no model for is refused, not traced as another."""
    traced_as = plan.optimizer.traced_as
    if traced_as is None:
        raise UserError(
            f"--estimate cannot model --optimizer {plan.optimizer.name}'s memory (memfit.training.optim.OPTIMIZERS gives it no"
            " traced_as); run without --estimate, or estimate with the optimizer it is closest to"
        )
    return optimizer_kind(traced_as)


SHALLOW_DEPTHS = (2, 3)
"""The depths of the models a deep one's step is extrapolated from (``extrapolated_step``). A trace costs about a
block's worth besides its blocks (the embedding, head, loss and optimizer: 0.09 s against 0.08 s a block, the
embedded model's step on 2 cores), so the two shallow traces cost what one 5- or 6-block trace does: a model of 5
blocks or fewer is traced whole."""


def traced_step(
    script: ScriptStep, plan: Plan, whole_step: bool = True, extrapolate: bool = False
) -> tuple[Ledger, torch.nn.Module, int, dict | None, list]:
    """The traced step for this plan. Quantization, 8-bit/paged state and FSDP are adjusted analytically afterwards,
    so plans that differ only in those share one trace (the planner tries many such plans). ``extrapolate``: from
    shallow models of the same blocks where that holds (``extrapolated_step``), the timeline then None."""
    if extrapolate and not whole_step and extrapolates(script, plan):
        return extrapolated_step(script, plan)
    key = (
        whole_step,
        plan.micro_batch_size,
        min(plan.accumulation, 2),
        plan.sequence_length,
        plan.precision,
        plan.precision.endswith("-mixed") and plan.accelerator != "cpu",  # CUDA's autocast rules
        plan.activation_checkpointing,
        traced_optimizer(plan),
        plan.optimizer_in_backward,
        plan.step_settings,
        plan.gradient_buckets,
        plan.bucket_copies,
        plan.compile,
        plan.validation_length,
        plan.sample_new_tokens,
        plan.sample_prompt_tokens,
        plan.resumes,
    )
    if key not in script.traced:
        if len(script.traced) > 64:  # each holds a model of fake tensors: a planner's search keeps the latest
            script.traced.clear()
        script.traced[key] = trace_step(script, plan, whole_step=whole_step)
    return script.traced[key]


def extrapolated_step(script: ScriptStep, plan: Plan) -> tuple[Ledger, torch.nn.Module, int, None, list]:
    """The step of a model of n identical blocks from the traced steps of the same model 2 and 3 blocks deep: what
    each phase holds (its peak, each role at its end, the activations saved) grows by the same bytes with each block
    added (their weights, gradients, optimizer state and saved activations), while the embedding, the head, the loss
    and one block's transient scratch stay. A trace costs per operation, so the two shallow traces together cost
    about a sixth of a 32-block one's (7 s for Llama-3.1-8B on 2 cores); a planner's search makes dozens.

    Checkpointing every block is extrapolated from shallow models checkpointing all of theirs; k of n (spread from
    the first, the last never among them) as the unchecked model less what checkpointing the first of 3 blocks
    saves and k - 1 times what a second saves. The search's answers are confirmed with whole-depth traces
    (``memfit.prediction.most_that_fits``); the timeline, which
    only a whole-depth trace has, is None (FSDP's estimate, which reads it, is always traced whole)."""
    n, k = script.config.n_layer, plan.activation_checkpointing
    shallow = {depth: _shallow_script(script, depth) for depth in SHALLOW_DEPTHS}

    def traced(depth: int, count: int):
        return traced_step(
            shallow[depth], dataclasses.replace(plan, blocks=depth, activation_checkpointing=count), whole_step=False
        )

    two, three = SHALLOW_DEPTHS
    every = k == n and n > 0
    low, high = traced(two, two if every else 0), traced(three, three if every else 0)
    # the first block checkpointed saves less than each one after it (measured on Llama-3.1-8B: 284 MiB against
    # 314), so both are taken from the 3-block model, with one and with two of its blocks checkpointed
    step = (traced(three, 1), traced(three, 2) if k > 1 else high, high) if 0 < k < n else None

    def grown(at_low, at_high, at_one=None, at_two=None, at_none=None) -> int:
        value = at_low + (n - two) * (at_high - at_low)
        return value + ((at_one - at_none) + (k - 1) * (at_two - at_one) if step else 0)

    ledger = Ledger(device="fake", measures="predicted")
    for name, record in high[0].phases.items():
        records = [low[0].phases[name], record] + ([t[0].phases[name] for t in step] if step else [])
        peak = grown(*(r.peak for r in records))
        ledger.phases[name] = PhaseRecord(
            peak=peak,
            roles_at_end={role: grown(*(r.roles_at_end.get(role, 0) for r in records)) for role in record.roles_at_end},
            activations=grown(*(r.activations for r in records)),
            beside_weights=_grown_beside_weights(records, peak, grown),
        )
    unsaved = grown(*(t[2] for t in (low, high, *(step or ()))))
    events = [(name, grown(*(dict(t[4])[name] for t in (low, high, *(step or ()))))) for name, _ in high[4]]
    return ledger, fake_model(script, plan), unsaved, None, events


def _grown_beside_weights(records: list[PhaseRecord], peak: int, grown) -> dict[tuple, int]:
    """The bytes alive at a phase's products with each shape of weight, for the deep model ``extrapolated_step``
    makes. A product every shallow trace makes (forward's, backward's input gradients) sits the same bytes below the
    phase's peak at every depth, so it grows with the peak. A checkpointed block's forward again in backward has no
    product in the unchecked traces, and where it sits below the peak depends on how many blocks are checkpointed
    around it: it is taken as close to the peak as any shallow trace that makes it has it (measured on a 6-block model
    from 3 checkpointed blocks on, exact; with fewer, further below the peak than that, so never under)."""
    shapes = {shape for record in records for shape in record.beside_weights}
    beside = {}
    for shape in shapes:
        if all(shape in record.beside_weights for record in records):
            beside[shape] = grown(*(record.beside_weights[shape] for record in records))
        else:
            below = [record.peak - record.beside_weights[shape] for record in records if shape in record.beside_weights]
            beside[shape] = peak - min(below)
    return beside


def extrapolates(script: ScriptStep, plan: Plan) -> bool:
    """Whether a search's estimate of ``plan`` comes from shallow traces (``extrapolated_step``): not FSDP's, whose
    estimate reads the timeline of a whole-depth trace, nor a model too shallow or irregular to be worth it."""
    return plan.strategy != "fsdp" and _worth_extrapolating(script.config)


def _worth_extrapolating(config) -> bool:
    """Whether every block of ``config`` is built alike (not where some layers attend through a sliding window and
    others do not, Gemma 2 and 3, nor in a model with per-layer lists of any other kind), and it is deeper than the
    shallow models together (``SHALLOW_DEPTHS``: shallower, one trace of the whole costs less)."""
    per_layer = [name for name, value in vars(config).items() if name.endswith("_indices") and value is not None]
    if any(len(set(getattr(config, name)[: config.n_layer])) > 1 for name in per_layer):
        return False
    return config.n_layer > sum(SHALLOW_DEPTHS)


def _shallow_script(script: ScriptStep, depth: int) -> ScriptStep:
    """``script`` on the same model ``depth`` blocks deep, kept with the script so its traces are reused."""
    key = ("shallow", depth)
    if key not in script.traced:
        script.traced[key] = dataclasses.replace(
            script, config=dataclasses.replace(script.config, n_layer=depth), traced={}
        )
    return script.traced[key]


def fake_model(script: ScriptStep, plan: Plan) -> torch.nn.Module:
    """The plan's model on fake tensors, prepared as a run prepares it, untraced: what the estimate reads of its
    shapes (its layers, blocks, embedding and head)."""

    param_dtype = torch.float32 if plan.precision.endswith("-mixed") else compute_dtype(plan.precision)
    key = ("model", param_dtype)  # the shapes the estimate reads do not depend on the rest of the plan
    if key not in script.traced:
        with FakeTensorMode(allow_non_fake_inputs=True):
            with default_dtype(param_dtype):
                model = script.model_class(script.config)
            prepare_model(model, script, activation_checkpointing=0, max_seq_length=plan.sequence_length)
        script.traced[key] = model
    return script.traced[key]


def _route_evenly(model: torch.nn.Module) -> None:
    """Gives each mixture-of-experts layer (litgpt's ``LLaMAMoE``: Mixtral, Qwen-MoE, DeepSeek) a forward that
    sends every expert the same share of the tokens. litgpt's own finds each expert's tokens with ``torch.where``,
    whose size depends on the router's values, which fake tensors do not have; the even share (tokens x experts
    per token / experts) is what a balanced router gives, and an unbalanced one moves memory between experts
    that run one after another. Every other tensor is litgpt's: the router, the top-k, the masks, the gathered
    inputs, each expert's activations and the output."""
    from litgpt.model import LLaMAMoE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        residual_x = x.clone()
        x = x.view(-1, C)  # (N, C), N = B * T
        config = self.config
        if not config.n_expert_groups:
            probs, indices = torch.topk(self.gate(x), config.n_expert_per_token)  # (N, k)
            probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        else:
            probs, indices = self.gate(x)
        if config.routed_scaling_factor != 1.0:
            probs = probs * config.routed_scaling_factor
        # litgpt's masks (n_expert, N, k), alive to the end as there; only their values would route the tokens
        masks = (indices.unsqueeze(-1) == torch.arange(config.n_expert, device=x.device)).permute(2, 0, 1)  # noqa: F841
        share = -(-x.size(0) * config.n_expert_per_token // config.n_expert)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            # stands for torch.where(masks[i]): two index tensors of the expert's share of the tokens
            token_idx = (torch.arange(share, device=x.device) + i * share) % x.size(0)
            expert_idx = torch.zeros_like(token_idx)
            y[token_idx] += probs[token_idx, expert_idx, None] * expert(x[token_idx])
        y = y.view(B, T, C)
        if config.n_shared_expert:
            y = y + self.shared_experts(residual_x)
        return y

    for module in model.modules():
        if isinstance(module, LLaMAMoE):
            module.forward = forward.__get__(module)


def _sliding_window_masks_at_once(model: torch.nn.Module) -> None:
    """Gives each sliding-window attention layer (Gemma 2 and 3) litgpt's training masks without litgpt's loop over
    their rows. litgpt builds the window mask one row at a time: ten-odd operations a token and layer, each slow on
    fake tensors (a 2B model took minutes at 8,192 tokens). The rows are filled in place, so the loop allocates
    nothing; this makes the same allocations in the same order (the causal mask and its bool copy, the window mask,
    the causal one dropped) where litgpt makes them, just before attention, and leaves the window's values unset:
    fake tensors have none. For the estimate's fake model only, in training (no KV cache)."""
    from litgpt.model import CausalSelfAttention

    def with_window_mask(litgpt_attention):
        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
            if mask is None:
                T = q.size(2)  # q: (B, nh_q, T, hs)
                causal = torch.ones(T, T, dtype=q.dtype, device=q.device).triu(diagonal=1)
                causal.masked_fill_(causal.bool(), float("-inf"))
                causal = causal.view(1, 1, T, T)
                mask = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).view(1, 1, T, T)
                del causal
            return litgpt_attention(q, k, v, mask)

        return attention

    for module in model.modules():
        if isinstance(module, CausalSelfAttention) and module.apply_sliding_window_attention:
            module.apply_sliding_window_attention = False  # litgpt's forward then builds no mask of its own
            module.scaled_dot_product_attention = with_window_mask(module.scaled_dot_product_attention)


class _Unread:
    """A fake loss's reduction, read back as a number: a fake tensor has no value to read (any tensor's ``item()``
    would be a fake operation), and the memory is what is traced, not the loss."""

    def item(self) -> float:
        return float("nan")


class _ValidatingFabric(TracingFabric):
    """What a script's ``validate`` calls, for fake tensors: its reduced loss is read back with ``item()``."""

    def all_reduce(self, tensor, reduce_op: str = "mean"):
        return _Unread()


def run_phases(
    script: ScriptStep,
    plan: Plan,
    stepped,
    model,
    optimizer,
    memory: PhaseMemory,
    weight_products: dict,
    batch_of,
    whole_step: bool = True,
) -> dict[str, PhaseRecord]:
    """The run's phases beside its steps (``memfit.observatory.phase_names.RUN_PHASES``) on what the traced step left:
    the weights, the optimizer's state (and DDP's buckets), as a run has them between two steps.

    - save: a one-device checkpoint's state dict is the tensors themselves, written from where they are, so it holds
      what the step left (FSDP's gathered state dict is added in ``memfit.prediction.estimate``);
    - resume: what the step left. The weights file is loaded, copied into the model and freed before the training
      state is loaded, whose optimizer state becomes the optimizer's own (on a GPU both are loaded to host memory
      first): on a CPU the phase peaks at the weights and the larger of the two, the state for every optimizer here;
    - validation: the script's own ``validate``, one batch of ``micro_batch_size`` x ``validation_length``, no graph;
    - generation: the sample's KV cache and mask for its whole length (``memfit.training.sample.kv_cached``), the
      prompt's forward, then one new token's. litgpt's ``generate`` itself reads each token to stop at the
      end-of-text one, which a fake tensor cannot tell: every later token's step is that one token's again.

    Each is a ``PhaseRecord`` with its peak and the roles at its end. What each phase makes beside what the step left
    depends on the batch, the lengths and the precision only (none keeps a graph, so not on what trains, the
    checkpointing or the optimizer): it is traced once for those, and a planner's other plans reuse it (with
    ``whole_step`` False, its validation runs two of its loss's chunks, as the planner's step does:
    ``memfit.training.loss.only_chunks``). ``weight_products``: what ``_phase_noting_weight_products`` keeps."""
    key = (
        "run phases",
        whole_step,
        plan.micro_batch_size,
        plan.validation_length,
        plan.sample_new_tokens,
        plan.sample_prompt_tokens,
        plan.precision,
        plan.precision.endswith("-mixed") and plan.accelerator != "cpu",  # CUDA's autocast rules
        plan.resumes,
    )
    # a symbolic trace's sizes (memfit.prediction.symbolic_step) are expressions: traced each time, not looked up
    symbolic = any(isinstance(value, torch.SymInt) for value in key)
    rises = None if symbolic else script.traced.get(key)
    if rises is None:
        with nullcontext() if whole_step else only_chunks(2):
            rises = _run_phase_rises(script, plan, stepped, memory, weight_products, batch_of)
        if not symbolic:
            script.traced[key] = rises
    held, roles = memory.probe.allocated(), sizes_by_role(role_addresses(model, optimizer))
    return {
        name: PhaseRecord(
            peak=held + rise,
            roles_at_end=roles,
            beside_weights={shape: held + at for shape, at in products.items()},
        )
        for name, (rise, products) in rises.items()
    }


def _run_phase_rises(
    script: ScriptStep, plan: Plan, stepped, memory: PhaseMemory, weight_products: dict, batch_of
) -> dict[str, tuple[int, dict]]:
    """How far each run phase of ``run_phases`` rises above what is alive when it starts, and the bytes alive at its
    products with each shape of linear weight (``PhaseRecord.beside_weights``) above it too."""
    phase = partial(_phase_noting_weight_products, memory, weight_products)
    rises = {}

    @contextmanager
    def traced(name: str):
        start = memory.probe.allocated()
        with phase(name):
            yield
        products = {shape: at - start for shape, at in weight_products.get(name, {}).items()}
        rises[name] = (memory.last[name] - start, products)

    with traced("save"):
        pass
    if plan.resumes:
        with traced("resume"):
            pass
    if plan.validation_length and script.validate is not None:
        with traced("validation"):
            script.validate(_ValidatingFabric(), stepped, [batch_of(plan.micro_batch_size, plan.validation_length)], 1)
    new_tokens = plan.sample_new_tokens
    prompt_tokens = min(plan.sample_prompt_tokens or plan.validation_length, script.config.block_size - new_tokens)
    if new_tokens and prompt_tokens > 0 and plan.validation_length:
        # the cache in the precision's dtype, as Fabric's init_tensor makes it
        made_as = partial(
            default_dtype, torch.float32 if plan.precision.endswith("-mixed") else compute_dtype(plan.precision)
        )
        with traced("generation"), torch.no_grad(), kv_cached(stepped, prompt_tokens + new_tokens, made_as):
            prompt = torch.randint(0, script.config.padded_vocab_size, (1, prompt_tokens))
            logits = stepped(prompt, input_pos=torch.arange(prompt_tokens))
            token = logits[0, -1].argmax().view(1, 1)
            del logits
            stepped(token, input_pos=torch.tensor([prompt_tokens]))
    return rises


@contextmanager
def _phase_noting_weight_products(memory: PhaseMemory, weight_products: dict, name: str):
    """``memory.phase(name)`` that also keeps, in ``weight_products[name]``, the most bytes alive at a product with
    each shape of linear weight while that phase runs (its largest over the phase's repeats)."""
    with memory.phase(name):
        yield
    noted = weight_products.setdefault(name, {})
    for shape, at in memory.probe.weight_products.items():
        noted[shape] = torch.sym_max(noted.get(shape, 0), at)


def shared_parameters(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters ``model`` holds in two places or more (a head tied to its embedding)."""
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    return {key for key, count in uses.items() if count > 1}


def trace_step(
    script: ScriptStep, plan: Plan, lr: float = 1e-4, whole_step: bool = True, shape_env=None
) -> tuple[Ledger, torch.nn.Module, int, dict | None, list]:
    """Two optimizer steps of the script's ``train_step`` on fake tensors; returns a ledger of the second (the
    optimizer state exists then), the model, the bytes of the inputs of its ``nn.Linear`` layers (the ones
    quantization replaces) that one forward's autograd did not save, the second step's memory by role over time
    (``memfit.observatory.timeline.stack_by_role``; None with ``shape_env``), and its phases in order with the
    allocations and frees in each. ``shape_env``: torch's symbolic shapes, where the plan's micro-batch size and
    sequence length are its symbols (``memfit.prediction.symbolic_step``): every size, and so every byte count, is
    then an expression."""

    mixed = plan.precision.endswith("-mixed")
    param_dtype = torch.float32 if mixed else compute_dtype(plan.precision)
    # made first: the compiled blocks' backend pauses it for what inductor fuses
    live = CompilingLiveBytes() if plan.compile else LiveBytes()
    if plan.compile:
        COMPILED_TRACES.begin(script, plan, live, symbolic=shape_env is not None)
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env):
        with default_dtype(param_dtype):
            model = script.model_class(script.config)
        _route_evenly(model)
        _sliding_window_masks_at_once(model)
        prepare_model(
            model,
            script,
            activation_checkpointing=plan.activation_checkpointing,
            max_seq_length=plan.sequence_length,
            compile=plan.compile,
            compile_backend=COMPILED_TRACES.backend if plan.compile else "inductor",
            compile_afresh=False,  # COMPILED_TRACES.begin forgets what it must
        )
        params = [p for p in model.parameters() if p.requires_grad]
        # 8-bit and paged optimizers are adjusted afterwards; their AdamW-shaped trace is the starting point. The same
        # constructor as the real run: fused AdamW (little scratch memory) where the device has it
        optimizer = build_optimizer(
            traced_optimizer(plan),
            params,
            lr,
            0.0,
            in_backward=plan.optimizer_in_backward,
            precision=plan.precision,
        )
        for tensor in list(model.parameters()) + list(model.buffers()):
            live.track(tensor)
        live.shared_parameters = shared_parameters(model)
        in_the_head = set(model.lm_head.modules())
        for module in model.modules():
            if type(module) is torch.nn.Linear:  # the layers quantization replaces
                live.note_linear_weight(module.weight, (*module.weight.shape, module in in_the_head))
        half = torch.bfloat16 if plan.precision.startswith("bf16") else torch.float16
        stepped = _Autocast(model, half, cuda_rules=plan.accelerator != "cpu") if mixed else model
        memory = PhaseMemory(live)
        memory.watch(model, optimizer)
        weight_products: dict[str, dict[tuple, int]] = {}
        phase = partial(_phase_noting_weight_products, memory, weight_products)
        # weak references (holding a storage would change the memory being counted), by the reference's id
        linear_inputs: dict[int, tuple[weakref.ref, int]] = {}
        in_forward = [False]  # the model's own forward, not a block recomputed in backward (checkpointing)

        def forward_starts(_module, _args) -> None:
            linear_inputs.clear()  # keep the latest micro-batch's only
            in_forward[0] = True

        def note_input(_module, args) -> None:
            if in_forward[0] and isinstance(args[0], torch.Tensor):
                storage = args[0].untyped_storage()
                ref = weakref.ref(storage)
                linear_inputs.setdefault(id(ref), (ref, storage.nbytes()))

        # Not the head's: memfit.training.loss never leaves a tensor saved inside the head for backward (it takes a
        # frozen head's gradients in forward, and recomputes a trained one), whatever bitsandbytes saves there.
        head = set(model.lm_head.modules())
        # A hook inside a compiled block breaks its graph at every linear layer (each piece then compiled and
        # partitioned alone: adapter_v2's compiled step was predicted 14.71 MiB, 10.45 measured); only quantization
        # needs the inputs, and bitsandbytes' layers break the graph there anyway
        noted = not plan.compile or plan.quantize is not None
        hooks = [
            m.register_forward_pre_hook(note_input)
            for m in model.modules()
            if noted and type(m) is torch.nn.Linear and m not in head
        ]
        hooks.append(model.register_forward_pre_hook(forward_starts))
        hooks.append(model.register_forward_hook(lambda *_: in_forward.__setitem__(0, False)))
        head_starts: list[int] = []
        """The clock where each forward of the recorded step reaches the final norm, the head's FSDP unit: a rank
        holds different gathered weights from there on (``memfit.prediction.estimate.fsdp_phases``)"""

        def head_starts_here(_module, _args) -> None:
            if live.log is not None:
                head_starts.append(live.clock)

        hooks.append(model.transformer.ln_f.register_forward_pre_hook(head_starts_here))
        ledger = Ledger(device="fake", measures="predicted")
        extra = 1 if script.text_batches else 0  # pretraining's blocks hold the next token too

        def batch_of(rows: int, length: int) -> dict:
            ids = torch.randint(0, script.config.padded_vocab_size, (rows, length + extra))
            return {"input_ids": ids} if script.text_batches else {"input_ids": ids, "labels": ids}

        micro_batches = min(plan.accumulation, 2)  # a third micro-batch meets the same memory as the second
        # The second micro-batch alone, on gradients already there as the first leaves them, meets every peak of the
        # two (the first's are the same without the gradients) at half the trace, and its picture is what a run
        # traced from its last micro-batch draws: that micro-batch, the optimizer step and zero_grad
        second_alone = micro_batches == 2 and not plan.optimizer_in_backward
        with live:
            if plan.bucket_copies:
                # DDP's buckets beside the gradients, one flat tensor per dtype, from its wrap to the run's end: the
                # ledger finds them where a run's ledger does (memfit.observatory.roles.bucket_copies)
                setattr(
                    model,
                    BUCKET_COPIES,
                    {
                        index: torch.zeros(sum(param.numel() for param in params if param.dtype == dtype), dtype=dtype)
                        for index, dtype in enumerate(sorted({param.dtype for param in params}, key=str))
                    },
                )
            # Step 1 only brings the optimizer state into being: one optimizer step on zero gradients makes the same
            # state tensors. A fake trace costs per operation, not per byte, so the short forward and backward this
            # took before cost as much as the recorded step's own (a third of a 7B estimate).
            # a run's first step makes the state in its optimizer step (FIRST_OPTIMIZER_STEP), except in backward
            first_step_roles = create_optimizer_state(
                model, optimizer, params, None if plan.optimizer_in_backward else phase
            )
            if plan.gradient_buckets:
                # DDP's buckets: every gradient a view into one, allocated before the step and kept through it (the
                # step's zero_grad zeroes them in place)
                for dtype in {param.dtype for param in params}:
                    alike = [param for param in params if param.dtype == dtype]
                    bucket = torch.zeros(sum(param.numel() for param in alike), dtype=dtype)
                    for param, view in zip(alike, bucket.split([param.numel() for param in alike]), strict=True):
                        param.grad = view.view_as(param)
                    del bucket
            elif second_alone:
                for param in params:
                    param.grad = torch.zeros_like(param)
            if second_alone:
                micro_batches = 1
            live.log = []  # the recorded step's allocations, for its picture
            # the planner's peaks need two chunks of the head (memfit.training.loss.only_chunks); the estimate's picture
            # all
            with memory.recording(ledger), nullcontext() if whole_step else only_chunks(2):
                script.train_step(
                    TracingFabric(DDPStrategy() if plan.gradient_buckets else None),
                    stepped,
                    optimizer,
                    [batch_of(plan.micro_batch_size, plan.sequence_length)] * micro_batches,
                    [1 / micro_batches] * micro_batches,
                    plan.step_settings,
                    phase,
                    2,
                )
            live.log, events = None, live.log
            for hook in hooks:  # the step's own: the run's phases are not the step's forward
                hook.remove()
            for name, record in ledger.phases.items():
                record.beside_weights = weight_products.get(name, {})
            beside = run_phases(script, plan, stepped, model, optimizer, memory, weight_products, batch_of, whole_step)
            if FIRST_OPTIMIZER_STEP in memory.peaks and not plan.resumes:  # a resumed run loads its state
                beside[FIRST_OPTIMIZER_STEP] = PhaseRecord(
                    peak=memory.peaks[FIRST_OPTIMIZER_STEP], roles_at_end=first_step_roles
                )
            for name, record in beside.items():
                ledger.phases[name] = record
    timeline = None
    # a formula keeps no timeline: stacking one of expressions would be 40% of its trace, and would add guards
    if shape_env is None:
        timeline = stack_by_role(ledger, events, memory.ranges, per_ms=1)
        timeline["head_starts"] = [clock - memory.ranges[0][0] for clock in head_starts]  # on the timeline's axis
        timeline["x_label"] = "allocations and frees in the predicted optimizer step"
    # the last micro-batch's forward: inputs of the layers quantization replaces that autograd did not keep
    unsaved = sum(size for key, (_, size) in linear_inputs.items() if key not in memory.saved_storage_refs)
    phase_events = [(name, end - start) for start, end, name in memory.ranges]
    return ledger, model, unsaved, timeline, phase_events
