"""The fit planner: the settings that fit a memory budget, fastest first (``--memory_budget`` with ``--estimate``, in
``memfit.prediction.estimate_report``, and after an out-of-memory, in ``memfit.failure.oom``).

The planner varies the settings that trade memory for speed (micro-batch size with accumulation to keep the
global batch, activation checkpointing of as few blocks as must be, quantization, 8-bit and paged optimizers, FSDP
CPU offload), estimates each combination, keeps those that fit the budget with the allocator's reserve
(``memfit.settings.budget.fits``) and orders them by a predicted time per optimizer step, made from the model:

- compute: ``6 x parameters x tokens`` FLOPs for full training, ``4 x`` when only adapters train, and a checkpointed
  block's forward again (``2 x`` its parameters per token), at ``GPU_FLOPS``;
- each micro-batch reads every weight in forward and backward (and again in a recomputed block), at
  ``HBM_BYTES_PER_S``: what accumulating over smaller micro-batches costs beyond the same FLOPs;
- what spills to host memory: the bytes that cross PCIe each optimizer step (at ``PCIE_BYTES_PER_S``; paged state
  that fits beside the peak never moves), and for offload the optimizer step on the CPU (at
  ``CPU_ADAM_PARAMS_PER_S``); FSDP's reduce-scatters (at ``REDUCE_SCATTER_BYTES_PER_S``);
- each quantization method's and optimizer's ``step_cost`` from their registries (nf4 x1.15 and nf4-dq x1.2 for
  dequantizing each weight per matmul, 8-bit AdamW x1.02), rules of thumb; a compiled step ``COMPILED_STEP_COST``,
  offered for the fastest plan of the same training (``--compile true``), where its blocks compile once.

The rates are a GPU's, stated below; only the ratios between plans are printed.
"""

from __future__ import annotations

import dataclasses
import heapq
import importlib.util
import itertools
import sys

from tqdm import tqdm

from memfit.prediction.estimate import Estimate, estimate, untraced
from memfit.prediction.fake_step import Plan, extrapolates
from memfit.prediction.most_that_fits import Searcher, fewest_checkpointed
from memfit.settings.budget import fits, reserve_note
from memfit.settings.run import ScriptStep
from memfit.training.optim import OPTIMIZERS, OptimizerKind
from memfit.training.quantizers import QUANTIZERS, QuantizeKind
from memfit.units import fmt_bytes

PCIE_BYTES_PER_S = 20e9
"""Host <-> device traffic one GPU sustains over PCIe 4.0 x16 in practice (rule of thumb)"""
GPU_FLOPS = 150e12
"""Dense bf16 throughput reached in training on an A100/H100-class GPU (rule of thumb, about half of peak)"""
CPU_ADAM_PARAMS_PER_S = 1e9
"""Parameters per second a host's AdamW step updates (rule of thumb)"""
HBM_BYTES_PER_S = 2e12
"""Device memory bandwidth an A100/H100-class GPU sustains reading weights (rule of thumb: 2.0 and 3.35 TB/s peak)"""
REDUCE_SCATTER_BYTES_PER_S = 100e9
"""Gradient bytes per second an FSDP reduce-scatter moves between GPUs of one node (rule of thumb, NVLink class)"""
COMPILED_STEP_COST = 1 / 1.27
"""A compiled step's time against an eager one's on a GPU: torchtune's README reports 27% more tokens/s from compiling
its recipes (published, not measured here; this CPU measured 0.91-1.69 for the recipes that compile once,
docs/compile.md)"""


def spill_seconds(result: Estimate, budget: int) -> float:
    """Seconds per optimizer step spent moving what spills to host memory, and stepping it there."""
    seconds = 0.0
    if result.host.get("activations"):  # --activation_offloading: to the host in forward, back in backward
        seconds += 2 * result.host["activations"] * result.plan.accumulation / PCIE_BYTES_PER_S
    paged = result.host.get("paged_state", 0)
    if paged:  # paged in for the step and out again, for what does not fit beside the peak
        seconds += 2 * max(0, paged - max(0, budget - result.peak)) / PCIE_BYTES_PER_S
    if result.host.get("offloaded_params"):
        # every block's weights come to the device for forward and again for backward, gradients go back; the
        # optimizer steps on the host
        plan = result.plan
        moved = result.host["offloaded_params"] * (2 * plan.accumulation + 1)
        seconds += moved / PCIE_BYTES_PER_S + result.host["offloaded_trainable"] / CPU_ADAM_PARAMS_PER_S
    return seconds


