"""The most a budget holds, found before launch: the longest ``--train.max_seq_length``, the largest
``--train.micro_batch_size``, the fewest FSDP ``--devices`` and the fewest checkpointed blocks that fit
(``--estimate --memory_budget``, and the out-of-memory explanation).

Each answer is a boundary of the estimate itself: the answer fits and the next value up does not, both estimated
(``Limit.peak`` and ``Limit.next_peak``), with the allocator's reserve kept (``memfit.budget.fits``). Estimating is
a traced step per sequence length or micro-batch, seconds each for a 7B model, so the search starts where a straight
line through two estimates crosses the budget (activations grow about linearly in tokens and in micro-batches, and
in the number of blocks not checkpointed) and only steps from there to the boundary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from memfit.budget import fits, reserve_fraction
from memfit.estimate import Estimate, estimate
from memfit.fake_step import Plan, ScriptStep
from memfit.memory import fmt_bytes

SEQUENCE_STEP = 8
"""The longest sequence is found to a multiple of this many tokens (the width tensor cores take), or the model's whole
context"""
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
        beyond = (
            f"; {self.next_value} needs {fmt_bytes(self.next_result.peak)}"
            if self.next_result is not None
            else f"; {self.why_last}"
        )
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
    """Estimates of plans near ``base``, each made once (a search asks for the same plan at several points)."""

    def __init__(self, script: ScriptStep, budget: int, accelerator: str) -> None:
        self.script, self.budget, self.accelerator = script, budget, accelerator
        self.results: dict[str, Estimate] = {}

    def estimate(self, plan: Plan) -> Estimate:
        key = repr(plan)
        if key not in self.results:
            self.results[key] = estimate(self.script, plan, whole_step=False)
        return self.results[key]

    def fits(self, plan: Plan) -> bool:
        return fits(self.estimate(plan).peak, self.budget, self.accelerator)

    @property
    def target(self) -> float:
        """The highest peak that fits, the reserve kept."""
        return self.budget / (1 + reserve_fraction(self.accelerator))

    def limit(
        self,
        flag: str,
        plans: Callable[[int], Plan],
        values: Callable[[int], int],
        lo: int,
        hi: int,
        guess: int,
        why_last: str,
    ) -> Limit:
        index, _ = largest_fitting(lo, hi, lambda i: self.fits(plans(i)), guess)
        if index is None:
            return Limit(flag, None, None, values(lo), self.estimate(plans(lo)))
        above = (values(index + 1), self.estimate(plans(index + 1))) if index < hi else (None, None)
        return Limit(flag, values(index), self.estimate(plans(index)), *above, why_last=why_last)


def longest_sequence(searcher: Searcher, plan: Plan, context: int) -> Limit:
    """The longest ``--train.max_seq_length`` (a multiple of ``SEQUENCE_STEP``, or the whole ``context``) at which
    ``plan`` fits."""
    last = math.ceil(context / SEQUENCE_STEP)  # index i is i x SEQUENCE_STEP tokens, the last the whole context

    def length(i: int) -> int:
        return min(i * SEQUENCE_STEP, context)

    def at(i: int) -> Plan:
        return dataclasses.replace(plan, sequence_length=length(i))

    near = max(1, min(last, plan.sequence_length // SEQUENCE_STEP))
    half = max(1, near // 2)
    guess = (
        crossing(half, searcher.estimate(at(half)).peak, near, searcher.estimate(at(near)).peak, searcher.target)
        if half != near
        else near
    )
    guess = int(min(max(guess, 1), last))
    return searcher.limit(
        "--train.max_seq_length", at, length, 1, last, guess, f"the model's whole context ({context} tokens)"
    )


def largest_micro_batch(searcher: Searcher, plan: Plan, most: int = 4096) -> Limit:
    """The largest ``--train.micro_batch_size`` at which ``plan`` fits, the global batch kept where it allows (a
    micro-batch above a process's share of the global batch makes the global batch that micro-batch)."""
    per_rank = plan.micro_batch_size * plan.accumulation

    def at(m: int) -> Plan:
        return dataclasses.replace(plan, micro_batch_size=m, accumulation=max(1, per_rank // m))

    guess = crossing(1, searcher.estimate(at(1)).peak, 2, searcher.estimate(at(2)).peak, searcher.target)
    guess = int(min(max(guess, 1), most))
    return searcher.limit("--train.micro_batch_size", at, lambda m: m, 1, most, guess, f"the most tried ({most})")


def fewest_devices(searcher: Searcher, plan: Plan) -> Limit:
    """The fewest FSDP ``--devices`` (``DEVICE_COUNTS``) over which ``plan`` fits, the global batch kept: each rank's
    shard of the weights, gradients and optimizer state shrinks as devices are added, the activations do not."""
    global_batch = plan.micro_batch_size * plan.accumulation * plan.world_size

    def at(i: int) -> Plan:
        n = DEVICE_COUNTS[i]
        return dataclasses.replace(
            plan,
            strategy="fsdp",
            world_size=n,
            accumulation=max(1, global_batch // (plan.micro_batch_size * n)),
            fsdp_replicas=1,
        )

    # fewest devices: the largest index counted from the most devices down
    last = len(DEVICE_COUNTS) - 1
    index, _ = largest_fitting(0, last, lambda j: searcher.fits(at(last - j)), last - _first_guess(searcher, at))
    if index is None:
        return Limit("--devices", None, None, DEVICE_COUNTS[-1], searcher.estimate(at(last)))
    i = last - index
    below = (DEVICE_COUNTS[i - 1], searcher.estimate(at(i - 1))) if i > 0 else (None, None)
    return Limit("--devices", DEVICE_COUNTS[i], searcher.estimate(at(i)), *below, why_last="one device")


def _first_guess(searcher: Searcher, at: Callable[[int], Plan]) -> int:
    """The index of the first device count whose sharded state, from the one-rank and two-rank estimates, is
    predicted to fit: what shrinks with the devices is the difference of the two, twice over."""
    one, two = searcher.estimate(at(0)).peak, searcher.estimate(at(1)).peak
    sharded = 2 * (one - two)
    fixed = one - sharded
    for i, n in enumerate(DEVICE_COUNTS):
        if fixed + sharded / n <= searcher.target:
            return i
    return len(DEVICE_COUNTS) - 1


def fewest_checkpointed(searcher: Searcher, plan: Plan) -> Limit:
    """The fewest blocks checkpointed at which ``plan`` fits (``--activation_checkpointing N``; evenly spread): a
    block checkpointed keeps its input instead of its activations, so the peak falls about linearly in the count."""
    blocks = plan.blocks

    def at(j: int) -> Plan:  # j blocks not checkpointed
        return dataclasses.replace(plan, activation_checkpointing=blocks - j)

    none, every = searcher.estimate(at(blocks)).peak, searcher.estimate(at(0)).peak
    guess = crossing(0, every, blocks, none, searcher.target)
    guess = int(min(max(guess, 0), blocks))
    index, _ = largest_fitting(0, blocks, lambda j: searcher.fits(at(j)), guess)
    if index is None:
        return Limit("--activation_checkpointing", None, None, blocks, searcher.estimate(at(0)))
    count = blocks - index
    fewer = (count - 1, searcher.estimate(at(index + 1))) if count > 0 else (None, None)
    return Limit(
        "--activation_checkpointing", count, searcher.estimate(at(index)), *fewer, why_last="none checkpointed"
    )
