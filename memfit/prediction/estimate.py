"""Peak memory before launch: the script's own training step traced on fake tensors (``memfit.prediction.fake_step``),
plus what fake tensors cannot run.

What fake tensors cannot run is added analytically, with the constants stated:

- bitsandbytes 4-bit weights: 0.5 byte per weight, plus absmax (4 bytes per 64-weight block; with -dq 1 byte per
  block and 4 bytes per 256 blocks). While a quantized layer computes, its dequantized weight exists transiently:
  the largest one is added to forward and backward. bitsandbytes before 0.43.2 also kept every 4-bit layer's input
  for backward (``MatMul4Bit``); the traced forward records the inputs of the layers that get quantized, and those
  autograd did not save anyway are added to the activations when the modelled version (``BITSANDBYTES``, the
  installed one unless a caller sets it) is older.
- bitsandbytes 8-bit optimizers: 2 bytes of state per parameter in tensors of 4096 or more elements, with their
  blockwise scales and code books (fp32 states below that; ``bitsandbytes_state_bytes``). Paged optimizers keep the
  moments of tensors of 1e5 elements or more in CUDA managed memory, outside ``max_memory_allocated`` (counted as
  0); smaller tensors' state stays on the device.
- FSDP over N ranks: parameters, gradients and optimizer state divided by N (by a node's ranks under HYBRID_SHARD),
  plus two gathered transformer blocks (prefetch), the larger of the gathered embedding and head units and one block
  of gradients being reduced; with CPU offload they live in CPU memory and only those blocks stay. Each micro-batch's
  gradients are reduce-scattered into the shard; with ``--fsdp.accumulate_unsharded`` they stay unsharded, at full
  size, until a step's last micro-batch.

- CUDA: PyTorch's cuBLAS workspaces, from the same allocator, alive for the whole run: one per thread that runs
  matmuls (forward's main thread, backward's autograd device thread), each 32 MiB on sm90 and 8 MiB + 128 KiB on
  other GPUs unless ``CUBLAS_WORKSPACE_CONFIG`` says otherwise (``cublas_workspace_bytes``).

The estimate predicts ``max_memory_allocated``. nvidia-smi shows more: the CUDA context (about 0.5 GiB) and the
caching allocator's reserve (typically 5-15% above the allocated peak), which are not counted.
"""

from __future__ import annotations

import bisect
import copy
import importlib.metadata
import math
import os
import re
import weakref
from dataclasses import dataclass, field
from functools import partial

import torch

from memfit.args import StepSettings
from memfit.errors import UserError
from memfit.observatory.ledger import PhaseRecord
from memfit.observatory.phase_names import AFTER_BACKWARD, FIRST_OPTIMIZER_STEP, RUN_PHASES, TABLE_PHASES
from memfit.observatory.profiling import window_host_bytes
from memfit.observatory.roles import GATHERED, ROLES, UNATTRIBUTED, WORKSPACES
from memfit.observatory.timeline import with_peak
from memfit.prediction.fake_step import Plan, fake_model, traced_step
from memfit.settings.run import ScriptStep
from memfit.training.precision import compute_dtype
from memfit.training.quantizers import QuantizeKind
from memfit.training.strategy import fsdp_replicas
from memfit.training.torchao_nf4 import packed_bytes, quantizable
from memfit.units import fmt_bytes

CPU_RUNTIME_RSS_BYTES = 400 * 2**20
"""What a CPU training process holds beside its tensors once its first step has run (peak RSS less the ledger's
tensor peak, profiler off): Python, torch, Lightning and litgpt, the kernels' thread pools, the heap's free
fragments. Measured on 2 cores, torch 2.13: 396-415 MiB on one process (three models), 391 MiB on each of 2 ranks of
the embedded model"""
GLOO_HEAP_RSS_BYTES = 180 * 2**20
"""What a rank of several CPU processes over gloo may hold beyond that: gloo's threads make and free the collectives'
buffers, and glibc keeps what a thread frees in that thread's own heap. Measured 0-178 MiB on 2 and 4 ranks of three
models (the most on the 16-block model: more collectives a step), so the estimate gives a range"""


BITSANDBYTES = importlib.metadata.version("bitsandbytes")
"""The bitsandbytes version whose 4-bit layers the estimate models: the installed one, unless a caller sets it"""


