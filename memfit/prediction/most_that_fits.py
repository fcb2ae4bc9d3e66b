"""The most a budget holds, found before launch: the longest ``--train.max_seq_length``, the largest
``--train.micro_batch_size``, the fewest FSDP ``--devices`` and the fewest checkpointed blocks that fit
(``--estimate --memory_budget``, and the out-of-memory explanation).

Each answer is a boundary of the estimate itself: the answer fits and the next value up does not, both estimated
(``Limit.result`` and ``Limit.next_result``), with the allocator's reserve kept (``memfit.settings.budget.fits``). A
whole-depth trace costs seconds for a 7B model, so the estimates are extrapolated from 2- and 3-block models of the
same blocks (``memfit.prediction.fake_step.extrapolated_step``: the same bytes, tested), and the search starts where a
straight line through two of them crosses the budget (activations grow about linearly in tokens, in micro-batches and in
the blocks not checkpointed), stepping from there to the boundary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from memfit.prediction.estimate import Estimate, estimate
from memfit.prediction.fake_step import Plan
from memfit.settings.budget import fits, reserve_fraction
from memfit.settings.run import ScriptStep
from memfit.units import fmt_bytes

DEVICE_COUNTS = (*range(1, 9), *range(16, 1025, 8))
"""The device counts the fewest-devices answer tries: any count on one node, whole nodes of 8 beyond"""


@dataclass
class Limit:
    """One reverse answer: ``value`` of ``flag`` fits (None: not even the smallest does), with its predicted peak, and
    the next value up's (None where ``value`` is the largest allowed, ``why_last`` says why)."""

    flag: str
    value: int | None
    result: Estimate | None
    next_value: int | None = None
    next_result: Estimate | None = None
    why_last: str = ""

    def line(self) -> str:
        if self.value is None:
            return f"{self.flag}: not even {self.next_value} fits ({fmt_bytes(self.next_result.peak)})"
        if self.next_result is None:
            beyond = f"; {self.why_last}"
        else:
            beyond = f"; {self.next_value} needs {fmt_bytes(self.next_result.peak)}"
            if fmt_bytes(self.next_result.peak) == fmt_bytes(self.result.peak):  # a token more: often the same GiB
                beyond += f", {fmt_bytes(self.next_result.peak - self.result.peak)} more"
        return f"{self.flag} {self.value} ({fmt_bytes(self.result.peak)}{beyond})"


def largest_fitting(lo: int, hi: int, fits_at: Callable[[int], bool], guess: int) -> tuple[int | None, list[int]]:
    """The largest index in [lo, hi] where ``fits_at`` holds, for a ``fits_at`` that holds up to a boundary and not
    beyond; None where it fails at ``lo``. Starts at ``guess`` and gallops to the boundary, then bisects, so an
    accurate guess costs two evaluations (the answer and the one above). Returns the indices evaluated too."""
    tried: list[int] = []

    def check(i: int) -> bool:
        tried.append(i)
        return fits_at(i)

    i = min(max(guess, lo), hi)
    if check(i):
        good, step = i, 1
        bad = None
        while good < hi:  # up until it fails
            j = min(good + step, hi)
            if check(j):
                good, step = j, step * 2
            else:
                bad = j
                break
        if bad is None:
            return good, tried
    else:
        bad, step = i, 1
        good = None
        while bad > lo:  # down until it fits
            j = max(bad - step, lo)
            if check(j):
                good = j
                break
            bad, step = j, step * 2
        if good is None:
            return None, tried
    while bad - good > 1:
        middle = (good + bad) // 2
        if check(middle):
            good = middle
        else:
            bad = middle
    return good, tried


def crossing(x0: int, peak0: int, x1: int, peak1: int, target: float) -> float:
    """Where the straight line through (x0, peak0) and (x1, peak1) reaches ``target``."""
    if peak1 == peak0:
        return math.inf if peak0 <= target else -math.inf
    return x0 + (target - peak0) * (x1 - x0) / (peak1 - peak0)