def reduce_seconds(result: Estimate) -> float:
    """Seconds per optimizer step FSDP spends reduce-scattering gradients: once a micro-batch, or once a step with
    ``accumulate_unsharded`` (the speed it buys with the whole model's gradients on every rank)."""
    plan = result.plan
    if plan.strategy != "fsdp" or plan.world_size == 1:
        return 0.0
    reductions = 1 if plan.accumulate_unsharded else plan.accumulation
    return reductions * result.trainable * 4 / REDUCE_SCATTER_BYTES_PER_S  # reduced in float32


def compute_seconds(result: Estimate) -> float:
    plan = result.plan
    tokens = plan.micro_batch_size * plan.accumulation * plan.sequence_length
    per_token = (6 if result.trainable == result.parameters else 4) * result.parameters
    # each checkpointed block's forward again, in backward
    per_token += 2 * result.block_parameters * plan.activation_checkpointing
    return per_token * tokens / GPU_FLOPS


def weight_read_seconds(result: Estimate) -> float:
    """Each micro-batch reads every weight in forward and in backward, and a checkpointed block's once more: the
    cost of many small micro-batches that the same FLOPs do not show."""
    plan = result.plan
    weight_bytes = 4 if plan.precision.startswith("32") or plan.precision.endswith("-mixed") else 2
    passes = 2 * result.parameters + result.block_parameters * plan.activation_checkpointing
    return plan.accumulation * passes * weight_bytes / HBM_BYTES_PER_S


def step_time(result: Estimate, budget: int) -> float:
    """A plan's predicted seconds per optimizer step on an A100/H100-class GPU (the rates above): only the ratios
    between plans are printed."""
    plan = result.plan
    cost = plan.quantize.step_cost if plan.quantize else 1.0
    cost *= plan.optimizer.step_cost
    cost *= COMPILED_STEP_COST if plan.compile else 1.0
    return (
        cost * (compute_seconds(result) + weight_read_seconds(result))
        + spill_seconds(result, budget)
        + reduce_seconds(result)
    )


def slowdown(result: Estimate, given: Estimate, budget: int) -> float:
    """Predicted time per optimizer step relative to the given settings' (which are x1.00 where they fit)."""
    return step_time(result, budget) / step_time(given, budget)


CPU_MOST_MICRO_BATCH = 64
"""The largest micro-batch the planner offers a CPU run. glibc serves a CPU run's freed activations under 32 MiB
from a heap whose freed space the next micro-batch does not always reuse, so the process outgrows its tensors by
about a micro-batch's activations: under a 1.5 GB address-space limit, full fine-tuning of the embedded default at
micro-batch 256 of 1,024 (983 MiB of tensors predicted, 85% of what the limit left) ran out in its second
micro-batch holding 100 MiB of tensors, where micro-batch 16 trains (``tests/test_planner.py``). A fixed mmap
threshold (``MALLOC_MMAP_THRESHOLD_``) would return them, at up to half the speed (docs/benchmarks.md)."""