def _keeps_4bit_inputs(version: str) -> bool:
    """bitsandbytes before 0.43.2 saved each 4-bit layer's input for backward, even for a frozen weight."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return parts < (0, 43, 2)


@dataclass
class Estimate:
    plan: Plan
    phases: dict = field(default_factory=dict)
    """phase -> {"peak": bytes, "roles": {role: bytes}}: the optimizer step's"""
    run_phases: dict = field(default_factory=dict)
    """The same for the run's phases beside its steps (``memfit.observatory.phase_names.RUN_PHASES``) that the plan has:
    a save always, a resume, a validation and a sample where the run has them"""
    fitting: list = field(default_factory=list)
    """With a memory budget: (slowdown, Estimate) of the settings that fit, the same training first, each group fastest
    first"""
    limits: dict = field(default_factory=dict)
    """With a memory budget: the reverse answers (``memfit.prediction.most_that_fits.Limit``) for the given settings and
    the fastest plan"""
    host: dict = field(default_factory=dict)
    """What lives in host memory instead of the device's: ``paged_state`` (bitsandbytes managed memory, paged in as
    the device has room) and ``offloaded_params``/``offloaded_trainable`` (FSDP CPU offload), in bytes / elements"""
    parameters: int = 0
    trainable: int = 0
    block_parameters: int = 0
    """One transformer block's parameters: what a checkpointed block computes again in backward"""
    timeline: dict = field(default_factory=dict, repr=False)
    """The predicted step's memory by role over its allocations (``memfit.observatory.timeline.stack_by_role``), for a
    picture"""
    gloo_buffer: int = 0
    """FSDP on CPU processes: gloo's all-gather of a prefetched block copies it through a buffer of its own while it
    runs, and its reduce-scatter reduces a copy of its input, a unit's whole gradient (NCCL does neither). Whether
    one is running at the rank's peak is a matter of timing, so the peak is the prediction without it, and a measured
    peak may lie up to the larger of the two above (measured on 2 ranks with a 16 MiB head trained under
    accumulation: 153.2 MiB, predicted 137.3 without it)"""
    bucket_rebuild: int = 0
    """DDP with micro-batches to accumulate: the bytes alive at the start of the second step, where DDP rebuilds its
    gradient buckets (torch's ``_rebuild_buckets``) while the gradients, zeroed in place and still views of the one
    bucket its first step trains with, keep that alive: the weights, the optimizer's state, workspaces and the
    gradients twice (``benchmarks/ddp_first_bucket.py`` measures the moment in a plain DDP loop: one gradient copy
    above the step's start). A step of one micro-batch frees its gradients before it
    (``memfit.training.strategy.keeps_gradient_buckets``): 0. Above the step's own peak only where the gradients
    outweigh the
    activations and temporaries at it"""

    @property
    def peak_phase(self) -> str:
        """The step's phase that peaks highest."""
        return max(self.phases, key=lambda p: self.phases[p]["peak"])

    @property
    def run_peak_phase(self) -> str:
        """The phase of the whole run that peaks highest: the step's, or one beside it (a save, a validation)."""
        run_phase = max(self.run_phases, key=lambda p: self.run_phases[p]["peak"], default=None)
        if run_phase is None or self.run_phases[run_phase]["peak"] <= self.step_peak:
            return self.peak_phase
        return run_phase

    @property
    def step_peak(self) -> int:
        """The highest of the phases' peaks: the step's, what a run's ledger measures of its recorded step."""
        return self.phases[self.peak_phase]["peak"] if self.phases else 0  # untraced: nothing yet

    @property
    def phases_peak(self) -> int:
        """The highest peak of every phase, the step's and the run's beside it."""
        return max([self.step_peak] + [phase["peak"] for phase in self.run_phases.values()])

    @property
    def peak(self) -> int:
        """The run's peak: what must fit the device, and what max_memory_allocated reads after the run."""
        return max(self.phases_peak, self.bucket_rebuild)

    @property
    def must_fit(self) -> int:
        """What must fit a budget: the run's peak, and on a CPU that records a profiler window (``Plan.profiled``: the
        out-of-memory advice, whose budget is the memory the process had, not a ``--memory_budget`` against the
        ledger's tensor peak) the window's host memory too, which comes out of the same memory as the tensors'
        (``host["profiler_window"]``)."""
        window = self.host.get("profiler_window", 0) if self.plan.profiled and self.plan.accelerator == "cpu" else 0
        return self.peak + window

    @property
    def where_peak(self) -> str:
        """Where the run's peak is, for the lines that print it."""
        if self.bucket_rebuild > self.phases_peak:
            return (
                "the second step's start, where DDP rebuilds its gradient buckets beside the first one (the step itself"
                f" peaks at {fmt_bytes(self.step_peak)} in {self.peak_phase})"
            )
        if self.run_peak_phase != self.peak_phase:
            return f"{self.run_peak_phase} (the step itself peaks at {fmt_bytes(self.step_peak)} in {self.peak_phase})"
        return self.peak_phase

    def as_dict(self) -> dict:
        return {
            "plan": self.plan.as_dict(),
            "peak_bytes": self.peak,
            "peak_phase": self.peak_phase,
            "run_peak_phase": self.run_peak_phase,
            "step_peak_bytes": self.step_peak,
            "ddp_bucket_rebuild_bytes": self.bucket_rebuild,
            "phases": self.phases,
            "run_phases": self.run_phases,
            "measures": "predicted max_memory_allocated (tensor memory)",
        }

    def table(self) -> str:
        every = self.phases | self.run_phases
        phases = [p for p in (*TABLE_PHASES, *RUN_PHASES) if p in every]
        widths = [max(15, len(p) + 2) for p in phases]
        lines = ["role".ljust(18) + "".join(p.rjust(w) for p, w in zip(phases, widths, strict=True))]
        # FSDP's gathered weights and CUDA's workspaces where a plan has them
        shown = [
            role
            for role in PREDICTED_ROLES
            if role not in (GATHERED, WORKSPACES) or any(every[p]["roles"].get(role) for p in phases)
        ]
        for role in shown:
            sizes = (fmt_bytes(every[p]["roles"].get(role, 0)).rjust(w) for p, w in zip(phases, widths, strict=True))
            lines.append(role.ljust(18) + "".join(sizes))
        peaks = (fmt_bytes(every[p]["peak"]).rjust(w) for p, w in zip(phases, widths, strict=True))
        lines.append("peak".ljust(18) + "".join(peaks))
        return "\n".join(lines)


PREDICTED_ROLES = ROLES + (GATHERED, "temporaries", WORKSPACES)
COMPUTING_PHASES = ("forward", "backward", "validation", "generation")
"""The phases that run the model's layers: a quantized layer's dequantized weight is a temporary in each"""


