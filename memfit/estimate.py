"""Peak memory before launch: the script's own training step run on fake tensors, plus what fake tensors cannot run.

``estimate`` builds the script's litgpt model under ``FakeTensorMode`` (shapes and dtypes, no memory) and calls the
script's own ``train_step`` (the function its ``fit()`` calls for each optimizer step: forward with its loss,
backward scaled by the micro-batch's share, clipping, optimizer step, zero_grad) for two optimizer steps, through
``TracingFabric``, a stand-in for the few Fabric calls a step makes. Live tensor bytes are counted with a
dispatch-mode tracker that serves as the phases' memory probe. The tracker sees what PyTorch allocates: activations,
logits chunks, gradient buffers, optimizer state and foreach scratch, exactly as the real step would. The result is
split by role with the ledger's own attribution, so a prediction and a measured ledger read the same way.

What fake tensors cannot run is added analytically, with the constants stated:

- bitsandbytes 4-bit weights: 0.5 byte per weight, plus absmax (4 bytes per 64-weight block; with -dq 1 byte per
  block and 4 bytes per 256 blocks). While a quantized layer computes, its dequantized weight exists transiently:
  the largest one is added to forward and backward. bitsandbytes before 0.43.2 also kept every 4-bit layer's input
  for backward (``MatMul4Bit``); the traced forward records the inputs of the layers that get quantized, and those
  autograd did not save anyway are added to the activations when the modelled version (``BITSANDBYTES``, the
  installed one unless a caller sets it) is older.
- bitsandbytes 8-bit optimizers: 2 bytes of state per parameter in tensors of 4096 or more elements (fp32 states
  below that). Paged optimizers keep the state of tensors of 1e5 elements or more in CUDA managed memory, outside
  ``max_memory_allocated`` (counted as 0); smaller tensors' state stays on the device.
- FSDP over N ranks: parameters, gradients and optimizer state divided by N, plus two gathered transformer blocks
  (prefetch), the gathered root unit (embedding, final norm, head: not resharded between forward and backward) and
  one block of gradients; with CPU offload they live in CPU memory and only those blocks stay. With gradient
  accumulation the gradients stay unsharded, at full size, between micro-batches (``no_backward_sync``).

- CUDA: PyTorch's cuBLAS workspaces, from the same allocator, alive for the whole run: one per thread that runs
  matmuls (forward's main thread, backward's autograd device thread), each 32 MiB on sm90 and 8 MiB + 128 KiB on
  other GPUs unless ``CUBLAS_WORKSPACE_CONFIG`` says otherwise (``cublas_workspace_bytes``).

The estimate predicts ``max_memory_allocated``. nvidia-smi shows more: the CUDA context (about 0.5 GiB) and the
caching allocator's reserve (typically 5-15% above the allocated peak), which are not counted.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib.metadata
import os
import re
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.ledger import Ledger, PhaseRecord
from memfit.loading import apply_activation_checkpointing, default_dtype
from memfit.memory import fmt_bytes
from memfit.nf4 import packed_bytes, quantizable
from memfit.optim import OptimizerInBackward, make_optimizer
from memfit.phases import PhaseMemory
from memfit.precision import compute_dtype
from memfit.profiling import window_host_bytes
from memfit.roles import GATHERED, ROLES, UNATTRIBUTED, WORKSPACES
from memfit.timeline import stack_by_role

CUDA_CONTEXT_BYTES = 512 * 2**20
BITSANDBYTES = importlib.metadata.version("bitsandbytes")
"""The bitsandbytes version whose 4-bit layers the estimate models: the installed one, unless a caller sets it"""


def _keeps_4bit_inputs(version: str) -> bool:
    """bitsandbytes before 0.43.2 saved each 4-bit layer's input for backward, even for a frozen weight."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return parts < (0, 43, 2)


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive, and their peak, for everything created while active (or ``track``ed).

    It is also the memory probe of the traced step's phases (``memfit.phases.PhaseMemory``).
    """

    kind = "predicted"
    cuda = False

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self.clock = 0
        """Counts allocations and frees: the time axis of a fake step"""
        self.log: list[tuple[int, int, int]] | None = None
        """While a list: ``(clock, +/-bytes, storage id)`` of every allocation and free, for the step's picture"""

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._refs:
            return
        size = storage.nbytes()

        def freed(_ref, key=key, size=size):
            self.live -= size
            self._refs.pop(key, None)
            self._note(-size, key)

        self._refs[key] = weakref.ref(storage, freed)
        self.live += size
        self.peak = max(self.peak, self.live)
        self._note(size, key)

    def _note(self, size: int, key: int) -> None:
        self.clock += 1
        if self.log is not None:
            self.log.append((self.clock, size, key))

    def reset_peak(self) -> None:
        self.peak = self.live

    def allocated(self) -> int:
        return self.live

    def peak_and_current(self) -> tuple[int, int]:
        return self.peak, self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


