"""``--estimate``, the fit planner (``--memory_budget``) and the out-of-memory explanation.

The planner varies the settings that trade memory for speed (micro-batch size with accumulation to keep the
global batch, activation checkpointing, quantization, 8-bit and paged optimizers, FSDP CPU offload), estimates
each combination, keeps those under the budget and orders them by a predicted slowdown. The compute factors are
rules of thumb, stated here, not measurements: activation checkpointing x1.33 (one more forward), halving the
micro-batch x1.15 (smaller matmuls), nf4 x1.15 and nf4-dq x1.2 (dequantizing each weight per matmul), 8-bit AdamW
x1.02. Paging and CPU offload spill to host memory, and their cost depends on how much spills: the bytes that cross
PCIe each optimizer step (at ``PCIE_BYTES_PER_S``), and for offload the optimizer step on the CPU (at
``CPU_ADAM_PARAMS_PER_S``), against the step's compute (``6 x parameters x tokens`` FLOPs for full training,
``4 x`` when only adapters train, at ``GPU_FLOPS``). Paged state that fits beside the peak never moves.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import itertools
import math
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from memfit.budget import COMMON_CARDS, budget_note, cards_that_fit, parse_budget, usable_bytes
from memfit.checks import read_tokenizer
from memfit.data import sample_lengths, setup_data
from memfit.estimate import CUDA_CONTEXT_BYTES, Estimate, estimate
from memfit.fake_step import Plan, ScriptStep
from memfit.memory import fmt_bytes, proc_status
from memfit.optim import OPTIMIZERS
from memfit.picture import draw_step, write_page
from memfit.profiling import TRACED_WHOLE_UP_TO_MICRO_BATCHES
from memfit.quantizers import QUANTIZERS
from memfit.roles import UNATTRIBUTED, role_sizes
from memfit.run import Run

PCIE_BYTES_PER_S = 20e9
"""Host <-> device traffic one GPU sustains over PCIe 4.0 x16 in practice (rule of thumb)"""
GPU_FLOPS = 150e12
"""Dense bf16 throughput reached in training on an A100/H100-class GPU (rule of thumb, about half of peak)"""
CPU_ADAM_PARAMS_PER_S = 1e9
"""Parameters per second a host's AdamW step updates (rule of thumb)"""
REDUCE_SCATTER_BYTES_PER_S = 100e9
"""Gradient bytes per second an FSDP reduce-scatter moves between GPUs of one node (rule of thumb, NVLink class)"""


def spill_seconds(result: Estimate, budget: int) -> float:
    """Seconds per optimizer step spent moving what spills to host memory, and stepping it there."""
    seconds = 0.0
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
    if plan.activation_checkpointing:
        per_token += 2 * result.parameters  # the forward again, in backward
    return per_token * tokens / GPU_FLOPS


def step_time(result: Estimate, budget: int) -> float:
    """A plan's time per optimizer step in arbitrary units (compute factors x spill): only ratios mean anything."""
    plan = result.plan
    cost = 1.33 if plan.activation_checkpointing else 1.0
    cost *= 1.15 ** -math.log2(plan.micro_batch_size)  # each halving of the micro-batch: x1.15
    cost *= QUANTIZERS[plan.quantize].step_cost if plan.quantize else 1.0
    cost *= OPTIMIZERS[plan.optimizer].step_cost
    compute = compute_seconds(result)
    moved = spill_seconds(result, budget) + reduce_seconds(result)
    return cost * (compute + moved) / compute if compute else cost


def slowdown(result: Estimate, given: Estimate, budget: int) -> float:
    """Predicted time per optimizer step relative to the given settings' (which are x1.00 where they fit)."""
    return step_time(result, budget) / step_time(given, budget)