def plan_of(run) -> Plan:
    """What the memory of ``run`` (a ``memfit.settings.run.Run``) depends on, for the estimate and the out-of-memory
    explanation: its settings as they run."""
    return Plan(
        micro_batch_size=run.train.micro_batch_size,
        accumulation=run.accumulation,
        sequence_length=run.max_seq_length,
        precision=run.precision,
        quantize=run.quantize,
        optimizer=run.optimizer,
        activation_checkpointing=run.activation_checkpointing,
        blocks=run.config.n_layer,
        activation_offloading=run.activation_offloading,
        optimizer_in_backward=run.optimizer_in_backward,
        strategy=run.strategy,
        cpu_offload=run.fsdp.cpu_offload,
        accumulate_unsharded=run.fsdp.accumulate_unsharded,
        compile=run.compile,
        gradient_as_bucket_view=run.ddp.gradient_as_bucket_view,
        fsdp_replicas=fsdp_replicas(run.fsdp, run.num_nodes),
        world_size=run.world_size,
        step_settings=StepSettings.of(run.train),
        accelerator=run.accelerator,
        cublas_workspaces=cublas_workspace_bytes(run.accelerator),
        profile_with_stack=run.profile.with_stack,
    )


def cublas_workspace_bytes(accelerator: str) -> int:
    """What PyTorch's cuBLAS workspaces take from the allocator of a training process on ``accelerator``.

    PyTorch gives each (cuBLAS handle, stream) pair a workspace from the caching allocator, and handles are per
    thread: a training step runs forward's matmuls on the main thread and backward's on autograd's device thread, so
    a process holds two. Each is ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT`` pairs summed, or by default
    4096 KiB x 8 on sm90 (H100, H200) and 4096 KiB x 2 + 16 KiB x 8 elsewhere (PyTorch's CublasHandlePool.cpp). With
    no GPU visible (an estimate made for another machine) the second is assumed. A ledger measures them by freeing
    them (``memfit.observatory.allocator_snapshot.measure_cublas_workspaces``)."""
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


def estimate(script: ScriptStep, plan: Plan, whole_step: bool = True, extrapolate: bool = False) -> Estimate:
    """The predicted peaks of ``plan``; ``whole_step=False`` (the planner) traces only what the peaks need;
    ``extrapolate`` (a search) from shallow models of the same blocks
    (``memfit.prediction.fake_step.extrapolated_step``), with no
    timeline."""
    try:
        ledger, model, unsaved_linear_inputs, traced_timeline, phase_events = traced_step(
            script, plan, whole_step, extrapolate
        )
    except RuntimeError as error:
        if "overflowed" not in str(error):
            raise
        # torch's own size arithmetic (int64 bytes) overflowed; its message says only "Storage size"
        raise UserError(
            f"--train.micro_batch_size {plan.micro_batch_size:,} of {plan.sequence_length:,} tokens: the step's"
            " tensors are past what torch can size (over 2^63 bytes); no device holds them"
        ) from None
    dtype_bytes = _dtype_bytes(plan)
    quantizer = plan.quantize
    # torchao's NF4 route: the linear weights it quantizes after loading, the head's not
    # (memfit.training.torchao_nf4.quantize_linears)
    torchao = quantizer is not None and quantizer.quantizes_loaded_weights
    shapes = model_shapes(model, script.block_class, plan.world_size, torchao, dtype_bytes)
    quantized_linears, trainable = shapes.quantized_linears, shapes.trainable
    result = Estimate(
        plan=plan,
        parameters=shapes.parameters,
        trainable=sum(trainable),
        block_parameters=shapes.block_parameters,
    )
    result.host = _host_bytes(plan, shapes, dtype_bytes)
    result.host["profiler_window"] = window_host_bytes(phase_events, plan.accumulation, plan.profile_with_stack)
    optimizer = plan.optimizer
    paged = optimizer.paged and plan.accelerator != "cpu"
    for name in ledger.phases:
        roles = _predicted_roles(ledger.phases[name])
        if quantizer is not None and quantizer.bits == 4:
            roles = with_4bit_weights(
                roles,
                name,
                quantizer,
                quantized_linears,
                dtype_bytes=dtype_bytes,
                unsaved_linear_inputs=unsaved_linear_inputs,
                copies_beyond_peak=dequantized_beyond_peak(
                    ledger.phases[name],
                    quantizer,
                    dtype_bytes=dtype_bytes,
                    world_size=plan.world_size,
                    cpu_half_backward=plan.accelerator == "cpu" and not plan.precision.startswith("32"),
                ),
            )
        elif quantizer is not None and quantizer.bits == 8:
            roles = with_int8_copies(roles, name, shapes.linear_shapes, unsaved_linear_inputs=unsaved_linear_inputs)
        if optimizer.bitsandbytes_state:
            state = bitsandbytes_state_bytes(optimizer.bitsandbytes_state, trainable, paged=paged)
            roles = roles | {"optimizer_state": state}
        roles[WORKSPACES] = plan.cublas_workspaces  # allocated at the first matmuls, never freed
        result.phases[name] = {"peak": sum(roles.values()), "roles": roles}
    result.run_phases = {name: result.phases.pop(name) for name in RUN_PHASES if name in result.phases}
    if plan.accelerator != "cpu":
        result.host |= run_phases_on_the_host(result.run_phases, plan, model, dtype_bytes)
    if plan.strategy == "fsdp":
        # gloo copies a block into a buffer of its own while it all-gathers it, and a unit's whole gradient while it
        # reduce-scatters it
        gloo_copies = max(shapes.block_bytes, shapes.block_trainable, shapes.head_trainable, shapes.embedding_trainable)
        result.gloo_buffer = gloo_copies if plan.accelerator == "cpu" and plan.world_size > 1 else 0
        traced = {name: _predicted_roles(ledger.phases[name]) for name in ledger.phases}
        rank_phases = partial(
            fsdp_phases,
            traced_timeline,
            {name: phase["roles"] for name, phase in result.phases.items()},
            traced,
            shards=plan.world_size // plan.fsdp_replicas,
            unsharded_accumulation=plan.accumulate_unsharded and plan.accumulation > 1,
            block_bytes=shapes.block_bytes,
            root_bytes=shapes.root_bytes,
            block_trainable=shapes.block_trainable,
            embedding_bytes=shapes.embedding_bytes,
            embedding_trainable=shapes.embedding_trainable,
            head_trainable=shapes.head_trainable,
            head_bytes=shapes.head_bytes,
            tied=shapes.tied,
        )
        offloaded = plan.cpu_offload and plan.accelerator != "cpu"
        if offloaded:
            # what offload moves off the device is on the host instead: the rank's shards of the weights, of the
            # gradients and of the optimizer's state, as the rank holds them at the optimizer step without offload
            kept = rank_phases(offloaded=False)["optimizer_step"]
            result.host["offloaded_per_rank"] = sum(kept[role] for role in (*SHARDED_STATE, "gradients"))
        for name, roles in rank_phases(offloaded=offloaded).items():
            roles[WORKSPACES] = plan.cublas_workspaces
            result.phases[name] = {"peak": sum(roles.values()), "roles": roles}
        if plan.accelerator != "cpu" and "save" in result.run_phases:
            # the run's last save gathers the whole trained weights and optimizer state, as the one device holds them,
            # to rank 0's host, whatever --fsdp.state_dict_type the step checkpoints are written as
            whole = result.run_phases["save"]["roles"]
            result.host["full_state_dict"] = whole.get("params_trainable", 0) + whole.get("optimizer_state", 0)
        first_step = result.run_phases.pop(FIRST_OPTIMIZER_STEP, None)
        result.run_phases = fsdp_run_phases(
            result.run_phases,
            result.phases["zero_grad"]["roles"],
            gathered=2 * shapes.block_bytes + shapes.root_bytes,
            largest_parameter=max(p.numel() for p in model.parameters()) * dtype_bytes,
            on_cpu=plan.accelerator == "cpu",
        )
        if first_step is not None:
            # a rank makes the state of its own shards in its first optimizer step, which then holds what each later
            # one holds at its peak: the rank's weights, gradients and new state, and the update's scratch of its
            # shards (the one device's scratch is the whole model's)
            result.run_phases[FIRST_OPTIMIZER_STEP] = copy.deepcopy(result.phases["optimizer_step"])
    if plan.activation_offloading and plan.accelerator != "cpu":
        with_offloaded_activations(result)
    if plan.gradient_buckets and plan.accumulation > 1:
        # what the step starts with (DDP's buckets are its gradients in every phase), and the gradients again
        start = result.phases["forward"]["roles"]
        held = ("params_trainable", "params_frozen", "params_quantized", "optimizer_state", "gradients", WORKSPACES)
        result.bucket_rebuild = sum(start.get(role, 0) for role in held) + start["gradients"]
    if traced_timeline is not None:
        result.timeline = _adjusted_timeline(
            traced_timeline, _predicted_roles(ledger.phases["optimizer_step"]), result.phases["optimizer_step"]["roles"]
        )
    return result


