"""A run's out-of-memory explained: what was alive at the failure, what the device can hold, and the settings that fit
it (``memfit.prediction.planner``), as a few lines instead of a traceback."""

from __future__ import annotations

import dataclasses
import gc
import resource
import sys
from pathlib import Path

import torch

from memfit.failure.failure_ledger import alive_at_failure, holders_line, write_failure_ledger
from memfit.memory import proc_status
from memfit.observatory.picture import draw_failure, tensorboard_card, write_failure_page
from memfit.observatory.roles import role_sizes
from memfit.prediction.fake_step import Plan
from memfit.prediction.most_that_fits import Searcher, fewest_checkpointed, longest_sequence
from memfit.prediction.planner import plans_that_fit, print_fitting
from memfit.settings.budget import parse_budget
from memfit.settings.run import ScriptStep
from memfit.training.loggers import tensorboards
from memfit.units import fmt_bytes

CPU_PLANNED_SHARE = 0.85
"""Of what a CPU run has left, what the out-of-memory advice plans for: under an address-space limit (``ulimit -v``)
settings predicted at 91% of it failed again (tests/test_planner.py), the rest taken by malloc's arenas and free
fragments, which no tensor count sees."""


ADDRESS_SPACE_PLANNED_SHARE = 0.3
"""Under an address-space limit, of what the tensors held when they ran out, what the advice plans for. The address
space grows with the run well past the tensors, and past what it had grown to by an early failure: on the embedded
LoRA, 449, 612 and 949 MiB above its start for tensor peaks of 31, 105 and 205 MiB (micro-batches 8, 32 and 64; glibc's
arenas and their free fragments, threads, the profiler window). What the tensors hold when they run out varies with
the machine's load as much: the quick start's LoRA at a micro-batch of 256 under a 740 MB limit failed in its first
forward holding 306 and 370 MiB alone, 547 and 551 MiB with two more like it running (fewer threads' arenas had been
made by then). Planned at 50% of that, the busy runs' advice (a micro-batch of 64) failed again; at 30%, the most it
can plan beside the profiler window is about 130 MiB, which a micro-batch of 32 (105 MiB) holds within the limit
(tests/test_planner.py)."""


