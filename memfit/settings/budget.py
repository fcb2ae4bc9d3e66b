"""A memory budget (``--memory_budget``): a size, or a GPU card by the name it is sold under.

A card sold as "24 GB" has 24 GiB (nvidia-smi's total is in MiB), so ``--memory_budget 24GB`` read as 10^9 bytes
plans for 22.35 GiB, 1.65 GiB stricter than the card. A budget may name the card instead (``--memory_budget H100``),
and an estimate says which of the common cards its peak fits.
"""

from __future__ import annotations

import re

from memfit.errors import UserError
from memfit.units import fmt_bytes

CARDS_MIB = {
    "T4": 15360,
    "V100-16GB": 16384,
    "A10G": 23028,
    "L4": 23034,
    "3090": 24576,
    "4090": 24564,
    "V100-32GB": 32768,
    "A100-40GB": 40960,
    "L40S": 46068,
    "A6000": 49140,
    "A100-80GB": 81920,
    "H100": 81559,
    "H200": 143771,
}
"""The total nvidia-smi (and ``torch.cuda.mem_get_info``) reports for each card, in MiB: the H100's and H200's read
on the machines lent to this project, the others as their nvidia-smi reports them"""

COMMON_CARDS = ("4090", "A100-40GB", "L40S", "H100", "H200")
"""The sizes people rent and own: 24, 40, 48, 80 and 141 GB"""

_ALIASES = {"RTX4090": "4090", "RTX3090": "3090", "A100": "A100-80GB", "H100-80GB": "H100", "RTXA6000": "A6000"}


CUDA_CONTEXT_BYTES = 512 * 2**20
"""What the CUDA context takes on a card before the run's first tensor: a card's memory less it is what a run has"""


ALLOCATOR_RESERVE = 0.10
"""What the CUDA caching allocator reserves above the allocated peak (``max_memory_reserved`` over
``max_memory_allocated``), which the device must hold too: measured 1.044 for Memfit's 7B QLoRA and 1.060 for
litgpt's on an H100 (profiles/gpu/h100/call4/compare_litgpt.json), more where allocations fragment. Every plan, row
and reverse answer keeps this share free; a CPU run's tensors come from the heap, with no reserve of its own."""


def reserve_fraction(accelerator: str) -> float:
    return 0.0 if accelerator == "cpu" else ALLOCATOR_RESERVE


def fits(peak: int, budget: int, accelerator: str) -> bool:
    """Whether a predicted allocated peak fits ``budget`` with the allocator's reserve (``ALLOCATOR_RESERVE``) beside
    it: the one test every row of the planner and every reverse answer uses."""
    return peak * (1 + reserve_fraction(accelerator)) <= budget


def reserve_note(accelerator: str) -> str:
    """How a budget is applied, said once above the rows and answers that use it."""
    if accelerator == "cpu":
        return "against the CPU ledger's tensor peak"
    return f"with {ALLOCATOR_RESERVE:.0%} of the peak kept for the CUDA caching allocator's reserve"


def usable_bytes(card: str) -> int:
    """What a training process's tensors can take: the card less its CUDA context."""
    return CARDS_MIB[card] * 2**20 - CUDA_CONTEXT_BYTES


def card_named(text: str) -> str | None:
    """The card ``text`` names (case and a "-" or space aside), or None."""
    key = text.strip().upper().replace(" ", "").replace("_", "-")
    key = _ALIASES.get(key.replace("-", ""), _ALIASES.get(key, key))
    return next((card for card in CARDS_MIB if card.upper() == key), None)


def cards_that_fit(peak: int) -> list[str]:
    """The common cards whose usable memory holds ``peak`` bytes and the allocator's reserve, smallest first."""
    return [card for card in COMMON_CARDS if fits(peak, usable_bytes(card), "cuda")]


_UNITS = {
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


MOST_BUDGET_BYTES = 2**60
"""A budget past any machine (1 EiB): a typo, refused before any estimate"""


def parse_budget(text: str) -> int:
    """Bytes: ``24GiB``, ``24GB`` (10^9 bytes each: say so with ``budget_note``), or a card's name (``H100``, what
    it leaves a training process)."""
    if (card := card_named(text or "")) is not None:
        return usable_bytes(card)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if match and not match.group(2):  # 16 read as 16 bytes planned for 35 s, then "nothing fits 16 B"
        raise UserError(
            f"--memory_budget {text!r} has no unit; write it like 24GiB, 80GB or 512MiB (units: B, KB,"
            " KiB, MB, MiB, GB, GiB, TB, TiB), or name a card: " + ", ".join(CARDS_MIB)
        )
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(
            f"--memory_budget {text!r} is not a size or a card; write it like 24GiB, 80GB or 512MiB, or name a card:"
            " " + ", ".join(CARDS_MIB)
        )
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not size < MOST_BUDGET_BYTES:  # also a number float() reads as infinity (400 digits)
        raise UserError(
            f"--memory_budget {text[:40]!r}{'...' if len(text) > 40 else ''} is past any machine (over"
            f" {fmt_bytes(MOST_BUDGET_BYTES)}); give a card's memory, like 80GiB, or name a card"
        )
    return int(size)


def budget_note(text: str) -> str | None:
    """One line saying how the budget was read, where a user may have meant something else: a card's name, or a
    size in GB (10^9 bytes, while cards sold as "N GB" have N GiB)."""
    if (card := card_named(text)) is not None:
        return (
            f"--memory_budget {text}: {fmt_bytes(usable_bytes(card))}, the {card}'s {CARDS_MIB[card]:,} MiB less"
            f" {fmt_bytes(CUDA_CONTEXT_BYTES)} of CUDA context"
        )
    unit = re.sub(r"[0-9.\s]", "", text).lower()
    exponent = {"m": 6, "g": 9, "t": 12}.get(unit[:1])
    if unit not in ("mb", "m", "gb", "g", "tb", "t"):
        return None
    number, binary = text.strip()[: -len(unit)].strip(), f"{unit[0].upper()}iB"
    return (
        f"--memory_budget {text} is {fmt_bytes(parse_budget(text))} ({unit.upper()} = 10^{exponent} bytes); a card sold"
        f" as {number} {unit[0].upper()}B has {number} {binary}: write {number}{binary}, or the card's name"
        f" ({', '.join(COMMON_CARDS)}, ...)"
    )


def fit_answer(peak: int, budget: int, budget_text: str, accelerator: str) -> str:
    """The straight answer to "do these settings fit?", said before any plan: yes or no, the predicted peak against
    the budget, and what the allocator's reserve adds on a GPU."""
    card = card_named(budget_text or "")
    where = f"the {card} ({fmt_bytes(budget)} for a training process)" if card else fmt_bytes(budget)
    reserve = reserve_fraction(accelerator)
    needed = round(peak * (1 + reserve))
    with_reserve = f", {fmt_bytes(needed)} with the allocator's reserve" if reserve else ""
    if fits(peak, budget, accelerator):
        return (
            f"Do these settings fit {where}? Yes: {fmt_bytes(peak)} predicted{with_reserve}, {fmt_bytes(budget - needed)}"
            " to spare."
        )
    return (
        f"Do these settings fit {where}? No: {fmt_bytes(peak)} predicted{with_reserve}, {fmt_bytes(needed - budget)}"
        " too much."
    )