def candidates(base: Plan, trains_all_weights: bool) -> list[Plan]:
    global_per_rank = base.micro_batch_size * base.accumulation
    micro = sorted(
        {base.micro_batch_size}
        | {m for m in (1, 2, 4, 8, 16) if m < base.micro_batch_size and global_per_rank % m == 0}
    )
    # bitsandbytes' 4-bit weights train on one device; FSDP shards torchao's NF4 (where torchao is installed)
    one_device = base.world_size == 1 and base.strategy != "fsdp"
    four_bit = {
        kind.name
        for kind in QUANTIZERS.values()
        if kind.planner_tries
        and (
            not kind.shards_with_fsdp
            if one_device
            else kind.shards_with_fsdp and base.strategy == "fsdp" and importlib.util.find_spec(kind.library)
        )
    }
    quantize = [base.quantize] if trains_all_weights else sorted({base.quantize, None} | four_bit, key=str)
    if base.precision.endswith("-mixed"):
        quantize = [base.quantize]
    # fused AdamW is always a candidate: the same update without foreach's parameter-sized scratch; paging is CUDA's
    # (on CPU a paged optimizer is its unpaged self)
    tried = {
        kind.name
        for kind in OPTIMIZERS.values()
        if kind.planner_tries and (base.accelerator != "cpu" or not kind.paged)
    }
    # SGD is another training (no moments): the planner offers AdamW's kernels and states only in place of AdamW's
    optimizers = sorted({base.optimizer} | tried) if OPTIMIZERS[base.optimizer].traced_as != "SGD" else [base.optimizer]
    # CPU offload moves memory off a GPU; on a CPU run the host is the device, and there is nothing to move it to
    offload = (
        [base.cpu_offload, True]
        if trains_all_weights and not base.cpu_offload and base.accelerator != "cpu"
        else [base.cpu_offload]
    )
    # FSDP: each micro-batch's gradients reduce-scattered, or kept unsharded through the step (less communication)
    unsharded = [False, True] if base.strategy == "fsdp" and base.world_size > 1 else [base.accumulate_unsharded]
    plans = []
    for m, ac, q, opt, off, keep in itertools.product(micro, (False, True), quantize, optimizers, offload, unsharded):
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
                optimizer_in_backward=base.optimizer_in_backward and global_per_rank // m == 1,
            )
        )
    return plans


_ADAMW_KERNELS = {"AdamW", "AdamW-foreach", "AdamW-for-loop"}


def training_changes(plan: Plan, base: Plan) -> list[str]:
    """What in ``plan`` trains differently from ``base``: another optimizer (not another AdamW kernel), quantization,
    precision or sequence length. A micro-batch at the same global batch (accumulation is exact), activation
    checkpointing, offload and FSDP's reduce-scatter timing change the memory and the speed, not the training."""
    changes = []
    if plan.optimizer != base.optimizer and not {plan.optimizer, base.optimizer} <= _ADAMW_KERNELS:
        changes.append(f"optimizer {plan.optimizer}")
    if plan.quantize != base.quantize:
        changes.append(f"quantize {plan.quantize}" if plan.quantize else f"unquantized base (not {base.quantize})")
    if plan.precision != base.precision:
        changes.append(f"precision {plan.precision}")
    if plan.sequence_length != base.sequence_length:
        changes.append(f"sequence length {plan.sequence_length}")
    return changes


NEGLIGIBLE_SAVING = 0.02
"""A slower row that saves less than this share of its peak over a faster one that changes the training no more is
not listed: AdamW8bit beside AdamW for a 7B LoRA, whose whole state is 16 MiB of a 15 GiB peak"""


def distinct(fitting: list[tuple[float, Estimate]], base: Plan) -> list[tuple[float, Estimate]]:
    """``fitting`` (fastest first) without the rows that cost speed, or change the training, for a saving that does
    not matter: each row kept saves a real amount over every faster row that changes the training no more."""
    kept: list[tuple[float, Estimate]] = []
    for cost, result in fitting:
        changes = set(training_changes(result.plan, base))
        if not any(
            set(training_changes(faster.plan, base)) <= changes
            and faster.peak - result.peak < NEGLIGIBLE_SAVING * result.peak
            for _, faster in kept
        ):
            kept.append((cost, result))
    return kept


def plans_that_fit(script: ScriptStep, base: Plan, budget: int) -> list[tuple[float, Estimate]]:
    plans = candidates(base, trains_all_weights=script.mark_trainable is None)
    # each candidate is a traced step, seconds each for a 7B model: the wait shows its progress (closed, and its line
    # cleared, before anything else is printed, a failure's warning too)
    results = []
    with tqdm(total=len(plans), desc="planning: settings tried", unit="plan", mininterval=0.5, leave=False) as bar:
        for plan in plans:
            results.append(estimate(script, plan, whole_step=False))
            bar.update()
    given = next((result for result in results if result.plan == base), None) or estimate(script, base)
    fitting = [(slowdown(result, given, budget), result) for result in results if result.peak <= budget]
    return distinct(sorted(fitting, key=lambda item: (item[0], item[1].peak)), base)