@dataclass(frozen=True)
class ModelShapes:
    """What the estimate reads of the model's shapes, the same for every plan on one model: a planner's search asks
    hundreds of times, and walking a 32-block model's modules each time cost more than its shallow traces."""

    linear_shapes: list[tuple[int, ...]]
    quantized_linears: list[int]
    """elements of each weight the quantizer packs: torchao's NF4 takes those whose shape it (and FSDP's split over
    the ranks) takes whole, but not the head's (``memfit.training.torchao_nf4.quantize_linears``); bitsandbytes every
    linear
    layer's, the head's too, as litgpt does"""
    trainable: list[int]
    parameters: int
    block_parameters: int
    block_bytes: int
    block_trainable: int
    root_bytes: int
    embedding_bytes: int
    embedding_trainable: int
    head_bytes: int
    head_trainable: int
    tied: bool
    """The head is the embedding: one parameter, in the root's unit"""


_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_shapes(model: torch.nn.Module, block_class: type, world_size: int, torchao: bool, dtype_bytes: int):
    """``model``'s ``ModelShapes``, made once per model and setting."""
    key = (block_class, world_size, torchao, dtype_bytes)
    made = _SHAPES.setdefault(model, {})
    if key in made:
        return made[key]
    linear_shapes = [tuple(m.weight.shape) for m in model.modules() if type(m) is torch.nn.Linear]
    in_head = set(model.lm_head.modules())
    nf4_layers = [
        m
        for m in model.modules()
        if torchao and type(m) is torch.nn.Linear and m not in in_head and quantizable(m.weight.shape, world_size)
    ]
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    nf4_weights = {id(m.weight) for m in nf4_layers}

    def stored(parameters) -> int:  # as FSDP gathers them: an NF4 weight packed
        return sum(packed_bytes(p.numel()) if id(p) in nf4_weights else p.numel() * dtype_bytes for p in parameters)

    def trainable_bytes(parameters) -> int:
        return sum(p.numel() for p in parameters if p.requires_grad) * dtype_bytes

    # the embedding's unit is the last that backward reaches (the root's where tied to the head); the head's (the
    # final norm with the head) the first, and the one forward ends in
    embedding, head = _embedding_and_head(model)
    tied = bool({id(p) for p in head} & {id(p) for p in embedding})
    made[key] = ModelShapes(
        linear_shapes=linear_shapes,
        quantized_linears=[m.weight.numel() for m in nf4_layers] if torchao else [math.prod(s) for s in linear_shapes],
        trainable=[p.numel() for p in model.parameters() if p.requires_grad],
        parameters=sum(p.numel() for p in model.parameters()),
        block_parameters=sum(p.numel() for p in blocks[0].parameters()) if blocks else 0,
        block_bytes=stored(blocks[0].parameters()) if blocks else 0,
        block_trainable=trainable_bytes(blocks[0].parameters()) if blocks else 0,
        root_bytes=_largest_unit_outside_blocks(model, blocks, embedding, head, stored),
        embedding_bytes=stored(embedding),
        embedding_trainable=trainable_bytes(embedding),
        head_bytes=0 if tied else stored(head),
        head_trainable=0 if tied else trainable_bytes(head),
        tied=tied,
    )
    return made[key]