ADDRESS_SPACE_LIMITED = (
    "import resource, runpy, sys\n"
    "import torch, lightning, litgpt.lora, memfit.failure.failures\n"
    "size = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
    "resource.setrlimit(resource.RLIMIT_AS, (size + 1_500_000_000, resource.RLIM_INFINITY))\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
"""``python -c`` code that limits the process's address space (as ``ulimit -v`` does) to 1.5 GB more than it uses
once its libraries are loaded, then runs the script given: the real CPU out-of-memory that the tests provoke and the GPU
check rehearses"""


def device_capacity(device: torch.device, address_space_at_start: int = 0) -> int:
    """What the run's tensors may take: on a GPU what is free for this process (``cuda_capacity``); on CPU what the
    process holds and the RAM still available, and under an address-space limit (``ulimit -v``) no more than what the
    limit left when the run started (the address space libraries, threads and the data loaders took by then,
    ``address_space_at_start``, is not the tensors')."""
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


def tensors_beside_the_rest(failure: dict | None, address_space: int) -> int | None:
    """Under an address-space limit (``ulimit -v``), the most the tensors can hold beside everything else the process
    maps: what they held when the allocation failed (the failure's ledger), plus what the limit still left then
    (``address_space``: the process's highest address space, VmPeak, read at the failure). The address space grows far
    beyond the tensors during a run (measured on the embedded LoRA: 450-950 MiB above its start for tensor peaks of
    31-205 MiB: glibc's arenas, threads, the profiler), so the space left at the start over-promises. None without
    a limit or a ledger."""
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if failure is None or limit == resource.RLIM_INFINITY or not address_space:
        return None
    return sum(failure["bytes_by_role"].values()) + max(0, limit - address_space)


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
    that holds its saved-tensor hooks pushed: when the function raises (a CUDA out-of-memory inside
    memfit.training.loss's checkpointed head, on an H200), the generator stays suspended, its hooks stay pushed for as
    long as the traceback holds its frame, and every tensor the planner's fake step saves goes to the dead checkpoint
    ("A different number of tensors was saved during the original forward and recomputation"). torch 2.13 closes the
    generator itself. Cutting the tracebacks' links and collecting closes it; it also frees what the failed step's
    frames held. The links are cut, not only the error's ``__traceback__`` dropped: the ``with`` statement that caught
    it (``ends_cleanly``) holds the same traceback in a frame still running."""
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
    loggers: list = (),
) -> None:
    """A few readable lines on stderr: where it ran out, what held the memory, what would fit, and how to go on.

    ``memory`` is the run's ``PhaseMemory`` (its phase, and the model and optimizer it watches); ``step`` the
    step being taken; ``plan`` the run's settings; ``latest`` the run's last complete checkpoint, if any; ``loggers``
    the run's (Fabric's): a TensorBoard one's Images and Text tabs get the failure's picture and holders as they get
    the recorded step's.
    """
    out = sys.stderr
    loaded = memory.model is not None
    where = f"{memory.current} at step {step}" if loaded else "loading the model"
    # each rank explains its own failure: say whose, where several processes print into one terminal
    rank = f" (rank {memory.rank} of {plan.world_size})" if plan.world_size > 1 else ""
    print(f"\nOut of memory in {where} on {device}{rank}: {str(error).splitlines()[0]}", file=out)
    if device.type == "cuda":
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        print(f"CUDA allocated {fmt_bytes(allocated)}, reserved {fmt_bytes(reserved)}", file=out)
    address_space = proc_status().get("VmPeak", 0)  # before anything here maps more
    failure = None
    if loaded and getattr(memory, "run_dir", None) is not None:
        # read before the failed step's frames are let go: they hold what filled the device
        try:
            failure = alive_at_failure(
                error, memory.model, memory.optimizer, device, micro_batch=getattr(memory, "micro_batch", None)
            )
            path = write_failure_ledger(memory.run_dir, failure, device, memory.rank)
        except Exception as reading_error:  # noqa: BLE001  (the explanation goes on without it)
            print(f"warning: could not read what was alive at the failure ({type(reading_error).__name__})", file=out)
            failure = None
    if memory_budget:
        budget = parse_budget(memory_budget)
    elif device.type == "cpu":
        capacity = device_capacity(device, getattr(memory.probe, "address_space_at_start", 0))
        held = tensors_beside_the_rest(failure, address_space)
        if held is not None and held < capacity:
            budget = int(held * ADDRESS_SPACE_PLANNED_SHARE)
            print(
                f"(Under the address-space limit (ulimit -v) the tensors held {fmt_bytes(held)} when it failed: the"
                " rest of the process (its libraries, threads' arenas, buffers and mappings) took the rest and grows"
                f" with the run. Planned for {ADDRESS_SPACE_PLANNED_SHARE:.0%} of that, with the profiler window's"
                " host memory for settings that record one, or give --memory_budget.)",
                file=out,
            )
        else:
            budget = int(capacity * CPU_PLANNED_SHARE)
            print(
                f"(On CPU the predictions count tensors; the heap's free fragments and the threads' arenas take more:"
                f" planned for {CPU_PLANNED_SHARE:.0%} of the {fmt_bytes(capacity)} left, or give --memory_budget.)",
                file=out,
            )
    else:
        budget = device_capacity(device)
    if loaded:
        # every role the failure's ledger found (the activations and Python's other tensors too), else what the
        # model and optimizer hold
        roles = failure["bytes_by_role"] if failure is not None else role_sizes(memory.model, memory.optimizer)
        print("Held when it failed: " + ", ".join(f"{r} {fmt_bytes(b)}" for r, b in roles.items() if b), file=out)
    if failure is not None:
        print(holders_line(failure), file=out)
        print(f"What was alive at the failure, tensor by tensor: {path}", file=out)
    if loaded:  # the rope cache is sized for the longest sample the run holds
        plan = dataclasses.replace(plan, sequence_length=memory.model.max_seq_length)
    release_failed_step(error)
    if failure is not None:
        # drawn once the failed step's memory is let go: matplotlib, and TensorBoard's writer (made on first use, with
        # a thread), need memory of their own, which a CPU run out of its address space did not have
        try:
            picture = draw_failure(failure, path.with_suffix(".png"))
            page = write_failure_page(failure, path.with_suffix(".html"))
            print(f"Picture: {picture}  Page: {page}  (offline)", file=out)
            boards = tensorboards(loggers)
            if boards:
                card = tensorboard_card(lambda card_path, figsize: draw_failure(failure, card_path, figsize=figsize))
                for board in boards:
                    board.add_image("memory_failure", card, global_step=step, dataformats="HWC")
                    board.add_text("memory_failure", f"<pre>{holders_line(failure)}</pre>", global_step=step)
                    board.flush()  # the run ends here: nothing else writes the event file out
        except Exception as drawing_error:  # noqa: BLE001  (the ledger is written; the explanation goes on)
            print(f"warning: could not draw what was alive at the failure ({type(drawing_error).__name__})", file=out)
    try:
        fitting = plans_that_fit(script, plan, budget, most=5)
        print_fitting(fitting, budget, plan, file=out)
        # the reverse answers for the settings that failed: how long a sample, how few checkpointed blocks would fit
        searcher = Searcher(script, budget, plan.accelerator)
        answers = [longest_sequence(searcher, plan, script.config.block_size), fewest_checkpointed(searcher, plan)]
        print("With these settings otherwise: " + "; ".join(answer.line() for answer in answers), file=out)
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
        " settings, or with a smaller --train.micro_batch_size, --activation_checkpointing (true or a number of blocks) or another AdamW"
        " kernel (the same training); a setting that changes the training (quantization, an 8-bit or paged"
        " optimizer, offload) needs a new run in a fresh --out_dir.",
        file=out,
    )