@dataclass
class ScriptStep:
    """What the estimate takes from a script: its model, what trains, and its own ``train_step``."""

    model_class: type
    block_class: type
    config: object
    mark_trainable: Callable | None
    """Freezes all but the method's parameters (and applies the method's workarounds); None: every weight trains"""
    train_step: Callable
    """The script's step: ``train_step(fabric, model, optimizer, micro_batches, shares, max_norm, phases, step)``"""
    text_batches: bool = False
    """Pretraining: a batch is ``input_ids`` of T + 1 tokens (inputs and shifted targets); else SFT ``labels``"""


class TracingFabric:
    """The Fabric calls a script's ``train_step`` makes, for fake tensors on one process. Mixed precision is the
    autocast Fabric's module wrapper would enter around forward."""

    device = torch.device("cpu")
    world_size = 1
    global_rank = 0

    def no_backward_sync(self, module, enabled: bool = True):
        return nullcontext()  # one process: there is no gradient all-reduce to skip

    def backward(self, tensor: torch.Tensor) -> None:
        tensor.backward()

    def clip_gradients(self, module, optimizer, max_norm: float, error_if_nonfinite: bool = True) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(
            [p for p in module.parameters() if p.grad is not None], max_norm, error_if_nonfinite=error_if_nonfinite
        )

    def all_reduce(self, tensor, reduce_op: str = "mean"):
        return tensor


class _Autocast(torch.nn.Module):
    """The model under a -mixed precision's autocast, as Fabric's module wrapper runs it; like that wrapper, it lends
    the model's attributes (the loss reads ``lm_head`` and ``config``: without them every -mixed estimate failed)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=self.dtype):
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
    quantize: str | None
    optimizer: str
    activation_checkpointing: bool
    optimizer_in_backward: bool
    strategy: str
    cpu_offload: bool
    world_size: int
    max_norm: float | None = None
    cublas_workspaces: int = 0
    """Bytes of cuBLAS workspaces the device's allocator holds (``cublas_workspace_bytes``; 0 on CPU)"""
    accelerator: str = "cuda"
    """Where the run would train: what the prediction is to be compared with depends on it"""

    def describe(self) -> str:
        parts = [f"micro_batch_size {self.micro_batch_size} x {self.accumulation}", self.precision]
        parts += [self.quantize] if self.quantize else []
        parts += [self.optimizer] + (["activation_checkpointing"] if self.activation_checkpointing else [])
        parts += ["optimizer_in_backward"] if self.optimizer_in_backward else []
        if self.strategy == "fsdp":
            parts.append(f"fsdp x{self.world_size}" + (" + cpu_offload" if self.cpu_offload else ""))
        elif self.world_size > 1:  # DDP: each process holds the whole model
            parts.append(f"ddp x{self.world_size}")
        return ", ".join(parts)


