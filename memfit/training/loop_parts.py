"""Small pieces of a training loop that every script uses the same way: the step counters a checkpoint restores, each
micro-batch's share of the loss, the gradient norm, the warm-up's length, and stopping before a non-finite loss or
gradient reaches the weights."""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake

from memfit.training.optim import float16_adamw


class TrainingDiverged(Exception):
    """A non-finite loss or gradient norm: the step is not taken and nothing more is saved."""


class Counters:
    """Progress that a checkpoint stores; ``load_state_dict`` makes Fabric restore it in place.

    A plain class on purpose: Fabric passes state through ``apply_to_collection``, which copies dataclasses, so a
    dataclass would be restored into a copy and the loop would go on counting from zero.
    """

    def __init__(self) -> None:
        self.step = self.tokens = 0
        """Optimizer steps taken; training tokens seen, over all ranks: the positions the model read, padding included
        (litgpt's count, its "Total Tokens (w/ Padding)"; a pretraining block counts its max_seq_length)"""

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        # a checkpoint may also hold an iter_num, which nothing reads
        self.step, self.tokens = state["step"], state["tokens"]


def gradient_scaler(fabric):
    """16-mixed's GradScaler (Fabric's precision plugin holds it; FSDP's is sharded), else None."""
    return getattr(getattr(getattr(fabric, "strategy", None), "precision", None), "scaler", None)


def loss_shares(fabric, counts: list[int], weighting: str) -> list[float]:
    """Each micro-batch's weight in the step's loss (``--train.loss_weighting``); over all ranks they sum to 1.

    ``counts``: the target tokens of this rank's micro-batches. ``tokens``: every target token of the step weighs the
    same, however prompts, masks and padding split them (as torchtune normalises): a micro-batch's share of the
    step's target tokens, over all ranks. ``micro_batches``: every micro-batch's mean loss weighs the same, as litgpt
    divides each by its accumulation (and DDP/FSDP average the ranks), so a micro-batch of short answers counts as
    much as one of long answers."""
    if weighting == "micro_batches":
        return [1 / (len(counts) * fabric.world_size)] * len(counts)
    step_targets = sum(counts)
    if fabric.world_size > 1:
        step_targets = int(fabric.all_reduce(torch.tensor(float(step_targets), device=fabric.device), reduce_op="sum"))
    return [count / max(step_targets, 1) for count in counts]


def gradient_norm(fabric, model: torch.nn.Module, optimizer) -> torch.Tensor:
    """The total gradient norm, when clipping (which computes it) is off: it is logged and checked for inf/NaN.
    Under 16-mixed the gradients are first unscaled, as clipping does (Fabric's precision plugin; the scaler's
    step then does not unscale them again): the scaled ones are 2**16 times larger at the start."""
    if gradient_scaler(fabric) is not None:
        fabric.strategy.precision.unscale_gradients(getattr(optimizer, "optimizer", optimizer))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:  # stepped inside backward (--optimizer_in_backward): the gradients are already gone
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads)


def stop_if_diverged(
    fabric, model: torch.nn.Module, optimizer, loss: torch.Tensor, norm: torch.Tensor, step: int
) -> None:
    """Raises ``TrainingDiverged`` (every rank together) before a non-finite loss or gradient norm, or a loss far
    worse than guessing, reaches the weights.

    ``step`` is the step being taken (from 1). Fake tensors (``--estimate``) hold no values: nothing to check. The
    scripts clip with ``error_if_nonfinite=False`` so that a non-finite norm is reported here, in one line (Fabric's
    default raises a RuntimeError in the clipping, which ended the run in a traceback).
    """
    if is_fake(loss) or is_fake(norm):
        return
    loss, norm = float(loss), float(norm)
    # A loss over three times a uniform guess's (ln of the vocabulary) after the first step: the weights predict far
    # worse than guessing, as steps that blew up leave them (16-true AdamW: 1059 on a 1,024-token vocabulary, all
    # finite). Training that works stays near or below ln(vocab) (the embedded adapters' base peaks at 1.5x); the
    # first step is left out: there a high loss is the checkpoint's or the data's, not training's.
    vocab = getattr(getattr(getattr(model, "module", model), "config", None), "padded_vocab_size", None)
    uniform = math.log(vocab) if vocab else math.inf
    exploded = step > 1 and math.isfinite(loss) and loss > 3 * uniform
    # Under 16-mixed a non-finite gradient with a finite loss is the gradient scaler's overflow: its step skips
    # the update and lowers the scale, as it is meant to (the first steps often do; its initial scale is 2**16).
    overflow = gradient_scaler(fabric) is not None and math.isfinite(loss)
    healthy = math.isfinite(loss) and (math.isfinite(norm) or overflow) and not exploded
    bad = torch.tensor(0.0 if healthy else 1.0, device=fabric.device)
    if fabric.world_size > 1:
        bad = fabric.all_reduce(bad, reduce_op="sum")
    if not bad:
        return
    if not math.isfinite(loss):
        what = f"non-finite loss {loss}"
    elif not math.isfinite(norm):
        what = f"non-finite gradient norm {norm}"
    elif exploded:
        what = f"loss {loss:.1f}, over 3x a uniform guess's (ln {vocab} = {uniform:.2f}),"
    else:  # this rank's step was sound; another's was not
        what = "another process's non-finite or exploded loss"
    broken = first_nonfinite(model)
    group = optimizer.param_groups[0]
    lr = group.get("initial_lr", group["lr"])  # the schedule's peak, --train.lr, not this step's warm-up value
    if broken and step == 1:  # no update has been made yet: the weights came so
        cause = f"the weights hold inf/NaN ({broken}): check the checkpoint"
    elif broken:  # the base was checked finite when it loaded: this run's updates made them so
        cause = (
            f"this run's updates made {broken} inf/NaN: likely --train.lr {lr} is too high (try a tenth of it) or"
            " --precision 16-true overflowed (try bf16-true)"
        )
    elif step == 1:
        cause = "the first step diverged: check the data and --precision (16-true overflows easily: try bf16-true)"
    elif float16_adamw(optimizer):
        eps = optimizer.param_groups[0]["eps"]
        cause = (
            f"AdamW's state is float16 (--precision 16-true), where its eps {eps:g} and small squared gradients"
            " are 0, so steps on small gradients blew up; use bf16-true, 16-mixed, or eps 1e-4 in --optimizer"
        )
    else:
        cause = (
            f"likely --train.lr {lr} is too high (try a tenth of it) or --precision 16-true overflowed"
            " (try bf16-true); --train.max_norm 1.0 clips gradient spikes"
        )
    raise TrainingDiverged(f"{what} at step {step}: {cause}")


def first_nonfinite(model: torch.nn.Module) -> str | None:
    model = getattr(model, "module", model)  # names as the checkpoint spells them, not Fabric's wrapper's
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not tensor.is_meta and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def warmup_steps(
    lr_warmup_steps: int | None, lr_warmup_fraction: float | None, steps_per_epoch: int, max_steps: int
) -> int:
    """Optimizer steps of linear warm-up: ``--train.lr_warmup_steps``, or ``--train.lr_warmup_fraction`` of an epoch
    (litgpt's meaning: its pretraining warms up over that fraction of the epoch's batches, at most the whole run)."""
    if lr_warmup_fraction:
        return min(max_steps, math.ceil(lr_warmup_fraction * steps_per_epoch))
    return lr_warmup_steps or 0