class Searcher:
    """Estimates of plans near one, each made once (a search asks for the same plan at several points), from
    shallow traces where the model's blocks are alike (``memfit.prediction.fake_step.extrapolated_step``)."""

    def __init__(self, script: ScriptStep, budget: int, accelerator: str) -> None:
        self.script, self.budget, self.accelerator = script, budget, accelerator
        self.results: dict[str, Estimate] = {}

    def estimate(self, plan: Plan) -> Estimate:
        key = repr(plan)
        if key not in self.results:
            self.results[key] = estimate(self.script, plan, whole_step=False, extrapolate=True)
        return self.results[key]

    def fits(self, plan: Plan) -> bool:
        return fits(self.estimate(plan).must_fit, self.budget, self.accelerator)

    @property
    def target(self) -> float:
        """The highest peak that fits, the reserve kept."""
        return self.budget / (1 + reserve_fraction(self.accelerator))

    def refined(
        self, plans: Callable[[int], Plan], lo: int, hi: int, guess: float, seeds: tuple = (), rounds: int = 3
    ) -> int:
        """``guess`` moved by the secant method: each round estimates the guess and draws the line through the two
        points estimated so far nearest the budget (``seeds``: the ``(index, peak)`` the guess was drawn from), so a
        peak that is not quite linear in the index still brings the search next to the boundary in a few
        estimates."""
        # the index at or below x in [lo, hi]; a line that never reaches the budget (two equal peaks: the blocks'
        # checkpointing saves nothing the peak holds) crosses it at an infinity
        clamp = lambda x: int(min(max(x, lo), hi)) if math.isfinite(x) else (hi if x > 0 else lo)  # noqa: E731
        points: list[tuple[int, int]] = list(seeds)
        index = clamp(guess)
        for _ in range(rounds):
            if any(i == index for i, _ in points):
                break
            points.append((index, self.estimate(plans(index)).must_fit))
            if len(points) < 2:
                index = clamp(index + (1 if points[-1][1] <= self.target else -1))
                continue
            (x0, p0), (x1, p1) = sorted(points, key=lambda point: abs(point[1] - self.target))[:2]
            index = clamp(crossing(x0, p0, x1, p1, self.target))
        return index

    def limit(
        self,
        flag: str,
        plans: Callable[[int], Plan],
        values: Callable[[int], int],
        lo: int,
        hi: int,
        guess: float,
        why_last: str,
        seeds: tuple = (),
    ) -> Limit:
        """The largest index in [lo, hi] whose plan fits (plans need more memory as the index grows), as ``flag``'s
        value, found from ``guess`` (drawn from ``seeds``) and estimated at the boundary: the answer and the index
        above it."""
        guess = self.refined(plans, lo, hi, guess, seeds)
        index, _ = largest_fitting(lo, hi, lambda i: self.fits(plans(i)), guess)
        if index is None:
            return Limit(flag, None, None, values(lo), self.estimate(plans(lo)))
        above = (values(index + 1), self.estimate(plans(index + 1))) if index < hi else (None, None)
        return Limit(flag, values(index), self.estimate(plans(index)), *above, why_last=why_last)


def longest_sequence(searcher: Searcher, plan: Plan, context: int) -> Limit:
    """The longest ``--train.max_seq_length`` at which ``plan`` fits, to the token (at most the whole ``context``):
    the answer fits and one token more does not."""

    def at(tokens: int) -> Plan:
        return plan.at_length(tokens)

    near = max(2, min(context, plan.sequence_length))
    half = near // 2
    seeds = ((half, searcher.estimate(at(half)).must_fit), (near, searcher.estimate(at(near)).must_fit))
    return searcher.limit(
        "--train.max_seq_length",
        at,
        lambda tokens: tokens,
        1,
        context,
        crossing(*seeds[0], *seeds[1], searcher.target),
        f"the model's whole context ({context} tokens)",
        seeds,
    )


def largest_micro_batch(searcher: Searcher, plan: Plan, most: int = 4096) -> Limit:
    """The largest ``--train.micro_batch_size`` at which ``plan`` fits, the global batch kept where it allows (a
    micro-batch above a process's share of the global batch makes the global batch that micro-batch)."""
    per_rank = plan.micro_batch_size * plan.accumulation

    def at(m: int) -> Plan:
        return dataclasses.replace(plan, micro_batch_size=m, accumulation=max(1, per_rank // m))

    seeds = ((1, searcher.estimate(at(1)).must_fit), (2, searcher.estimate(at(2)).must_fit))
    guess = crossing(*seeds[0], *seeds[1], searcher.target)
    return searcher.limit(
        "--train.micro_batch_size", at, lambda m: m, 1, most, guess, f"the most tried ({most})", seeds
    )


def fewest_devices(searcher: Searcher, plan: Plan) -> Limit:
    """The fewest FSDP ``--devices`` (``DEVICE_COUNTS``) over which ``plan`` fits, the global batch kept: each rank's
    shard of the weights, gradients and optimizer state shrinks as devices are added, the activations do not. (FSDP
    is estimated from whole-depth traces only: its estimate reads the step's timeline.)"""
    global_batch = plan.micro_batch_size * plan.accumulation * plan.world_size
    last = len(DEVICE_COUNTS) - 1

    def at(i: int) -> Plan:  # index 0 is the most devices: an index up is a device count down
        n = DEVICE_COUNTS[last - i]
        return dataclasses.replace(
            plan,
            strategy="fsdp",
            world_size=n,
            accumulation=max(1, global_batch // (plan.micro_batch_size * n)),
            fsdp_replicas=1,
        )

    # what shrinks with the devices is, from one and two devices' estimates, twice their difference
    one, two = searcher.estimate(at(last)).must_fit, searcher.estimate(at(last - 1)).must_fit
    sharded = 2 * (one - two)
    first = next((i for i, n in enumerate(DEVICE_COUNTS) if one - sharded + sharded / n <= searcher.target), last)
    return searcher.limit(
        "--devices", at, lambda i: DEVICE_COUNTS[last - i], 0, last, last - first, why_last="one device"
    )


def fewest_checkpointed(searcher: Searcher, plan: Plan) -> Limit:
    """The fewest blocks checkpointed at which ``plan`` fits (``--activation_checkpointing N``, spread from the
    first): a block checkpointed keeps its input instead of its activations, so the peak falls about linearly in the
    count."""
    blocks = plan.blocks

    def at(j: int) -> Plan:  # j blocks not checkpointed
        return dataclasses.replace(plan, activation_checkpointing=blocks - j)

    seeds = ((0, searcher.estimate(at(0)).must_fit), (blocks, searcher.estimate(at(blocks)).must_fit))
    guess = crossing(*seeds[0], *seeds[1], searcher.target)
    return searcher.limit(
        "--activation_checkpointing", at, lambda j: blocks - j, 0, blocks, guess, "none checkpointed", seeds
    )