@dataclass
class Estimate:
    plan: Plan
    phases: dict = field(default_factory=dict)
    """phase -> {"peak": bytes, "roles": {role: bytes}}"""
    fitting: list = field(default_factory=list)
    """With a memory budget: (slowdown, Estimate) of the settings that fit, fastest first"""
    host: dict = field(default_factory=dict)
    """What lives in host memory instead of the device's: ``paged_state`` (bitsandbytes managed memory, paged in as
    the device has room) and ``offloaded_params``/``offloaded_trainable`` (FSDP CPU offload), in bytes / elements"""
    parameters: int = 0
    trainable: int = 0
    timeline: dict = field(default_factory=dict, repr=False)
    """The predicted step's memory by role over its allocations (``memfit.timeline.stack_by_role``), for a picture"""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p]["peak"])

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]["peak"]

    def as_dict(self) -> dict:
        return {
            "plan": dataclasses.asdict(self.plan),
            "peak_bytes": self.peak,
            "peak_phase": self.peak_phase,
            "phases": self.phases,
            "measures": "predicted max_memory_allocated (tensor memory)",
        }

    def table(self) -> str:
        phases = [p for p in ("forward", "backward", "optimizer_step") if p in self.phases]
        lines = ["role".ljust(18) + "".join(p.rjust(15) for p in phases)]
        # FSDP's gathered weights and CUDA's workspaces where a plan has them
        shown = [
            role
            for role in PREDICTED_ROLES
            if role not in (GATHERED, WORKSPACES) or any(self.phases[p]["roles"].get(role) for p in phases)
        ]
        for role in shown:
            lines.append(
                role.ljust(18) + "".join(fmt_bytes(self.phases[p]["roles"].get(role, 0)).rjust(15) for p in phases)
            )
        lines.append("peak".ljust(18) + "".join(fmt_bytes(self.phases[p]["peak"]).rjust(15) for p in phases))
        return "\n".join(lines)


PREDICTED_ROLES = ROLES + (GATHERED, "temporaries", WORKSPACES)


def cublas_workspace_bytes(accelerator: str) -> int:
    """What PyTorch's cuBLAS workspaces take from the allocator of a training process on ``accelerator``.

    PyTorch gives each (cuBLAS handle, stream) pair a workspace from the caching allocator, and handles are per
    thread: a training step runs forward's matmuls on the main thread and backward's on autograd's device thread, so
    a process holds two. Each is ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT`` pairs summed, or by default
    4096 KiB x 8 on sm90 (H100, H200) and 4096 KiB x 2 + 16 KiB x 8 elsewhere (PyTorch's CublasHandlePool.cpp). With
    no GPU visible (an estimate made for another machine) the second is assumed. A ledger measures them by freeing
    them (``memfit.allocator_snapshot.measure_cublas_workspaces``)."""
    if accelerator not in ("cuda", "gpu"):
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if pairs:
        per_thread = sum(int(size) * 1024 * int(count) for size, count in pairs)
    else:
        sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        per_thread = 4096 * 1024 * 8 if sm90 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return 2 * per_thread


def _predicted_roles(record: PhaseRecord) -> dict[str, int]:
    """The traced phase's peak split by role: each role's size at the phase's end, then the activations saved, in
    that order and capped by the peak; ``temporaries`` is the rest of the predicted peak (transient buffers).

    A split of a prediction, made to add up; the measured ledger attributes real allocations instead.
    """
    remaining = record.peak
    split = {}
    for role in ROLES[:5]:
        split[role] = min(record.roles_at_end.get(role, 0), remaining)
        remaining -= split[role]
    split["activations"] = min(record.activations, remaining)
    split["temporaries"] = remaining - split["activations"]
    return split


_FAKE_STEPS: dict = {}


def create_optimizer_state(optimizer, params: list[torch.nn.Parameter]) -> None:
    """One step of ``optimizer`` (each inner one for ``OptimizerInBackward``) on zero gradients, which are then freed:
    its state exists afterwards, as after a run's first step."""
    for param in params:
        param.grad = torch.zeros_like(param)
    for inner in optimizer.inner if isinstance(optimizer, OptimizerInBackward) else [optimizer]:
        inner.step()
        inner.zero_grad(set_to_none=True)