def candidates(base: Plan, trains_all_weights: bool) -> list[Plan]:
    global_per_rank = base.micro_batch_size * base.accumulation
    # smaller and larger micro-batches, each a whole share of the process's global batch (accumulation is exact): the
    # powers of two up to the whole share (most are ruled out untraced: plans_that_fit). On a CPU at most
    # CPU_MOST_MICRO_BATCH: the process there needs more than its tensors, growing with the micro-batch
    most = CPU_MOST_MICRO_BATCH if base.accelerator == "cpu" else global_per_rank
    powers = (2**i for i in range(min(most, global_per_rank).bit_length()))
    micro = sorted({base.micro_batch_size} | {m for m in powers if global_per_rank % m == 0})
    # bitsandbytes' 4-bit weights train on one device; FSDP shards torchao's NF4 (where torchao is installed)
    one_device = base.world_size == 1 and base.strategy != "fsdp"
    four_bit = {
        kind
        for kind in QUANTIZERS.values()
        if kind.planner_tries
        and (
            not kind.shards_with_fsdp
            if one_device
            else kind.shards_with_fsdp and base.strategy == "fsdp" and importlib.util.find_spec(kind.library)
        )
    }
    quantize = [base.quantize] if trains_all_weights else sorted({base.quantize, None} | four_bit, key=_name)
    if base.precision.endswith("-mixed"):
        quantize = [base.quantize]
    # fused AdamW is always a candidate: the same update without foreach's parameter-sized scratch; paging is CUDA's
    # (on CPU a paged optimizer is its unpaged self)
    tried = {
        kind for kind in OPTIMIZERS.values() if kind.planner_tries and (base.accelerator != "cpu" or not kind.paged)
    }
    # AdamW's kernels and state formats are offered only in place of one of them (OptimizerKind.keeps_adam_moments)
    optimizers = sorted({base.optimizer} | tried, key=_name) if base.optimizer.keeps_adam_moments else [base.optimizer]
    # CPU offload moves memory off a GPU; on a CPU run the host is the device, and there is nothing to move it to
    offload = (
        [base.cpu_offload, True]
        if trains_all_weights and not base.cpu_offload and base.accelerator != "cpu"
        else [base.cpu_offload]
    )
    # FSDP: each micro-batch's gradients reduce-scattered, or kept unsharded through the step (less communication)
    unsharded = [False, True] if base.strategy == "fsdp" and base.world_size > 1 else [base.accumulate_unsharded]
    plans = []
    # every block checkpointed or none: a plan that fits only with some is then given the fewest (plans_that_fit)
    checkpointing = sorted({0, base.blocks})
    # activations offloaded to the host: a GPU's option (on a CPU run the host is the device)
    offload_activations = sorted({base.activation_offloading, base.accelerator != "cpu"})
    settings = itertools.product(micro, checkpointing, quantize, optimizers, offload, unsharded, offload_activations)
    for m, ac, q, opt, off, keep, acts in settings:
        if keep and global_per_rank // m == 1:
            continue  # one micro-batch: nothing accumulates, the same plan as without
        plans.append(
            dataclasses.replace(
                base,
                micro_batch_size=m,
                accumulation=global_per_rank // m,
                activation_checkpointing=ac,
                quantize=q,
                optimizer=opt,
                cpu_offload=off,
                strategy="fsdp" if off else base.strategy,
                accumulate_unsharded=keep,
                activation_offloading=acts,
                optimizer_in_backward=base.optimizer_in_backward and global_per_rank // m == 1,
            )
        )
    return plans


def _name(choice: QuantizeKind | OptimizerKind | None) -> str:
    """A registry entry's flag value ("None" for no quantization): the order the planner tries them in."""
    return str(choice.name if choice else None)


def training_changes(plan: Plan, base: Plan) -> list[str]:
    """What in ``plan`` trains differently from ``base``: another optimizer (not another AdamW kernel), quantization,
    precision or sequence length. A micro-batch at the same global batch (accumulation is exact), activation
    checkpointing, offload and FSDP's reduce-scatter timing change the memory and the speed, not the training."""
    changes = []
    same_update = plan.optimizer.torch_adamw and base.optimizer.torch_adamw  # another AdamW kernel alone
    if plan.optimizer != base.optimizer and not same_update:
        changes.append(f"optimizer {plan.optimizer.name}")
    if plan.quantize != base.quantize:
        if plan.quantize:
            changes.append(f"quantize {plan.quantize.name}")
        else:
            changes.append(f"unquantized base (not {base.quantize.name})")
    if plan.precision != base.precision:
        changes.append(f"precision {plan.precision}")
    if plan.sequence_length != base.sequence_length:
        changes.append(f"sequence length {plan.sequence_length}")
    return changes


NEGLIGIBLE_SAVING = 0.02
"""A slower row that saves less than this share of its peak over a faster one that changes the training no more is
not listed: AdamW8bit beside AdamW for a 7B LoRA, whose whole state is 16 MiB of a 15 GiB peak"""


def dominated(result: Estimate, peak: int, kept: list[tuple[float, Estimate]], base: Plan) -> bool:
    """Whether a row of ``result`` at ``peak``, slower than every row in ``kept``, saves too little over one of them
    that changes the training no more to be listed (``NEGLIGIBLE_SAVING``)."""
    changes = set(training_changes(result.plan, base))
    return any(
        set(training_changes(faster.plan, base)) <= changes and faster.peak - peak < NEGLIGIBLE_SAVING * peak
        for _, faster in kept
    )


def _without_micro_batch(plan: Plan) -> str:
    """What a plan is besides its micro-batch (and the accumulation that keeps the global batch)."""
    return repr(dataclasses.replace(plan, micro_batch_size=0, accumulation=0))


def beyond_reach(plan: Plan, too_large: dict[str, int]) -> bool:
    """Whether ``plan``'s micro-batch is known not to fit, untraced: the same plan did not fit at a smaller one
    (``too_large``: the smallest micro-batch that did not, by the rest of the plan). More tokens a micro-batch never
    take less memory, so the micro-batches above it are not traced (a global batch of 1,024 offers eleven). A
    micro-batch that is the whole share is always traced: with nothing accumulated, no gradients exist in its forward,
    as they do in a second micro-batch's."""
    smallest = too_large.get(_without_micro_batch(plan))
    return smallest is not None and plan.micro_batch_size > smallest and plan.accumulation > 1