def sequence_length(
    max_seq_length: int | None, block_size: int, data, checkpoint_dir, text_batches: bool
) -> tuple[int, str]:
    """The length the estimate assumes, and why: the flag, else the data's longest sample, else the context."""
    if max_seq_length:
        return min(max_seq_length, block_size), "--train.max_seq_length"
    if data is not None and checkpoint_dir is not None:
        data.connect(tokenizer=read_tokenizer(checkpoint_dir), batch_size=1, max_seq_length=block_size)
        setup_data(data)
        longest = max(sample_lengths(data.train_dataloader().dataset))
        return min(longest - (1 if text_batches else 0), block_size), "the longest training sample"
    return block_size, "the model's context (set --train.max_seq_length or --data for your data)"


def estimate_run(run: Run, script: ScriptStep) -> Estimate:
    """``--estimate``: the run's predicted memory, printed by role and phase (and, with --memory_budget, what fits),
    at the sample length the run would meet; its picture in the run's dir. Nothing is trained."""
    # a --model_name's architecture is not the checkpoint dir's: its tokenizer does not measure the samples
    length, why = sequence_length(
        run.train.max_seq_length,
        run.config.block_size,
        run.data,
        run.checkpoint_dir if run.model_name is None else None,
        text_batches=script.text_batches,
    )
    name = run.label or run.model_name or run.checkpoint_dir.name
    title = f"Estimate for {run.method} on {name}, {length} tokens per sample ({why}):"
    plan = dataclasses.replace(run.plan(), sequence_length=length)
    return report_estimate(script, plan, title, run.memory_budget, run.run_dir)


def report_estimate(
    script: ScriptStep, plan: Plan, title: str, budget_text: str | None, picture_dir: Path | None = None
) -> Estimate:
    """Prints the prediction for these settings (and, with a budget, what fits), without training; with
    ``picture_dir``, also draws the predicted step as the runs' pictures are drawn (optional: a failure warns)."""
    result = estimate(script, plan)
    target = "a CUDA GPU" if plan.accelerator == "cuda" else "the CPU (--accelerator cpu)"
    print(f"{title.rstrip(':')}, for {target}, {plan.precision}:")
    print(f"  {plan.describe()}")
    print(result.table())
    if plan.accelerator == "cpu":
        print(
            f"Predicted peak: {fmt_bytes(result.peak)} in {result.peak_phase} (CPU tensor memory, what a run's ledger"
            " measures; the process's RSS adds Python and its libraries, about 350 MiB with torch and Lightning,"
            " and the heap's free fragments)"
        )
        if result.gloo_buffer:
            print(
                f"  plus up to {fmt_bytes(result.gloo_buffer)} under gloo: an all-gather still running at the peak"
                " holds a block's copy in gloo's own buffer (a matter of timing; NCCL on GPUs has none)"
            )
    else:
        print(
            f"Predicted peak: {fmt_bytes(result.peak)} in {result.peak_phase} (max_memory_allocated; add about"
            f" {fmt_bytes(CUDA_CONTEXT_BYTES)} of CUDA context and 5-15% allocator reserve for what nvidia-smi"
            " shows)"
        )
        print_cards(script, plan, result.peak, planned_elsewhere=bool(budget_text))
        if result.host.get("offloaded_per_rank"):
            print(
                f"Host memory per rank for --fsdp.cpu_offload: {fmt_bytes(result.host['offloaded_per_rank'])} (its"
                " shards of the weights, gradients and optimizer state, pinned), beside what the process holds for"
                " Python, CUDA and its libraries"
            )
    traced = (
        "its last micro-batch"
        if plan.accumulation > TRACED_WHOLE_UP_TO_MICRO_BATCHES
        else f"its {plan.accumulation} micro-batch(es)"
    )
    print(
        f"Profiler window: about {fmt_bytes(result.host.get('profiler_window', 0))} more host memory while it"
        f" records the step ({traced} and the optimizer step, with their operators and Python calls;"
        " --profile.enabled false saves it)"
    )
    if picture_dir is not None:
        try:
            # Transients added analytically (a dequantized weight, gathered FSDP blocks) are in the predicted peak but
            # not in the drawn timeline, whose own peak the picture marks: the title names both, so they agree.
            drawn = result.timeline["peak_bytes"]
            name = f"{picture_dir.name}: predicted step"
            note = (
                ""
                if drawn == result.peak
                else f"(the predicted peak, {fmt_bytes(result.peak)}, adds"
                f" {fmt_bytes(result.peak - drawn)} of transients not drawn)"
            )
            # the table's word for what a run's ledger lists as unattributed
            timeline = {
                **result.timeline,
                "roles": {
                    ("temporaries" if role == UNATTRIBUTED else role): values
                    for role, values in result.timeline["roles"].items()
                },
            }
            png = draw_step(timeline, f"{name}\n{note}".strip(), picture_dir / "memory_step.png")["png"]
            html = write_page(timeline, f"{name}<br>{note}" if note else name, picture_dir / "memory_step.html")
            print(f"Picture: {png}  Page: {html}  (offline; the predicted step, drawn as a run's)")
        except Exception as error:  # noqa: BLE001  (the picture is optional: the prediction is printed)
            print(f"warning: could not draw the predicted step ({type(error).__name__}: {error})")
    if budget_text:
        budget = parse_budget(budget_text)
        if (note := budget_note(budget_text)) is not None:
            print(f"note: {note}")
        result.fitting = plans_that_fit(script, plan, budget)
        print_fitting(result.fitting, budget, plan)
    return result