def _host_bytes(plan: Plan, shapes: ModelShapes, dtype_bytes: int) -> dict:
    """What the plan keeps in host memory that its model's shapes alone decide (``Estimate.host``)."""
    host = {}
    # bitsandbytes pages optimizer state into CUDA managed memory; on CPU its paged optimizers keep the state as the
    # unpaged ones do (with a warning), in the same memory as everything else
    optimizer = plan.optimizer
    if optimizer.paged and plan.accelerator != "cpu":
        per_element = 8 if optimizer.bitsandbytes_state == "32bit" else 2
        host["paged_state"] = per_element * sum(n for n in shapes.trainable if n >= BNB_PAGED_FROM_ELEMENTS)
    if plan.cpu_offload and plan.accelerator != "cpu":  # on a CPU run the host is the device: nothing moves
        host["offloaded_params"] = shapes.parameters * dtype_bytes
        host["offloaded_trainable"] = sum(shapes.trainable)
    return host


def untraced(script: ScriptStep, plan: Plan) -> Estimate:
    """``plan``'s estimate before any trace: its model's sizes and what its shapes put in host memory, no phases (a
    peak of 0). The planner's stand-in for a plan whose estimate costs a whole-depth trace, until its turn comes: no
    estimate of the plan predicts a shorter step (``memfit.prediction.planner.step_time`` grows with the peak, with the
    activations offloaded and with the paged state, and reads the rest from the shapes)."""
    dtype_bytes = _dtype_bytes(plan)
    torchao = plan.quantize is not None and plan.quantize.quantizes_loaded_weights
    shapes = model_shapes(fake_model(script, plan), script.block_class, plan.world_size, torchao, dtype_bytes)
    return Estimate(
        plan=plan,
        host=_host_bytes(plan, shapes, dtype_bytes),
        parameters=shapes.parameters,
        trainable=sum(shapes.trainable),
        block_parameters=shapes.block_parameters,
    )


def _dtype_bytes(plan: Plan) -> int:
    """Bytes of a parameter as the plan holds it: float32 under mixed precision, else the compute dtype."""
    return torch.finfo(torch.float32 if plan.precision.endswith("-mixed") else compute_dtype(plan.precision)).bits // 8


def with_offloaded_activations(result: Estimate) -> None:
    """``--activation_offloading``: the activations saved in forward wait in host memory (``host["activations"]``);
    the device holds those of one block at a time, brought back as backward reaches it
    (``memfit.training.activation_offload``:
    the copies are synchronous, so no second block's are in flight). Parameters saved for backward stay, as there."""
    blocks = max(1, result.plan.blocks)
    for name in ("forward", "backward"):
        if name not in result.phases:
            continue
        roles = result.phases[name]["roles"]
        moved = roles.get("activations", 0)
        result.host["activations"] = max(result.host.get("activations", 0), moved)
        roles["activations"] = moved // blocks
        result.phases[name]["peak"] = sum(roles.values())


def _embedding_and_head(model: torch.nn.Module) -> tuple[list, list]:
    """The parameters of FSDP's embedding unit and of its head unit, the final norm with the head
    (``memfit.training.strategy.shard_model``); none for a model without them."""
    transformer = getattr(model, "transformer", None)
    if transformer is None or not hasattr(model, "lm_head"):
        return [], []
    return list(transformer.wte.parameters()), [*transformer.ln_f.parameters(), *model.lm_head.parameters()]


def _largest_unit_outside_blocks(model: torch.nn.Module, blocks: list, embedding: list, head: list, stored) -> int:
    """What FSDP holds gathered beside the blocks (``memfit.training.strategy.shard_model``): the embedding and the
    final norm
    with the head are units of their own, each gathered around its use, and at most one of them is gathered at a time
    beside the blocks; the root (what no unit took: a tied embedding and head) is gathered for the whole step."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = [p for p in model.parameters() if id(p) not in in_blocks]
    embedding_ids, head_ids = {id(p) for p in embedding}, {id(p) for p in head}
    if not head_ids or embedding_ids & head_ids:  # no units of their own, or tied: one root unit
        return stored(outside)
    rest = stored(p for p in outside if id(p) not in embedding_ids | head_ids)
    units = [stored(p for p in outside if id(p) in ids) for ids in (embedding_ids, head_ids)]
    return rest + max(units)


def dequantized_beyond_peak(
    record: PhaseRecord, kind: QuantizeKind, *, dtype_bytes: int, world_size: int, cpu_half_backward: bool
) -> int:
    """How far a quantized layer's dequantized weight lifts the traced phase ``record`` above its peak: the copy is
    alive while the layer multiplies by it (forward's output, or backward's gradient of the input, made beside it),
    so it adds to the bytes alive at that product (``PhaseRecord.beside_weights``), not to whatever else the phase
    peaks at (the loss's logits of a chunk after the head's product, a block's backward after its layers'). With
    ``kind.dequantized_copies`` alive at once; ``cpu_half_backward``: a CPU run in 16 bits, whose bitsandbytes backward
    multiplies a transposed 16-bit copy of the dequantized weight as well
    (``memfit.training.bitsandbytes_layers._with_fast_cpu_backward``). torchao's route quantizes the weights NF4 can
    shard, and not the head's (``memfit.training.torchao_nf4.quantize_linears``); bitsandbytes' every linear layer."""
    torchao = kind.quantizes_loaded_weights
    beside = 0
    for (rows, columns, in_head, input_gradient), alive in record.beside_weights.items():
        if torchao and (in_head or not quantizable((rows, columns), world_size)):
            continue
        copies = kind.dequantized_copies * rows * columns * dtype_bytes
        if input_gradient and cpu_half_backward and kind.library == "bitsandbytes":
            copies += rows * columns * 2
        beside = torch.sym_max(beside, alive + copies)
    return torch.sym_max(0, beside - record.peak)


def with_4bit_weights(
    roles: dict[str, int],
    phase: str,
    kind: QuantizeKind,
    quantized_linears: list[int],
    *,
    dtype_bytes: int,
    unsaved_linear_inputs: int,
    copies_beyond_peak: int = 0,
) -> dict[str, int]:
    """A traced phase's roles with its linear weights (``quantized_linears``: their element counts) stored 4-bit: the
    16/32-bit weights leave the frozen parameters for their packed size; the layers' dequantized weights lift the
    phase by ``copies_beyond_peak`` (``dequantized_beyond_peak``), a temporary; bitsandbytes before 0.43.2 keeps each
    4-bit layer's input for backward."""
    full = sum(quantized_linears) * dtype_bytes
    roles = roles | {
        "params_frozen": max(0, roles["params_frozen"] - full),
        "params_quantized": sum(kind.stored_bytes(n) for n in quantized_linears),
    }
    if phase in COMPUTING_PHASES and quantized_linears:
        roles["temporaries"] += copies_beyond_peak
        if kind.library == "bitsandbytes" and _keeps_4bit_inputs(BITSANDBYTES) and phase in ("forward", "backward"):
            roles["activations"] += unsaved_linear_inputs
    return roles