ROWS = 12
"""The most rows the planner lists. It stops there: a plan slower than the last row listed is never estimated (where
FSDP's CPU offload is tried, a whole-depth trace each, half of a 1.1B full fine-tuning's planner time)"""


def plans_that_fit(script: ScriptStep, base: Plan, budget: int, most: int = ROWS) -> list[tuple[float, Estimate]]:
    # smallest micro-batch first: a larger one is ruled out where the same plan did not fit a smaller (beyond_reach)
    plans = sorted(candidates(base, trains_all_weights=script.mark_trainable is None), key=lambda p: p.micro_batch_size)
    # each candidate is a traced step, seconds each for a 7B model: the wait shows its progress (closed, and its line
    # cleared, before anything else is printed, a failure's warning too)
    results, whole_depth, too_large = [], [], {}
    fit: set[str] = set()  # the plans estimated so far that fit, as repr: a plan checkpointing every block comes after
    # the same plan checkpointing none (candidates' order, kept by the sort)
    unchecked = lambda plan: dataclasses.replace(plan, activation_checkpointing=0)  # noqa: E731
    with tqdm(total=len(plans), desc="planning: settings tried", unit="plan", mininterval=0.5, leave=False) as bar:
        for plan in plans:
            bar.update()
            if beyond_reach(plan, too_large):
                continue
            if extrapolates(script, base) and not extrapolates(script, plan):
                # CPU offload's FSDP, whose estimate reads a whole-depth trace: made when its turn comes
                whole_depth.append(plan)
                continue
            if plan != base and plan.activation_checkpointing == plan.blocks > 0 and repr(unchecked(plan)) in fit:
                continue  # never a row where the same plan fits with no block checkpointed (enqueue): not traced
            # from shallow traces: the same bytes as a whole-depth trace where no block or every block is
            # checkpointed (memfit.prediction.fake_step.extrapolated_step); the fewest blocks are confirmed whole below
            result = estimate(script, plan, whole_step=False, extrapolate=True)
            results.append(result)
            if fits(result.must_fit, budget, base.accelerator):
                fit.add(repr(plan))
            elif plan.accumulation > 1:
                too_large.setdefault(_without_micro_batch(plan), plan.micro_batch_size)
    given = next((result for result in results if result.plan == base), None) or estimate(script, base)
    searcher = Searcher(script, budget, base.accelerator)
    # The rows in order, fastest first (then the lower peak), each kept unless a faster one kept saves as much
    # (``dominated``), up to ``most``. What costs a whole-depth trace or a search waits in the queue at a time no
    # less than its own, and is made only when its turn comes (the same rows as making every one; a row a faster one
    # makes pointless is never searched for):
    # - a plan that fits only with its blocks checkpointed is given the fewest that fit, a search of several traces:
    #   its every-block estimate stands in, at the time of one block checkpointed, for the fewest blocks take at
    #   least that long and hold at least that much;
    # - a plan FSDP shards is estimated from a whole-depth trace: its model's sizes stand in (``untraced``).
    queue: list[tuple[float, int, int, str, Estimate]] = []

    def enqueue(result: Estimate, order: int) -> None:
        if not fits(result.must_fit, budget, base.accelerator):
            return
        needs_search = result.plan.activation_checkpointing == result.plan.blocks > 0
        if needs_search and searcher.fits(dataclasses.replace(result.plan, activation_checkpointing=0)):
            return  # the same plan fits with no block checkpointed: its own row
        kind = "search" if needs_search else "row"
        heapq.heappush(queue, (least_slowdown(result, given, budget), result.peak, order, kind, result))

    for order, result in enumerate(results):
        enqueue(result, order)
    for order, plan in enumerate(whole_depth, start=len(results)):
        stand_in = untraced(script, plan)
        heapq.heappush(queue, (least_slowdown(stand_in, given, budget), 0, order, "trace", stand_in))
    kept: list[tuple[float, Estimate]] = []
    while queue and len(kept) < most:
        cost, peak, order, kind, result = heapq.heappop(queue)
        if kind == "trace":
            enqueue(estimate(script, result.plan, whole_step=False, extrapolate=True), order)
            continue
        if dominated(result, peak, kept, base):
            continue
        if kind == "row":
            kept.append((cost, result))
            continue
        fewest = fewest_checkpointed(searcher, result.plan).result
        if fewest is not None and fits(fewest.must_fit, budget, base.accelerator):
            heapq.heappush(queue, (slowdown(fewest, given, budget), fewest.peak, order, "row", fewest))
    compiled = _compiled_row(script, kept, given, budget)
    if compiled is not None:
        kept = sorted([*kept, compiled], key=lambda row: row[0])[:most]
    # the same training first (what the user asked for, in less memory), then what changes it, each fastest first:
    # a faster plan that drops the user's quantization is an alternative, not the answer
    return sorted(kept, key=lambda row: bool(training_changes(row[1].plan, base)))