def print_cards(script: ScriptStep, plan: Plan, peak: int, planned_elsewhere: bool) -> None:
    """Which common cards the peak fits, what each leaves; where it fits none, the fastest settings that fit the
    largest (unless a --memory_budget's list follows)."""
    fits = cards_that_fit(peak)
    if fits:
        shown = ", ".join(f"{card} ({fmt_bytes(usable_bytes(card) - peak)} to spare)" for card in fits)
        print(f"Fits one GPU: {shown}")
        return
    largest = COMMON_CARDS[-1]
    print(f"Fits none of {', '.join(COMMON_CARDS)} (the largest leaves {fmt_bytes(usable_bytes(largest))})")
    if planned_elsewhere or plan.world_size > 1:
        return
    fitting = plans_that_fit(script, plan, usable_bytes(largest))
    if fitting:
        cost, first = fitting[0]
        print(f"Fastest on one {largest}: x{cost:.2f} slower, {fmt_bytes(first.peak)}, with {first.plan.as_flags()}")
    else:
        print(f"Nothing the planner tries fits one {largest}: more devices (--strategy fsdp) or a smaller model")


def print_fitting(fitting, budget: int, base: Plan, limit: int = 12, file=sys.stdout) -> None:
    if not fitting:
        print(
            f"Nothing the planner tries fits {fmt_bytes(budget)}: use more devices (FSDP) or a smaller model.",
            file=file,
        )
        return
    print(
        f"Settings that fit {fmt_bytes(budget)}, fastest first (slowdown vs. the given settings, predicted peak):",
        file=file,
    )
    for cost, result in fitting[:limit]:
        changes = training_changes(result.plan, base)
        label = f"changes the training: {', '.join(changes)}" if changes else "the same training"
        print(f"  x{cost:4.2f}  {fmt_bytes(result.peak):>11}  {result.plan.describe()}  [{label}]", file=file)
    if len(fitting) > limit:
        print(f"  ... and {len(fitting) - limit} slower ones", file=file)
    print(f"The first as flags: {fitting[0][1].plan.as_flags()}", file=file)
    same = next((result for _, result in fitting if not training_changes(result.plan, base)), None)
    if same is not None and same is not fitting[0][1]:
        print(f"The fastest of the same training as flags: {same.plan.as_flags()}", file=file)


CPU_PLANNED_SHARE = 0.85
"""Of what a CPU run has left, what the out-of-memory advice plans for: under an address-space limit (``ulimit -v``)
settings predicted at 91% of it failed again (tests/test_planner.py), the rest taken by malloc's arenas and free
fragments, which no tensor count sees."""