def with_int8_copies(
    roles: dict[str, int], phase: str, linear_shapes: list[tuple[int, int]], *, unsaved_linear_inputs: int
) -> dict[str, int]:
    """A traced phase's roles under ``bnb.int8-training``, whose weights stay float16 parameters: bitsandbytes'
    ``MatMul8bitLt`` quantizes each weight in its forward and keeps the int8 copy and its per-row float32 scales
    (``state.CB``, ``state.SCB``) on the layer until the next forward replaces it, so from the first step on every
    layer's copy is alive in every phase; it keeps each layer's input for backward even where the weight is frozen;
    its backward dequantizes the copy to float16 (two bytes an element, one layer at a time)."""
    roles = roles | {"params_quantized": roles["params_quantized"] + sum(o * i + 4 * o for o, i in linear_shapes)}
    if phase in COMPUTING_PHASES and linear_shapes:
        roles["activations"] += unsaved_linear_inputs if phase in ("forward", "backward") else 0
        roles["temporaries"] += 2 * max(o * i for o, i in linear_shapes)
    return roles


def bitsandbytes_state_bytes(state: str, trainable: list[int], paged: bool) -> int:
    """The device bytes of a bitsandbytes optimizer's state for parameters of ``trainable`` elements each.

    ``state`` "32bit" (``PagedAdamW``): two float32 moments, 8 bytes an element. 8-bit: below ``min_8bit_size`` elements
    the
    moments stay float32; from it on each is one byte an element with a float32 scale per block of values (blockwise
    quantization), and the optimizer keeps one 256-value float32 code book per moment, shared by every tensor. Paged
    optimizers put the moments of tensors of ``BNB_PAGED_FROM_ELEMENTS`` or more into CUDA managed memory (outside
    the allocator's counters); the scales stay on the device, and smaller tensors (every LoRA matrix of a 7B model)
    are not paged at all. ``tests/test_estimate.py`` checks this against the state bitsandbytes allocates."""
    total = 0
    for n in trainable:
        paged_out = paged and n >= BNB_PAGED_FROM_ELEMENTS
        if state == "32bit" or n < BNB_MIN_8BIT_SIZE:
            total += 0 if paged_out else 2 * 4 * n
        else:
            total += 2 * ((0 if paged_out else n) + math.ceil(n / BNB_BLOCK_SIZE) * 4)
    if state == "8bit" and any(n >= BNB_MIN_8BIT_SIZE for n in trainable):
        total += 2 * BNB_CODE_BOOK_BYTES
    return total


BNB_PAGED_FROM_ELEMENTS = 100_000
"""bitsandbytes' ``Optimizer8bit.get_state_buffer`` pages a tensor's state only from this many elements on"""
BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes' 8-bit optimizers' default ``min_8bit_size``: smaller tensors keep float32 state"""
BNB_BLOCK_SIZE = 256
"""Values per float32 scale in bitsandbytes' blockwise 8-bit optimizer state"""
BNB_CODE_BOOK_BYTES = 256 * 4
"""The dynamic quantization map of each 8-bit moment (``qmap1``, ``qmap2``, one per optimizer): 256 float32 values"""


SHARDED_STATE = ("params_trainable", "params_frozen", "params_quantized", "optimizer_state")
"""The roles FSDP keeps as each rank's shard for the whole step (the gradients are sharded once reduced)"""


