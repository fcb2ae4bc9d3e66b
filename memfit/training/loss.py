"""Next-token cross-entropy whose logits never exist whole.

The logits are the largest activation of a fine-tuning step with a large vocabulary: micro-batch 4 x 2048 tokens of
Llama-2's 32k vocabulary are 0.5 GiB in bf16, and Llama-3's 128k are 2 GiB. litgpt's recipes split the head into
chunks of 128 positions (``lm_head_chunk_size``), but every chunk is alive at once at the end of the forward pass,
Fabric's precision plugin returns each one cast to float32 (``convert_output``), and the cross-entropy saves a
float32 log-softmax of each for backward: more than twice the float32 logits at the forward peak.

Here the head and the loss run together inside the model's own forward (so Fabric's precision context, DDP and FSDP
see an ordinary forward), a chunk of tokens at a time; a chunk's logits are freed before the next chunk's exist. A
chunk's float32 logits are about the size of the hidden states (as Liger Kernel's fused linear cross-entropy sizes
them), and at least ``MIN_ROWS`` tokens so the matmuls stay large. Backward needs no logits either:

- a frozen head (LoRA, QLoRA, adapter): each chunk's gradient with respect to the hidden states is computed in the
  forward pass, right after its loss, and kept (the size of the hidden states); backward scales it. The FLOPs are
  those of the usual backward, moved earlier.
- a trained plain ``nn.Linear`` head (full fine-tuning, pretraining): the same, and each chunk's gradient with
  respect to the head's weight is added into one head-sized buffer in place (``addmm_``), the cross-entropy's
  gradient taken by hand in the chunk's own logits, as fused linear cross-entropy kernels (Liger Kernel's) do;
  backward hands the buffer to autograd, so the strategy receives it as it would any gradient of the weight (FSDP's
  unsharded parameter, DDP's hooks). Recomputing each chunk in backward instead held, at the backward peak, a
  head-sized gradient of the chunk being added to the sum and four chunk-sized buffers of autograd's cross-entropy
  (Llama-3.1-70B, FSDP on 8 GPUs with CPU offload, 2 x 2048 tokens: the estimate's peak 16.40 -> 12.47 GiB), and paid
  one more head matmul per token.
- any other trained head (adapter v2, LoRA on the head): each chunk runs under activation checkpointing and its
  logits are recomputed in backward, so ordinary autograd gives the head's parameters their gradients, whatever the
  module does with them. The price is one more head matmul per token (2 x n_embd x vocab FLOPs: under 1% of a 7B
  full fine-tuning step) and a head-sized gradient of each chunk while it is added to the others.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from litgpt.model import do_softcapping
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from memfit.trace_events import LOSS_RANGE

MIN_ROWS = 256
"""Fewest tokens in a chunk of the head"""
_chunks_run: int | None = None
"""The most chunks of the head a forward runs (``only_chunks``); None: every chunk"""


@contextmanager
def only_chunks(count: int):
    """Run only the first ``count`` chunks of a frozen head (their losses summed) while inside: for the estimate's fake
    step alone, whose planner and searches need the peaks only. Each whole chunk of a frozen head allocates and frees
    the same tensors into a gradient allocated whole before the first, so the first two meet the head's peak, while
    each costs a traced step about 15 operations (31 chunks at 8,192 tokens of Llama-3's vocabulary: a third of a
    shallow trace). The same holds for a plain trained head, whose weight's gradient is one buffer allocated before
    the first chunk, and for a validation's loss, which keeps only a running sum between chunks; a head recomputed in
    backward runs every chunk: backward holds the gradients of the chunks after the one it recomputes. A real run
    never enters it."""
    global _chunks_run
    _chunks_run = count
    try:
        yield
    finally:
        _chunks_run = None


def _starts(tokens: int, rows: int) -> list:
    """The first token of each chunk run. In a symbolic trace (``memfit.prediction``) ``tokens`` and ``rows`` are
    SymInts: the number of chunks becomes a guard, the token count stays a symbol (``range(0, tokens, rows)`` would
    fix it to the trace's own)."""
    count = -(-tokens // rows)  # (tokens + rows - 1) // rows
    if _chunks_run is not None and count >= _chunks_run:
        count = _chunks_run
    return [i * rows for i in range(int(count))]


def rows_per_chunk(tokens: int, n_embd: int, vocab: int) -> int:
    """Tokens per chunk: the chunk's logits are about as large as the hidden states of all ``tokens``."""
    return max(MIN_ROWS, -(-tokens * n_embd // vocab))


def _chunk_loss(
    head_forward, softcap: float | None, ignore_index: int, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The summed cross-entropy of one chunk: hidden (rows, n_embd), targets (rows,). Inside the loss's profiler range
    (``LOSS_RANGE``), so the ledger names its logits and log-softmax, here and where backward computes it again."""
    with record_function(LOSS_RANGE):
        logits = head_forward(hidden)  # (rows, vocab)
        if softcap is not None:
            logits = do_softcapping(logits, softcap)
        # float32, as Fabric's output conversion gives the logits to litgpt's loss, but one chunk at a time
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


class _FrozenHeadLoss(torch.autograd.Function):
    """The summed loss over all chunks of a head that does not train; each chunk's gradient with respect to its hidden
    states is computed right after its loss, so backward holds no logits and recomputes nothing."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, loss_of, rows: int) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden)  # (N, n_embd)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in _starts(hidden.size(0), rows):
            chunk = hidden[start : start + rows].detach().requires_grad_()
            with torch.enable_grad():
                loss = loss_of(chunk, targets[start : start + rows])
            (grad_hidden[start : start + rows],) = torch.autograd.grad(loss, chunk)
            total += loss.detach()
        ctx.save_for_backward(grad_hidden)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None


def _add_chunk_gradients(
    chunk, targets, weight, bias, softcap, ignore_index, grad_chunk, grad_weight, grad_bias
) -> torch.Tensor:
    """One chunk of a trained linear head: writes its hidden states' gradient into ``grad_chunk`` (rows, n_embd), adds
    its weight's (and bias's) into ``grad_weight`` (``grad_bias``), and returns its summed loss.

    The cross-entropy's gradient (softmax less the target's one-hot) is taken by hand, in place in one float32 buffer
    the size of the chunk's logits (two with soft-capping), as fused linear cross-entropy kernels do: autograd's held
    the logits, their log-softmax, the loss's gradient with respect to it and the logits' gradient at once, four
    such buffers, which made the chunks' share of the step larger than the weight gradient they save."""
    logits = torch.nn.functional.linear(chunk, weight, bias)  # (rows, vocab)
    compute_dtype = logits.dtype  # autocast's under bf16-mixed
    capped = None
    if softcap is not None:  # litgpt's do_softcapping, in the logits' dtype; its derivative is 1 - tanh^2
        capped = logits.div_(softcap).tanh_()
        logits = capped * softcap
    z = logits.float()  # the logits themselves where they are float32
    del logits
    keep = targets != ignore_index  # (rows,)
    picked = targets.where(keep, 0)[:, None]  # (rows, 1): a valid index where the target is ignored
    target_logit = z.gather(1, picked).squeeze(1)  # (rows,)
    top = z.amax(1, keepdim=True)  # (rows, 1)
    sums = z.sub_(top).exp_().sum(1, keepdim=True)  # z is now exp(z - top)
    loss = ((sums.log() + top).squeeze(1) - target_logit).where(keep, 0).sum()
    z.div_(sums)  # the softmax
    z.scatter_add_(1, picked, torch.full_like(target_logit[:, None], -1.0))  # less the target's one-hot
    z.mul_(keep[:, None])  # an ignored target's row has no gradient
    if capped is not None:
        z.mul_(capped.square_().neg_().add_(1))  # float32 times the logits' dtype
        del capped
    grad_logits = z.to(compute_dtype)  # as autograd hands it to the head's matmuls
    del z
    grad_chunk.copy_(grad_logits @ weight)  # (rows, n_embd); autocast casts the weight as in forward
    # autocast leaves in-place ops alone: the operands take the buffer's dtype
    grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), chunk.to(grad_weight.dtype))
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0).to(grad_bias.dtype)
    return loss


class _TrainedLinearHeadLoss(torch.autograd.Function):
    """The summed loss over all chunks of a trained ``nn.Linear`` head: each chunk's gradients with respect to its
    hidden states and to the head's weight (and bias) are computed right after its loss, the weight's added into one
    buffer in place, so backward holds no logits, recomputes nothing, and no chunk's weight gradient exists apart from
    the sum."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, softcap, ignore_index, rows):
        grad_hidden = torch.empty_like(hidden)  # (N, n_embd)
        grad_weight = torch.zeros_like(weight)  # (vocab, n_embd)
        grad_bias = torch.zeros_like(bias) if ctx.needs_input_grad[2] else None  # (vocab,)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in _starts(hidden.size(0), rows):
            # a function per chunk: its logits and their gradient are gone before the next chunk's exist
            total += _add_chunk_gradients(
                hidden[start : start + rows],
                targets[start : start + rows],
                weight,
                bias,
                softcap,
                ignore_index,
                grad_hidden[start : start + rows],
                grad_weight,
                grad_bias,
            )
        ctx.save_for_backward(grad_hidden)
        # kept off save_for_backward: handed back as the only reference, autograd takes the buffer as the weight's
        # gradient instead of copying it
        ctx.grad_weight, ctx.grad_bias = grad_weight, grad_bias
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        grad_weight, grad_bias = ctx.grad_weight, ctx.grad_bias
        ctx.grad_weight = ctx.grad_bias = None
        grad_weight.mul_(grad_total.to(grad_weight.dtype))
        if grad_bias is not None:
            grad_bias.mul_(grad_total.to(grad_bias.dtype))
        return grad_hidden * grad_total.to(grad_hidden.dtype), grad_weight, grad_bias, None, None, None, None


def _plain_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes as ``nn.Linear`` does. Not ``type(module) is nn.Linear``: FSDP2's ``fully_shard``
    gives a unit a class of its own (``FSDPLinear``, a subclass with the same forward), and the head trained under
    FSDP then took the recomputing path (measured on 2 CPU ranks, pythia-14m's 50k-token head: 98.25 MiB of
    recomputed logits and their gradient at the backward peak, none with this path). A quantized or LoRA layer has
    a forward of its own."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def next_token_loss(model, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The mean cross-entropy over the targets that are not ``ignore_index``.

    ``model`` is a litgpt ``GPT``, bare or wrapped by Fabric; ``input_ids`` is (B, T) and ``targets`` (B, T') with
    T' <= T: position t's logits are scored against ``targets[:, t]``.
    """
    # litgpt's GPT.forward has no switch to leave out its head (torchtune's models have ``skip_output_layer``), so for
    # this one call the head's forward is replaced by the loss, and the final soft-capping (Gemma 2), which
    # GPT.forward applies after the head, moves into it.
    head, config = model.lm_head, model.config
    softcap = config.final_logit_softcapping
    loss_of = partial(_chunk_loss, type(head).forward.__get__(head), softcap, ignore_index)
    head_trains = any(p.requires_grad for p in head.parameters())

    def head_loss(hidden: torch.Tensor) -> torch.Tensor:  # hidden: (B, T, n_embd), the final norm's output
        with record_function(LOSS_RANGE):  # what the head's loss makes, its chunks' gradients too: the ledger's "loss"
            return chunked_loss(hidden)

    def chunked_loss(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, : targets.size(1)].reshape(-1, hidden.size(-1))  # (N, n_embd), N = B * T'
        flat_targets = targets.reshape(-1)
        rows = rows_per_chunk(hidden.size(0), hidden.size(1), config.padded_vocab_size)
        backward_follows = torch.is_grad_enabled() and hidden.requires_grad  # not in validation
        if backward_follows and not head_trains:
            return _FrozenHeadLoss.apply(hidden, flat_targets, loss_of, rows)
        if backward_follows and _plain_linear(head) and head.weight.requires_grad:
            # the weight as the head holds it now: FSDP's unsharded parameter inside the forward
            return _TrainedLinearHeadLoss.apply(
                hidden, head.weight, head.bias, flat_targets, softcap, ignore_index, rows
            )
        # samples of one token have no target: the sum starts from a zero that backward accepts
        total = torch.zeros((), dtype=torch.float32, device=hidden.device, requires_grad=backward_follows)
        for start in _starts(hidden.size(0), rows):
            h, t = hidden[start : start + rows], flat_targets[start : start + rows]  # (rows, n_embd), (rows,)
            # without backward nothing is saved, so nothing needs recomputing
            total = total + (checkpoint(loss_of, h, t, use_reentrant=False) if backward_follows else loss_of(h, t))
        return total

    head.forward = head_loss
    config.final_logit_softcapping = None
    try:
        total = model(input_ids)  # the summed loss, a 0-dim float32 tensor
    finally:
        del head.forward
        config.final_logit_softcapping = softcap
    counted = (targets != ignore_index).sum()
    return total / counted.maximum(torch.ones_like(counted))  # no host sync for max(1, n)
