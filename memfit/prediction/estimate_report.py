"""``--estimate``: the prediction for a run's settings printed by role and phase, at the sample length the run would
meet, with the cards it fits and (with ``--memory_budget``) the settings that fit (``memfit.prediction.planner``); its
picture drawn as a run's is. Nothing is trained."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from memfit.files import write_text_whole
from memfit.observatory.picture import draw_step, draw_what_fits, thinned, write_page, write_what_fits_page
from memfit.observatory.profiling import TRACED_WHOLE_UP_TO_MICRO_BATCHES
from memfit.observatory.roles import UNATTRIBUTED
from memfit.prediction.estimate import (
    CPU_RUNTIME_RSS_BYTES,
    GLOO_HEAP_RSS_BYTES,
    Estimate,
    estimate,
    plan_of,
)
from memfit.prediction.fake_step import Plan
from memfit.prediction.most_that_fits import (
    Limit,
    Searcher,
    fewest_checkpointed,
    fewest_devices,
    largest_micro_batch,
    longest_sequence,
)
from memfit.prediction.planner import plans_that_fit, print_fitting
from memfit.settings.budget import (
    ALLOCATOR_RESERVE,
    COMMON_CARDS,
    CUDA_CONTEXT_BYTES,
    budget_note,
    cards_that_fit,
    fit_answer,
    parse_budget,
    reserve_note,
    usable_bytes,
)
from memfit.settings.model_source import read_tokenizer
from memfit.settings.resolve import model_label
from memfit.settings.run import Run, ScriptStep
from memfit.training.checkpoint import plain_hparams
from memfit.training.data import sample_lengths, setup_data
from memfit.training.sample import TEXT_PROMPT_TOKENS
from memfit.units import fmt_bytes


def sequence_length(
    max_seq_length: int | None, block_size: int, data, checkpoint_dir, text_batches: bool
) -> tuple[int, str, int]:
    """The length the estimate assumes, and why: the flag, else the data's longest sample, else the context; and a
    validation sample's, found the same way (the validation split may hold longer samples than training's)."""
    if max_seq_length:
        length = min(max_seq_length, block_size)
        return length, "--train.max_seq_length", length
    if data is not None and checkpoint_dir is not None:
        data.connect(tokenizer=read_tokenizer(checkpoint_dir), batch_size=1, max_seq_length=block_size)
        setup_data(data)
        shift = 1 if text_batches else 0
        longest = max(sample_lengths(data.train_dataloader().dataset))
        validation = max(sample_lengths(data.val_dataloader().dataset), default=longest)
        return min(longest - shift, block_size), "the longest training sample", min(validation - shift, block_size)
    why = "the model's context (set --train.max_seq_length or --data for your data)"
    return block_size, why, block_size


def beside_the_steps(run: Run, validation_length: int, text_batches: bool) -> dict:
    """The plan's run phases beside its steps (``memfit.prediction.fake_step.Plan``): a validation of
    ``validation_length`` tokens a sample where the run validates, the sample it generates after, a resume where
    it resumes."""
    validates = run.eval.max_iters > 0 and (
        run.eval.initial_validation or run.eval.final_validation or run.eval.interval > 0
    )
    return {
        "validation_length": validation_length if validates else 0,
        "sample_new_tokens": run.eval.max_new_tokens or 0,
        "sample_prompt_tokens": TEXT_PROMPT_TOKENS if text_batches else 0,
        "resumes": run.resume_from is not None,
    }


def estimate_run(run: Run, script: ScriptStep) -> Estimate:
    """``--estimate``: the run's predicted memory, printed by role and phase (and, with --memory_budget, what fits),
    at the sample length the run would meet; its picture in the run's dir. Nothing is trained."""
    # a --model_name's architecture is not the checkpoint dir's: its tokenizer does not measure the samples
    length, why, validation_length = sequence_length(
        run.train.max_seq_length,
        run.config.block_size,
        run.data,
        run.checkpoint_dir if run.model_name is None else None,
        text_batches=script.text_batches,
    )
    name = run.label or run.model_name or run.checkpoint_dir.name
    title = f"Estimate for {run.method} on {name}, {length} tokens per sample ({why}):"
    plan = dataclasses.replace(
        plan_of(run), sequence_length=length, **beside_the_steps(run, validation_length, script.text_batches)
    )
    # named by what it predicts: the same estimate again replaces its picture instead of adding a directory (users
    # repeat an estimate many times while choosing settings), another one gets its own
    digest = hashlib.sha256(f"{plan!r} {run.config!r} {title}".encode()).hexdigest()[:10]
    model = run.label or model_label(run.checkpoint_dir, run.model_name, run.embedded)
    picture_dir = run.run_dir.with_name(f"{run.method}-estimate-{model}-{digest}")
    return report_estimate(script, plan, title, run.memory_budget, picture_dir, settings=plain_hparams(run.hparams))