def _compiled_row(
    script: ScriptStep, kept: list[tuple[float, Estimate]], given: Estimate, budget: int
) -> tuple[float, Estimate] | None:
    """The fastest row of the same training compiled (``--compile true``), where it fits: one more trace, not a
    compiled twin of every candidate (twice the planner's traces). Not offered where the blocks compile again for
    every sequence length (``recompiles_per_length``: LoRA on its query, key or value, measured 0.43 of eager's speed
    on this CPU) or already compile, nor on a CPU."""
    same = [row for row in kept if not training_changes(row[1].plan, given.plan)]
    if not same or same[0][1].plan.compile or recompiles_per_length(script.config):
        return None
    if given.plan.accelerator == "cpu":
        return None  # a rehearsal on a CPU: inductor builds C++ for tens of seconds before its first step
    result = estimate(script, dataclasses.replace(same[0][1].plan, compile=True), whole_step=False, extrapolate=True)
    if not fits(result.must_fit, budget, given.plan.accelerator):
        return None
    return slowdown(result, given, budget), result


def recompiles_per_length(config) -> bool:
    """Whether a compiled block compiles again for each new sequence length: litgpt's LoRA update of the query, key or
    value projections is a grouped convolution, whose backward inductor compiles for one length
    (``memfit.training.compiled_blocks``)."""
    return bool(getattr(config, "lora_r", 0)) and any(
        getattr(config, f"lora_{part}", False) for part in ("query", "key", "value")
    )


def least_slowdown(result: Estimate, given: Estimate, budget: int) -> float:
    """No less than the slowdown of the row ``result`` becomes, the planner's place for it in its queue: its own,
    but where every block is checkpointed that of one block checkpointed (the row is the fewest blocks that fit, a
    search made when its turn comes). ``result`` may be ``untraced``: no trace predicts a shorter step."""
    plan = result.plan
    if plan.activation_checkpointing == plan.blocks > 0:
        result = dataclasses.replace(result, plan=dataclasses.replace(plan, activation_checkpointing=1))
    return slowdown(result, given, budget)


def print_fitting(fitting, budget: int, base: Plan, file=sys.stdout) -> None:
    if not fitting:
        print(
            f"Nothing the planner tries fits {fmt_bytes(budget)}: use more devices (FSDP) or a smaller model.",
            file=file,
        )
        return
    print(
        f"Settings that fit {fmt_bytes(budget)} {reserve_note(base.accelerator)}, the same training first, each fastest"
        " first (slowdown vs. the given settings, predicted peak):",
        file=file,
    )
    for cost, result in fitting:
        changes = training_changes(result.plan, base)
        label = f"changes the training: {', '.join(changes)}" if changes else "the same training"
        print(f"  x{cost:4.2f}  {fmt_bytes(result.peak):>11}  {result.plan.describe()}  [{label}]", file=file)
    print(
        f"  (slowdowns: the step's FLOPs at {GPU_FLOPS / 1e12:.0f} TFLOP/s with each checkpointed block's forward again,"
        f" every weight read per micro-batch at {HBM_BYTES_PER_S / 1e12:.0f} TB/s, what crosses PCIe at"
        f" {PCIE_BYTES_PER_S / 1e9:.0f} GB/s, the quantizers' and optimizers' step costs, a compiled step"
        f" x{COMPILED_STEP_COST:.2f} (torchtune's published gain): memfit/prediction/planner.py)",
        file=file,
    )
    print(f"The first as flags: {fitting[0][1].plan.as_flags()}", file=file)
    faster = next(
        ((cost, result) for cost, result in fitting if training_changes(result.plan, base) and cost < fitting[0][0]),
        None,
    )
    if faster is not None:
        changes = ", ".join(training_changes(faster[1].plan, base))
        print(f"Faster, changing the training ({changes}), as flags: {faster[1].plan.as_flags()}", file=file)