def _traced_optimizer(plan: Plan) -> str:
    """The optimizer the fake step runs: 8-bit and paged ones are AdamW-shaped and adjusted analytically after."""
    return plan.optimizer if plan.optimizer in ("SGD", "AdamW-foreach", "AdamW-for-loop") else "AdamW"


def _fake_step(
    script: ScriptStep, plan: Plan, whole_step: bool = True
) -> tuple[Ledger, torch.nn.Module, int, dict, list]:
    """The traced step for this plan. Quantization, 8-bit/paged state and FSDP are adjusted analytically afterwards,
    so plans that differ only in those share one trace (the planner tries many such plans)."""
    key = (
        whole_step,
        id(script),
        plan.micro_batch_size,
        min(plan.accumulation, 2),
        plan.sequence_length,
        plan.precision,
        plan.activation_checkpointing,
        _traced_optimizer(plan),
        plan.optimizer_in_backward,
        plan.max_norm,
    )
    if key not in _FAKE_STEPS:
        _FAKE_STEPS.clear() if len(_FAKE_STEPS) > 64 else None
        # holding the script keeps its id unique
        _FAKE_STEPS[key] = (_trace_fake_step(script, plan, whole_step=whole_step), script)
    return _FAKE_STEPS[key][0]


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


def _trace_fake_step(
    script: ScriptStep, plan: Plan, lr: float = 1e-4, whole_step: bool = True
) -> tuple[Ledger, torch.nn.Module, int, dict, list]:
    """Two optimizer steps of the script's ``train_step`` on fake tensors; returns a ledger of the second (the
    optimizer state exists then), the model, the bytes of the inputs of its ``nn.Linear`` layers (the ones
    quantization replaces) that one forward's autograd did not save, the second step's memory by role over
    time (``memfit.timeline.stack_by_role``), and its phases in order with the allocations and frees in each."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # private to torch: imported where it is used

    mixed = plan.precision.endswith("-mixed")
    param_dtype = torch.float32 if mixed else compute_dtype(plan.precision)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with default_dtype(param_dtype):
            model = script.model_class(script.config)
        _route_evenly(model)
        _sliding_window_masks_at_once(model)
        if script.mark_trainable is not None:
            script.mark_trainable(model)
        if plan.activation_checkpointing:
            apply_activation_checkpointing(model, script.block_class)
        model.max_seq_length = min(plan.sequence_length, script.config.block_size)
        params = [p for p in model.parameters() if p.requires_grad]
        # 8-bit and paged optimizers are adjusted afterwards; their AdamW-shaped trace is the starting point
        family = _traced_optimizer(plan)
        # the same constructor as the real run: fused AdamW (little scratch memory) where the device has it
        if plan.optimizer_in_backward:
            optimizer = OptimizerInBackward(family, params, lr, 0.0, "cpu")
        else:
            optimizer = make_optimizer(family, params, lr, 0.0, "cpu", precision=plan.precision)
        live = LiveBytes()
        for tensor in list(model.parameters()) + list(model.buffers()):
            live.track(tensor)
        stepped = (
            _Autocast(model, torch.bfloat16 if plan.precision.startswith("bf16") else torch.float16) if mixed else model
        )
        memory = PhaseMemory(live)
        memory.watch(model, optimizer)
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

        # Not the head's: memfit.loss never leaves a tensor saved inside the head for backward (it takes a frozen
        # head's gradients in forward, and recomputes a trained one), whatever bitsandbytes saves there.
        head = set(model.lm_head.modules())
        hooks = [
            m.register_forward_pre_hook(note_input)
            for m in model.modules()
            if type(m) is torch.nn.Linear and m not in head
        ]
        hooks.append(model.register_forward_pre_hook(forward_starts))
        hooks.append(model.register_forward_hook(lambda *_: in_forward.__setitem__(0, False)))
        ledger = Ledger(device="fake", measures="predicted")
        extra = 1 if script.text_batches else 0  # pretraining's blocks hold the next token too

        def batch_of(rows: int, length: int) -> dict:
            ids = torch.randint(0, script.config.padded_vocab_size, (rows, length + extra))
            return {"input_ids": ids} if script.text_batches else {"input_ids": ids, "labels": ids}

        micro_batches = min(plan.accumulation, 2)  # a third micro-batch meets the same memory as the second
        # The planner needs the peaks only: the second micro-batch alone, on gradients already there as the first
        # leaves them, meets every peak of the two (the first's are the same without the gradients), at half the
        # trace; the picture of a whole step is the estimate's own.
        second_alone = not whole_step and micro_batches == 2 and not plan.optimizer_in_backward
        with live:
            # Step 1 only brings the optimizer state into being: one optimizer step on zero gradients makes the same
            # state tensors. A fake trace costs per operation, not per byte, so the short forward and backward this
            # took before cost as much as the recorded step's own (a third of a 7B estimate).
            create_optimizer_state(optimizer, params)
            if second_alone:
                micro_batches = 1
                for param in params:
                    param.grad = torch.zeros_like(param)
            live.log = []  # the recorded step's allocations, for its picture
            with memory.recording(ledger):
                script.train_step(
                    TracingFabric(),
                    stepped,
                    optimizer,
                    [batch_of(plan.micro_batch_size, plan.sequence_length)] * micro_batches,
                    [1 / micro_batches] * micro_batches,
                    plan.max_norm,
                    memory.phase,
                    2,
                )
            live.log, events = None, live.log
        for hook in hooks:
            hook.remove()
    timeline = stack_by_role(ledger, events, memory.ranges, per_ms=1)
    timeline["x_label"] = "allocations and frees in the predicted optimizer step"
    # the last micro-batch's forward: inputs of the layers quantization replaces that autograd did not keep
    unsaved = sum(size for key, (_, size) in linear_inputs.items() if key not in memory.saved_storage_refs)
    phase_events = [(name, end - start) for start, end, name in memory.ranges]
    return ledger, model, unsaved, timeline, phase_events


def _quantized_bytes(numel: int, quantize: str) -> int:
    if quantize == "torchao.nf4":
        return packed_bytes(numel)
    if quantize.endswith("-dq"):
        return numel // 2 + numel // 64 + (numel // (64 * 256)) * 4
    return numel // 2 + (numel // 64) * 4


def estimate(script: ScriptStep, plan: Plan, whole_step: bool = True) -> Estimate:
    """The predicted peaks of ``plan``; ``whole_step=False`` (the planner) traces only what the peaks need."""
    ledger, model, unsaved_linear_inputs, traced_timeline, phase_events = _fake_step(script, plan, whole_step)
    dtype_bytes = (
        torch.finfo(torch.float32 if plan.precision.endswith("-mixed") else compute_dtype(plan.precision)).bits // 8
    )
    linears = [m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear]
    # torchao's NF4 quantizes only the weights whose shape it (and FSDP's split over the ranks) takes whole
    quantized_linears = (
        [
            m.weight.numel()
            for m in model.modules()
            if type(m) is torch.nn.Linear and quantizable(m.weight.shape, plan.world_size)
        ]
        if plan.quantize == "torchao.nf4"
        else linears
    )
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    blocks = [m for m in model.modules() if isinstance(m, script.block_class)]
    nf4_weights = (
        {
            id(m.weight)
            for m in model.modules()
            if type(m) is torch.nn.Linear and quantizable(m.weight.shape, plan.world_size)
        }
        if plan.quantize == "torchao.nf4"
        else set()
    )

    def stored(parameters) -> int:  # as FSDP gathers them: an NF4 weight packed
        return sum(packed_bytes(p.numel()) if id(p) in nf4_weights else p.numel() * dtype_bytes for p in parameters)

    block_bytes = stored(blocks[0].parameters()) if blocks else 0
    # FSDP wraps each block; the rest (embedding, final norm, head) is the root unit, gathered for the whole
    # forward and backward (the root is not resharded after forward)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root_bytes = stored(p for p in model.parameters() if id(p) not in in_blocks)
    block_trainable = sum(p.numel() for p in blocks[0].parameters() if p.requires_grad) * dtype_bytes if blocks else 0

    result = Estimate(plan=plan, parameters=sum(p.numel() for p in model.parameters()), trainable=sum(trainable))
    # bitsandbytes pages optimizer state into CUDA managed memory; on CPU its paged optimizers keep the state as the
    # unpaged ones do (with a warning), in the same memory as everything else
    paged = plan.optimizer.startswith("Paged") and plan.accelerator != "cpu"
    if paged:
        per_element = 8 if plan.optimizer == "PagedAdamW" else 2
        result.host["paged_state"] = per_element * sum(n for n in trainable if n >= 1e5)
    result.host["profiler_window"] = window_host_bytes(phase_events, plan.accumulation)
    if plan.cpu_offload and plan.accelerator != "cpu":  # on a CPU run the host is the device: nothing moves
        result.host["offloaded_params"] = sum(p.numel() for p in model.parameters()) * dtype_bytes
        result.host["offloaded_trainable"] = sum(trainable)
    for name in ledger.phases:
        roles = _predicted_roles(ledger.phases[name])
        if plan.quantize and plan.quantize != "bnb.int8-training":
            full = sum(quantized_linears) * dtype_bytes
            packed = sum(_quantized_bytes(n, plan.quantize) for n in quantized_linears)
            roles["params_frozen"] = max(0, roles["params_frozen"] - full)
            roles["params_quantized"] = packed
            if name in ("forward", "backward") and quantized_linears:
                # the dequantized weight of the largest layer; torchao's NF4 dequantization (get_original_weight)
                # holds about three more of its size at once (measured on CPU, torchao 0.18: 3.8 MiB beside a 1 MiB
                # head, against bitsandbytes' one copy)
                copies = 4 if plan.quantize == "torchao.nf4" else 1
                roles["temporaries"] += copies * max(quantized_linears) * dtype_bytes
                if plan.quantize.startswith("bnb.") and _keeps_4bit_inputs(BITSANDBYTES):
                    roles["activations"] += unsaved_linear_inputs
        elif plan.quantize == "bnb.int8-training" and name in ("forward", "backward"):
            roles["temporaries"] += max(linears)  # its int8 copy
        if plan.optimizer in ("AdamW8bit", "PagedAdamW8bit", "PagedAdamW"):
            # bitsandbytes keeps fp32 state below min_8bit_size (4096 elements); paged optimizers page only tensors of
            # 1e5 elements or more into CUDA managed memory (outside the allocator's counters): smaller ones, such
            # as every LoRA matrix of a 7B model, stay on the device as usual
            on_device = [n for n in trainable if n < 1e5] if paged else trainable
            if plan.optimizer == "PagedAdamW":
                roles["optimizer_state"] = 8 * sum(on_device)
            else:
                roles["optimizer_state"] = sum(8 * n if n < 4096 else 2 * n for n in on_device)
        roles[WORKSPACES] = plan.cublas_workspaces  # allocated at the first matmuls, never freed
        result.phases[name] = {"peak": sum(roles.values()), "roles": roles}
    if plan.strategy == "fsdp":
        traced = {name: _predicted_roles(ledger.phases[name]) for name in ledger.phases}
        for name, roles in fsdp_phases(
            traced_timeline,
            {name: result.phases[name]["roles"] for name in ledger.phases},
            traced,
            world_size=plan.world_size,
            accumulation=plan.accumulation,
            offloaded=plan.cpu_offload and plan.accelerator != "cpu",
            block_bytes=block_bytes,
            root_bytes=root_bytes,
            block_trainable=block_trainable,
        ).items():
            roles[WORKSPACES] = plan.cublas_workspaces
            result.phases[name] = {"peak": sum(roles.values()), "roles": roles}
    result.timeline = _adjusted_timeline(
        traced_timeline, _predicted_roles(ledger.phases["optimizer_step"]), result.phases["optimizer_step"]["roles"]
    )
    return result


def fsdp_phases(
    timeline: dict,
    predicted: dict[str, dict],
    traced: dict[str, dict],
    *,
    world_size: int,
    accumulation: int,
    offloaded: bool,
    block_bytes: int,
    root_bytes: int,
    block_trainable: int,
) -> dict[str, dict]:
    """Each phase's peak and its roles on one rank of torch's second FSDP (``fully_shard`` on each block, then the
    root), from the step traced on one process: at every allocation and free of the traced ``timeline`` the roles
    alive are taken as a rank holds them, and each phase's peak is the highest such moment (the moment of the
    single-process peak need not be the rank's: sharding shrinks the gradients, not the activations).

    At each moment: weights and optimizer state are 1/world (on the host with ``offloaded``); gradients are 1/world
    once reduce-scattered, but under ``no_backward_sync`` (accumulation) they stay unsharded, at full size, until the
    optimizer step. In forward and backward a rank also holds two gathered blocks (the one computing and the one
    prefetched) and the whole root (gathered for the whole step), and in backward without accumulation the
    unsharded gradient of the block being reduced. The optimizer's own scratch is per shard. ``predicted`` and
    ``traced``: each phase's roles with and without the analytic adjustments made before (8-bit or paged state),
    which shift the constant roles.
    """
    constant = ("params_trainable", "params_frozen", "params_quantized", "optimizer_state")
    shard = (lambda size: 0) if offloaded else (lambda size: size // world_size)
    phases: dict[str, dict] = {}
    for start, end, name in timeline["phases"]:
        shift = {role: predicted[name].get(role, 0) - traced[name].get(role, 0) for role in constant}
        unsharded_grads = accumulation > 1 and not offloaded and name not in ("optimizer_step", "zero_grad")
        entering = max(0, bisect.bisect_left(timeline["ms"], start) - 1)  # the level the phase starts from
        for i in range(entering, len(timeline["ms"])):
            if timeline["ms"][i] > end:
                break
            level = {role: values[i] + shift.get(role, 0) for role, values in timeline["roles"].items()}
            roles = {role: shard(level[role]) for role in constant}
            roles["gradients"] = level["gradients"] if unsharded_grads else shard(level["gradients"])
            roles["activations"] = level["activations"]
            temporaries = level.get(UNATTRIBUTED, 0)
            if name in ("optimizer_step", "zero_grad"):
                roles["temporaries"] = shard(temporaries)  # each rank steps its own shard
                roles[GATHERED] = 0
            else:
                reducing = block_trainable if name == "backward" and not unsharded_grads else 0
                roles["temporaries"] = temporaries + reducing
                # an all-gather's output is new memory beside the rank's shard, which stays
                roles[GATHERED] = 2 * block_bytes + root_bytes
            if name not in phases or sum(roles.values()) > sum(phases[name].values()):
                phases[name] = roles
    return phases


def _adjusted_timeline(traced: dict, traced_roles: dict, predicted_roles: dict) -> dict:
    """The traced step's timeline with the analytic changes to what stays for the whole step (weights and optimizer
    state: quantization, 8-bit or paged state, FSDP sharding) applied as constant shifts; transient additions (a
    dequantized weight, gathered FSDP blocks) are in the predicted peak but not drawn."""
    timeline = {**traced, "roles": dict(traced["roles"])}
    for role in ("params_trainable", "params_frozen", "params_quantized", "optimizer_state"):
        shift = predicted_roles.get(role, 0) - traced_roles.get(role, 0)
        timeline["roles"][role] = [max(0, value + shift) for value in traced["roles"][role]]
    if predicted_roles.get(WORKSPACES):
        timeline["roles"][WORKSPACES] = [predicted_roles[WORKSPACES]] * len(traced["ms"])
    totals = [sum(values) for values in zip(*timeline["roles"].values())]
    peak_index = max(range(len(totals)), key=totals.__getitem__)
    timeline["peak_ms"], timeline["peak_bytes"] = timeline["ms"][peak_index], totals[peak_index]
    return timeline