def fsdp_phases(
    timeline: dict,
    predicted: dict[str, dict],
    traced: dict[str, dict],
    *,
    shards: int,
    unsharded_accumulation: bool,
    offloaded: bool,
    block_bytes: int,
    root_bytes: int,
    block_trainable: int,
    embedding_bytes: int = 0,
    embedding_trainable: int = 0,
    head_trainable: int = 0,
    head_bytes: int = 0,
    tied: bool = False,
) -> dict[str, dict]:
    """Each phase's peak and its roles on one rank of torch's second FSDP (``fully_shard`` on each block, then the
    root), from the step traced on one process: at every allocation and free of the traced ``timeline`` the roles
    alive are taken as a rank holds them, and each phase's peak is the highest such moment (the moment of the
    single-process peak need not be the rank's: sharding shrinks the gradients, not the activations).

    At each moment: weights and optimizer state are 1/shards (the ranks one copy is sharded over: all of them, or a
    node's under HYBRID_SHARD; on the host with ``offloaded``); gradients are 1/shards once reduce-scattered (every
    micro-batch's, into the rank's shard), but with ``unsharded_accumulation`` (``--fsdp.accumulate_unsharded``) they
    stay unsharded, at full size and on the device even with offload, until the step's last micro-batch. In forward and
    backward a rank also holds two gathered blocks (the one computing and the one prefetched) and ``root_bytes`` (the
    larger of the embedding and the head unit, and what the root keeps for the whole step), and in backward (unless
    accumulating unsharded) the unsharded gradient of the block being reduced. Backward ends with the embedding's unit:
    every activation freed, the embedding gathered again (``embedding_bytes``), its whole gradient and the
    reduce-scatter's copy of it (``embedding_trainable`` each) beside the sharded state, which for a large vocabulary
    (the embedding a block's size or more) is backward's peak (measured on 2 CPU ranks, a 16 MiB embedding: 136.2 MiB,
    this moment 136.2). Backward starts with the head's unit (``head_trainable``: the final norm's and the head's
    trainable bytes) in the same way: its whole gradient and the reduce-scatter's copy, beside every activation the
    forward saved and the first block's all-gather (the head's own weights are resharded before its gradient is
    reduced), which for a large vocabulary trained in full is backward's peak under accumulation. The optimizer's own
    scratch is per shard.

    Forward differs from the blocks on from where it reaches the head's unit (``timeline["head_starts"]``, with
    ``head_bytes`` the unit's weights; untied): its all-gather's output and the copy of it the unit computes with,
    beside the last block's all-gather buffer, which FSDP frees only then (torch's ``wait_for_unshard`` defers each
    buffer's free to the next unit's all-gather), with every activation saved; then, the buffer freed before the loss
    runs (``memfit.training.strategy``), the head's weights alone beside the loss's chunks. Counting two blocks and the
    head
    through the loss, as every other moment is counted, put the llama-shaped LoRA rank 1-2 MiB (2.5-7%) over its
    measured peak on 2 and 4 CPU ranks. ``predicted`` and
    ``traced``: each phase's roles with and without the analytic adjustments made before (8-bit or paged state),
    which shift the constant roles.

    A head ``tied`` to the embedding is one parameter of the root's unit, which backward reaches last: at that moment
    its whole gradient (both uses summed) and the reduce-scatter's copy are there, but not yet the rank's shard of it,
    which the reduce-scatter writes once the root is resharded (2 CPU ranks, pythia-14m's architecture tied: backward
    120.5 MiB measured, 133.4 predicted with the shard, 121.3 without).
    """
    constant = SHARDED_STATE
    shard = (lambda size: 0) if offloaded else (lambda size: size // shards)
    phases: dict[str, dict] = {}

    def at_rank(level: dict, unsharded_grads: bool, *, gathered: int, temporaries: int, activations=None) -> dict:
        """A moment's roles on the rank: the constant roles and the gradients as sharded, the activations as traced
        unless given."""
        roles = {role: shard(level[role]) for role in constant}
        roles["gradients"] = level["gradients"] if unsharded_grads else shard(level["gradients"])
        roles["activations"] = level["activations"] if activations is None else activations
        return roles | {"temporaries": temporaries, GATHERED: gathered}

    def keep(name: str, roles: dict) -> None:
        if name not in phases or sum(roles.values()) > sum(phases[name].values()):
            phases[name] = roles

    for start, end, name in timeline["phases"]:
        shift = {role: predicted[name].get(role, 0) - traced[name].get(role, 0) for role in constant}
        unsharded_grads = unsharded_accumulation and name not in AFTER_BACKWARD

        def level_at(i: int) -> dict:
            return {role: values[i] + shift.get(role, 0) for role, values in timeline["roles"].items()}

        entering = max(0, bisect.bisect_left(timeline["ms"], start) - 1)  # the level the phase starts from
        in_head = [at for at in timeline.get("head_starts", ()) if start <= at <= end] if head_bytes else []
        head_from = in_head[0] if name == "forward" and in_head else math.inf
        for i in range(entering, len(timeline["ms"])):
            if timeline["ms"][i] > end:
                break
            level = level_at(i)
            temporaries = level.get(UNATTRIBUTED, 0)
            if timeline["ms"][i] >= head_from:
                # the head's unit alone: its all-gather buffer freed before the loss runs
                keep(name, at_rank(level, unsharded_grads, temporaries=temporaries, gathered=head_bytes))
            elif name in AFTER_BACKWARD:
                # each rank steps its own shard
                keep(name, at_rank(level, unsharded_grads, temporaries=shard(temporaries), gathered=0))
            else:
                # the unit whose gradients are being reduced: at most a block's, and no more than the traced step
                # has produced by then (early in the first micro-batch's backward, the head's alone). It is reduced
                # after its unit's backward, whose own scratch (the loss's chunk, a matmul's) is gone by then: the
                # larger of the two, not both (measured on 2 and 4 ranks: the sum was 5-7% over)
                reducing = min(block_trainable, level["gradients"]) if name == "backward" and not unsharded_grads else 0
                # an all-gather's output is new memory beside the rank's shard, which stays
                gathered = 2 * block_bytes + root_bytes
                keep(
                    name,
                    at_rank(level, unsharded_grads, temporaries=max(temporaries, reducing), gathered=gathered),
                )
        if head_from < math.inf:
            # the head's unit being gathered: the level just before the final norm's first operation
            before = level_at(max(0, bisect.bisect_left(timeline["ms"], head_from) - 1))
            gathered = 2 * head_bytes + block_bytes
            keep(name, at_rank(before, unsharded_grads, temporaries=before.get(UNATTRIBUTED, 0), gathered=gathered))
        if name == "backward" and head_trainable and not unsharded_grads:
            # the level backward starts from: every saved activation, the gradients of earlier micro-batches; the
            # head's whole gradient, the reduce-scatter's copy of it and its output, the rank's share
            reducing = 2 * head_trainable + head_trainable // shards
            keep(name, at_rank(level_at(entering), False, temporaries=reducing, gathered=block_bytes))
        if name == "backward" and embedding_trainable and not unsharded_grads:
            # the level at backward's last allocation or free: every gradient made
            last = at_rank(level, False, gathered=embedding_bytes, temporaries=2 * embedding_trainable, activations=0)
            if tied:
                last["gradients"] -= shard(embedding_trainable)
            keep(name, last)
    return phases


HELD_ROLES = ("params_trainable", "params_frozen", "params_quantized", "gradients", "optimizer_state")
"""What a run holds between its steps: the weights, any gradients kept, the optimizer's state"""


def run_phases_on_the_host(run_phases: dict, plan: Plan, model: torch.nn.Module, dtype_bytes: int) -> dict[str, int]:
    """What the run's phases beside its steps put in a GPU run's host memory, from their one-device estimate: a
    resume loads the weights file to the host (the trained weights), copies it in and frees it, then the training
    state (the optimizer's), which then moves to the device: the larger of the two. A save writes each tensor through
    a host copy of it, one at a time (torch's serialization; distributed checkpointing's shard by shard): the largest,
    a parameter or an optimizer state's tensor of its size (float32). FSDP's full state dict is in ``fsdp_run_phases``."""
    host = {}
    if "resume" in run_phases:
        roles = run_phases["resume"]["roles"]
        host["resume_loaded"] = max(roles.get("params_trainable", 0), roles.get("optimizer_state", 0))
    if "save" in run_phases:
        largest = max((p.numel() for p in model.parameters() if p.requires_grad), default=0)
        shards = plan.world_size // plan.fsdp_replicas if plan.strategy == "fsdp" else 1
        host["save_copy"] = largest * max(dtype_bytes, 4 if run_phases["save"]["roles"].get("optimizer_state") else 0)
        host["save_copy"] //= shards
    return host


def fsdp_run_phases(
    one_device: dict[str, dict],
    rank_at_rest: dict[str, int],
    *,
    gathered: int,
    largest_parameter: int,
    on_cpu: bool,
) -> dict[str, dict]:
    """The run's phases beside its steps on one FSDP rank, from their one-device estimate (``one_device``): each
    rises above what the rank holds at rest (``rank_at_rest``: the step's zero_grad, its weights and state sharded)
    as far as it rose above the one device's. Validation and the sample run the blocks gathered, as forward does
    (``gathered``: two blocks and the root's unit). The run's last save is always consolidated
    (``memfit.training.checkpoint.save_checkpoint``: what ``litgpt generate`` and ``merge_lora`` read), whatever
    ``--fsdp.state_dict_type`` the step checkpoints use: it gathers the trained weights and the optimizer's state
    whole, one parameter at a time on the device (``largest_parameter``) and all of it in rank 0's host memory: on a
    CPU that is the device (``on_cpu``), so rank 0's peak, the one predicted. A sharded step checkpoint writes each
    rank's own shards from where they are, below the last save, so the save phase is the last save's."""
    ranked = {}
    for name, phase in one_device.items():
        held = {role: phase["roles"].get(role, 0) for role in HELD_ROLES}
        rise = phase["peak"] - sum(held.values()) - phase["roles"].get(WORKSPACES, 0)
        roles = {role: rank_at_rest.get(role, 0) for role in HELD_ROLES}
        roles["gradients"] = 0  # zero_grad's roles are at its peak, before it freed them
        roles["temporaries"] = rise
        roles[GATHERED] = gathered if name in COMPUTING_PHASES else 0
        if name == "save":
            # on a CPU the gathered tensor is the state dict's own (moving it to the host moves nothing)
            roles[GATHERED] = 0 if on_cpu else largest_parameter
            roles["temporaries"] += (held["params_trainable"] + held["optimizer_state"]) if on_cpu else 0
        roles[WORKSPACES] = rank_at_rest.get(WORKSPACES, 0)
        ranked[name] = {"peak": sum(roles.values()), "roles": roles}
    return ranked


def _adjusted_timeline(traced: dict, traced_roles: dict, predicted_roles: dict) -> dict:
    """The traced step's timeline with the analytic changes to what stays for the whole step (weights and optimizer
    state: quantization, 8-bit or paged state, FSDP sharding) applied as constant shifts, and to the gradients as a
    share; transient additions (a dequantized weight, gathered FSDP blocks) are in the predicted peak but not drawn."""
    timeline = {**traced, "roles": dict(traced["roles"])}
    for role in ("params_trainable", "params_frozen", "params_quantized", "optimizer_state"):
        shift = predicted_roles.get(role, 0) - traced_roles.get(role, 0)
        timeline["roles"][role] = [max(0, value + shift) for value in traced["roles"][role]]
    if traced_roles.get("gradients"):
        # the gradients grow over backward, so FSDP's sharding (or its CPU offload) is a share of each moment's, the
        # share the optimizer step holds: shifted as a constant, the whole model's gradients of the one-process trace
        # were drawn on top of a rank's share (a 70B plan drew 131 GiB for a predicted 14 GiB)
        share = predicted_roles.get("gradients", 0) / traced_roles["gradients"]
        timeline["roles"]["gradients"] = [int(value * share) for value in traced["roles"]["gradients"]]
    if predicted_roles.get(WORKSPACES):
        timeline["roles"][WORKSPACES] = [predicted_roles[WORKSPACES]] * len(traced["ms"])
    return with_peak(timeline)