def device_capacity(device: torch.device, address_space_at_start: int = 0) -> int:
    """What the run's tensors may take: on a GPU what is free for this process (``cuda_capacity``); on CPU what the process holds and the RAM still available,
    and under an address-space limit (``ulimit -v``) no more than what the limit left when the run started (the
    address space libraries, threads and the data loaders took by then, ``address_space_at_start``, is not the
    tensors')."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return cuda_capacity(
            free,
            total,
            torch.cuda.memory_reserved(device),
            torch.cuda.get_per_process_memory_fraction(device),
        )
    capacity = proc_status().get("VmRSS", 0) + _available_ram()
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        capacity = min(capacity, max(0, limit - address_space_at_start))
    return capacity


def cuda_capacity(free: int, total: int, reserved: int, fraction: float = 1.0) -> int:
    """What this process's tensors may take on its GPU: what the driver reports free (other processes' memory and this
    process's CUDA context are not) plus what this process's caching allocator holds (``reserved``, reusable), and no
    more than ``torch.cuda.set_per_process_memory_fraction`` lets the allocator reserve (a fraction of the whole card).
    A card shared with another job, or a cap set by the user, is planned for as it is, not as the whole card."""
    capacity = free + reserved
    if fraction < 1.0:
        capacity = min(capacity, int(total * fraction))
    return max(0, capacity)


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def release_failed_step(error: BaseException) -> None:
    """Lets go of the failed step's frames, which the error's traceback keeps alive, before anything else is traced.

    In torch 2.11, ``torch.utils.checkpoint`` runs a checkpointed function between two ``next()`` calls on a generator
    that holds its saved-tensor hooks pushed: when the function raises (a CUDA out-of-memory inside memfit.loss's
    checkpointed head, on an H200), the generator stays suspended, its hooks stay pushed for as long as the traceback
    holds its frame, and every tensor the planner's fake step saves goes to the dead checkpoint ("A different number
    of tensors was saved during the original forward and recomputation"). torch 2.13 closes the generator itself.
    Cutting the tracebacks' links and collecting closes it; it also frees what the failed step's frames held. The links
    are cut, not only the error's ``__traceback__`` dropped: the ``with`` statement that caught it (``ends_cleanly``)
    holds the same traceback in a frame still running."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            tb.tb_next, tb = None, tb.tb_next
        error = error.__cause__ or error.__context__
    gc.collect()


def explain_oom(
    error: BaseException,
    step: int,
    device: torch.device,
    memory,
    script: ScriptStep,
    plan: Plan,
    memory_budget: str | None,
    latest: Path | None = None,
) -> None:
    """A few readable lines on stderr: where it ran out, what held the memory, what would fit, and how to go on.

    ``memory`` is the run's ``PhaseMemory`` (its phase, and the model and optimizer it watches); ``step`` the
    step being taken; ``plan`` the run's settings; ``latest`` the run's last complete checkpoint, if any.
    """
    out = sys.stderr
    loaded = memory.model is not None
    where = f"{memory.current} at step {step}" if loaded else "loading the model"
    print(f"\nOut of memory in {where} on {device}: {str(error).splitlines()[0]}", file=out)
    if loaded:
        roles = role_sizes(memory.model, memory.optimizer)
        print("Held when it failed: " + ", ".join(f"{r} {fmt_bytes(b)}" for r, b in roles.items() if b), file=out)
    if device.type == "cuda":
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        print(f"CUDA allocated {fmt_bytes(allocated)}, reserved {fmt_bytes(reserved)}", file=out)
    if memory_budget:
        budget = parse_budget(memory_budget)
    elif device.type == "cpu":
        capacity = device_capacity(device, getattr(memory.probe, "address_space_at_start", 0))
        budget = int(capacity * CPU_PLANNED_SHARE)
        print(
            f"(On CPU the predictions count tensors; the heap's free fragments and the threads' arenas take more:"
            f" planned for {CPU_PLANNED_SHARE:.0%} of the {fmt_bytes(capacity)} left, or give --memory_budget.)",
            file=out,
        )
    else:
        budget = device_capacity(device)
    if loaded:  # the rope cache is sized for the longest sample the run holds
        plan = dataclasses.replace(plan, sequence_length=memory.model.max_seq_length)
    release_failed_step(error)
    try:
        fitting = plans_that_fit(script, plan, budget)
        print_fitting(fitting, budget, plan, limit=5, file=out)
        given = next((result for _, result in fitting if result.plan == plan), None)
        if given is not None:  # then the prediction and the failure disagree: say where else the memory may be
            print(
                f"The estimate puts these very settings at {fmt_bytes(given.peak)}, under {fmt_bytes(budget)}: the"
                " memory went elsewhere (another process on the device, the allocator's free but reserved blocks,"
                " or a sample longer than the estimate's); --memory_budget plans for less.",
                file=out,
            )
    except Exception as planning_error:  # noqa: BLE001  (the explanation so far stands; the run still ends cleanly)
        print(
            f"warning: could not work out settings that fit ({type(planning_error).__name__}:"
            f" {(str(planning_error).splitlines() or [''])[0][:200]})",
            file=out,
        )
    if latest is None:
        print(
            "No checkpoint was written for the failed step, nor before it: run again with settings that fit.", file=out
        )
        return
    print(
        f"No checkpoint was written for the failed step. --resume true continues from {latest} with the same"
        " settings, or with a smaller --train.micro_batch_size, --activation_checkpointing true or another AdamW"
        " kernel (the same training); a setting that changes the training (quantization, an 8-bit or paged"
        " optimizer, offload) needs a new run in a fresh --out_dir.",
        file=out,
    )