def report_estimate(
    script: ScriptStep,
    plan: Plan,
    title: str,
    budget_text: str | None,
    picture_dir: Path | None = None,
    settings: dict | None = None,
) -> Estimate:
    """Prints the prediction for these settings (and, with a budget, what fits), without training; with
    ``picture_dir``, also draws the predicted step as the runs' pictures are drawn (optional: a failure warns) and
    writes ``estimate.json`` there (``write_estimate``: what ``python -m memfit.compare`` sets beside a run)."""
    result = estimate(script, plan)
    target = "a CUDA GPU" if plan.accelerator == "cuda" else "the CPU (--accelerator cpu)"
    print(f"{title.rstrip(':')}, for {target}, {plan.precision}:")
    print(f"  {plan.describe()}")
    print(result.table())
    if plan.accelerator == "cpu":
        print(
            f"Predicted peak: {fmt_bytes(result.peak)} in {result.where_peak} (CPU tensor memory, what a run's ledger"
            " measures)"
        )
        if result.gloo_buffer:
            print(
                f"  plus up to {fmt_bytes(result.gloo_buffer)} under gloo: a collective running at the peak holds a"
                " copy of its own (a block it all-gathers, a unit's gradient it reduce-scatters; a matter of timing:"
                " NCCL on GPUs makes none)"
            )
        low = result.peak + CPU_RUNTIME_RSS_BYTES
        if plan.world_size > 1:
            print(
                f"Host memory per rank (peak RSS): {fmt_bytes(low)} to {fmt_bytes(low + GLOO_HEAP_RSS_BYTES)}: the"
                f" tensors' peak, about {fmt_bytes(CPU_RUNTIME_RSS_BYTES)} of Python, torch and Lightning, and up to"
                f" {fmt_bytes(GLOO_HEAP_RSS_BYTES)} of collective buffers gloo's threads free into heaps of their own"
                " (what a run prints as 'Host memory per rank')"
            )
        else:
            print(
                f"Host memory of the process (peak RSS): about {fmt_bytes(low)}: the tensors' peak and about"
                f" {fmt_bytes(CPU_RUNTIME_RSS_BYTES)} of Python, torch and Lightning (what a run prints as"
                " 'Peak memory by phase')"
            )
    else:
        print(
            f"Predicted peak: {fmt_bytes(result.peak)} in {result.where_peak} (max_memory_allocated; add about"
            f" {fmt_bytes(CUDA_CONTEXT_BYTES)} of CUDA context and the caching allocator's reserve, planned at"
            f" {ALLOCATOR_RESERVE:.0%}, for what nvidia-smi shows)"
        )
        print_cards(script, plan, result.peak, planned_elsewhere=bool(budget_text))
        if result.host.get("activations"):
            print(
                f"Host memory for --activation_offloading: {fmt_bytes(result.host['activations'])} of saved"
                " activations, pinned (the device keeps one block's at a time)"
            )
        beside = [
            (
                f"a resume {fmt_bytes(result.host['resume_loaded'])} (the checkpoint loaded before it moves to the device)"
            )
            if result.host.get("resume_loaded")
            else None,
            (f"a save {fmt_bytes(result.host['save_copy'])} (a tensor's copy on its way to the file)")
            if result.host.get("save_copy")
            else None,
            (
                f"rank 0's save {fmt_bytes(result.host['full_state_dict'])} (the full state dict gathered for the last"
                " checkpoint, which is consolidated whatever --fsdp.state_dict_type says)"
            )
            if result.host.get("full_state_dict")
            else None,
        ]
        if any(beside):
            print(
                "Host memory the run's phases add, beside what the process holds for Python, CUDA and its libraries"
                " (not estimated): " + ", ".join(line for line in beside if line)
            )
        if result.host.get("offloaded_per_rank"):
            print(
                f"Host memory per rank for --fsdp.cpu_offload: {fmt_bytes(result.host['offloaded_per_rank'])} (its"
                " shards of the weights, gradients and optimizer state, pinned), beside what the process holds for"
                " Python, CUDA and its libraries"
            )
    if plan.compile:
        print(
            "Compiled: each block's graph as torch.compile's partitioner splits it (what forward saves for backward,"
            " what backward computes again), what inductor writes to memory counted and what it fuses not; its reuse"
            " of buffers is not modelled (within 4% of measured compiled peaks on a CPU: docs/compile.md)"
        )
    traced = (
        "its last micro-batch"
        if plan.accumulation > TRACED_WHOLE_UP_TO_MICRO_BATCHES
        else f"its {plan.accumulation} micro-batch(es)"
    )
    print(
        f"Profiler window: about {fmt_bytes(result.host.get('profiler_window', 0))} more host memory while it"
        f" records the step ({traced} and the optimizer step, with their operators"
        f"{' and Python calls' if plan.profile_with_stack else ''}; --profile.enabled false saves it)"
    )
    if picture_dir is not None:
        write_estimate(result, picture_dir / "estimate.json", settings or {}, target)
        try:
            # Transients added analytically (a dequantized weight, gathered FSDP blocks) are in the predicted peak but
            # not in the drawn timeline, whose own peak the picture marks: the title names both, so they agree.
            drawn = result.timeline["peak_bytes"]
            name = f"{picture_dir.name}: predicted step"
            note = (
                ""
                if drawn == result.step_peak
                else f"(the predicted step's peak, {fmt_bytes(result.step_peak)}, adds"
                f" {fmt_bytes(result.step_peak - drawn)} of transients not drawn)"
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
            # one file that opens alone, as a run's page does, wherever it is copied
            page_title = f"{name}<br>{note}" if note else name
            html = write_page(timeline, page_title, picture_dir / "memory_step.html")
            print(f"Picture: {png}  Page: {html}  (offline; the predicted step, drawn as a run's)")
        except Exception as error:  # noqa: BLE001  (the picture is optional: the prediction is printed)
            print(f"warning: could not draw the predicted step ({type(error).__name__}: {error})")
    if budget_text:
        budget = parse_budget(budget_text)
        if (note := budget_note(budget_text)) is not None:
            print(f"note: {note}")
        print(fit_answer(result.must_fit, budget, budget_text, plan.accelerator))
        result.fitting = plans_that_fit(script, plan, budget)
        print_fitting(result.fitting, budget, plan)
        result.limits = print_limits(script, plan, budget, result.fitting, picture_dir)
    return result


COMPARISON_POINTS = 2000
"""The most points of the predicted step's curve ``estimate.json`` keeps (a 7B model's step makes tens of thousands of
allocations): more than a picture's columns"""


def write_estimate(result: Estimate, path: Path, settings: dict, target: str) -> None:
    """The prediction by phase in a run's ledger's terms (each phase's peak and its roles; the estimate's
    ``temporaries`` are what a run's ledger calls ``unattributed``) with the settings it is for, so that
    ``python -m memfit.compare`` can set it beside a run's measured ledger."""

    def in_ledger_terms(phases: dict) -> dict:
        return {
            name: {
                "peak_bytes": phase["peak"],
                "found_at_peak_bytes": {
                    (UNATTRIBUTED if role == "temporaries" else role): size for role, size in phase["roles"].items()
                },
            }
            for name, phase in phases.items()
        }

    document = {
        "measures": f"predicted for {target}",
        "phases": in_ledger_terms(result.phases),
        # the run's phases beside its steps, and the phase of the run's peak (a run's summary.json has both)
        "run_phases": in_ledger_terms(result.run_phases),
        "run_peak_phase": result.run_peak_phase,
        "peak_bytes": result.peak,
        "gloo_buffer_bytes": result.gloo_buffer,
        "settings": settings,
    }
    if result.timeline:
        # the predicted step's tensor memory, for the comparison's picture: at each allocation and free (thinned to
        # the highest of each run of them), on the estimate's axis of allocations, which has no clock
        curve = thinned(result.timeline, COMPARISON_POINTS)
        document["step_curve"] = {
            "x": curve["ms"],
            "bytes": [sum(values) for values in zip(*curve["roles"].values())],
            "phases": curve["phases"],
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_whole(path, json.dumps(document, indent=1, default=str) + "\n")


def print_limits(
    script: ScriptStep, plan: Plan, budget: int, fitting: list, picture_dir: Path | None = None
) -> dict[str, list[Limit]]:
    """The reverse answers (``memfit.prediction.most_that_fits``) for the given settings and for the fastest plan that
    fits: the longest sequence, the largest micro-batch, with FSDP the fewest devices, and where blocks must be
    checkpointed, the fewest. Each is shown at its boundary: the answer's predicted peak and the next value's. With
    ``picture_dir``, also their picture: predicted peak against sequence length (``draw_what_fits``)."""
    searcher = Searcher(script, budget, plan.accelerator)
    plans = {"these settings": plan}
    if fitting and fitting[0][1].plan != plan:
        plans[f"the first plan listed (x{fitting[0][0]:.2f})"] = fitting[0][1].plan
    print(
        f"The most that fits {fmt_bytes(budget)} {reserve_note(plan.accelerator)} (each answer fits, the next value"
        " does not):"
    )
    limits = {}
    for name, each in plans.items():
        found = [
            longest_sequence(searcher, each, script.config.block_size),
            largest_micro_batch(searcher, each),
        ]
        if each.strategy == "fsdp":
            found.append(fewest_devices(searcher, each))
        if 0 < each.activation_checkpointing or not searcher.fits(each):
            found.append(fewest_checkpointed(searcher, each))
        limits[name] = found
        print(f"  {name}: " + "; ".join(limit.line() for limit in found))
        devices = next((limit for limit in found if limit.flag == "--devices" and limit.result is not None), None)
        if devices is not None and devices.result.host.get("offloaded_per_rank"):
            print(
                f"    with --devices {devices.value}, each rank's host holds"
                f" {fmt_bytes(devices.result.host['offloaded_per_rank'])} for --fsdp.cpu_offload"
            )
    if picture_dir is not None:
        try:
            png, page = _draw_what_fits(searcher, plans, limits, script.config.block_size, picture_dir)
            print(
                f"What fits: {png}  Page: {page}  (offline; predicted peak against sequence length, each answer marked)"
            )
        except Exception as error:  # noqa: BLE001  (the picture is optional: the answers are printed)
            print(f"warning: could not draw what fits ({type(error).__name__}: {error})")
    return limits


WHAT_FITS_POINTS = 4
"""Places along each plan's curve, evenly up to twice its answer, where a sequence length is estimated unless the
searches already estimated one near it. Each estimate of an 8B model costs 2 to 4 shallow traces, about 1 s, and a
peak grows nearly linearly in the tokens between the chunks of the loss, so 4 places and the searches' own draw the
curve (6 took the README's 8B fill-the-card command 11 s more, 65.6 s against 54.6)."""


def _draw_what_fits(
    searcher: Searcher, plans: dict[str, Plan], limits: dict[str, list[Limit]], context: int, picture_dir: Path
) -> tuple[Path, Path]:
    """Each plan's predicted peak at the sequence lengths estimated for it, the budget and each longest sequence that
    fits, as ``what_fits.png`` and ``what_fits.html`` in ``picture_dir``."""

    def estimated(each: Plan) -> list[tuple[int, int]]:
        return sorted(
            (result.plan.sequence_length, result.peak)
            for result in searcher.results.values()
            if result.plan.at_length(each.sequence_length) == each
        )

    curves, answers = {}, {}
    for name, each in plans.items():
        longest = next(limit for limit in limits[name] if limit.flag == "--train.max_seq_length")
        span = min(context, 2 * (longest.value or each.sequence_length))
        for k in range(1, WHAT_FITS_POINTS + 1):
            tokens = max(2, span * k // WHAT_FITS_POINTS)
            if all(abs(tokens - known) > span / (2 * WHAT_FITS_POINTS) for known, _ in estimated(each)):
                searcher.estimate(each.at_length(tokens))
        curves[name] = estimated(each)
        answers[name] = (longest.value, longest.result.peak) if longest.value is not None else None
    title = f"{picture_dir.name}: what fits {fmt_bytes(searcher.budget)} {reserve_note(searcher.accelerator)}"
    usable = int(searcher.target)
    png = draw_what_fits(curves, answers, searcher.budget, usable, title, picture_dir / "what_fits.png")
    page = write_what_fits_page(curves, answers, searcher.budget, usable, title, picture_dir / "what_fits.html")
    return png, page


def print_cards(script: ScriptStep, plan: Plan, peak: int, planned_elsewhere: bool) -> None:
    """Which common cards the peak fits, what each leaves; where it fits none, the fastest settings that fit the
    largest (unless a --memory_budget's list follows)."""
    fits = cards_that_fit(peak)
    if fits:
        spare = {card: usable_bytes(card) - round(peak * (1 + ALLOCATOR_RESERVE)) for card in fits}
        shown = ", ".join(f"{card} ({fmt_bytes(spare[card])} to spare beside the reserve)" for card in fits)
        # the peak is one rank's: with several, each rank needs a card of its own
        per_rank = f" per rank ({plan.world_size} ranks)" if plan.world_size > 1 else ""
        print(f"Fits one GPU{per_rank}: {shown}")
        return
    largest = COMMON_CARDS[-1]
    who = "A rank fits" if plan.world_size > 1 else "Fits"
    print(f"{who} none of {', '.join(COMMON_CARDS)} (the largest leaves {fmt_bytes(usable_bytes(largest))})")
    if planned_elsewhere or plan.world_size > 1:
        return
    fitting = plans_that_fit(script, plan, usable_bytes(largest), most=1)
    if fitting:
        cost, first = fitting[0]
        print(f"Fastest on one {largest}: x{cost:.2f} slower, {fmt_bytes(first.peak)}, with {first.plan.as_flags()}")
    else:
        print(f"Nothing the planner tries fits one {largest}: more devices (--strategy fsdp) or a smaller model")
