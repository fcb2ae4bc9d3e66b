"""Next-token cross-entropy whose logits never exist whole.

The logits are the largest activation of a fine-tuning step with a large vocabulary: micro-batch 4 x 2048 tokens of
Llama-2's 32k vocabulary are 0.5 GiB in bf16, and Llama-3's 128k are 2 GiB. litgpt's recipes split the head into
chunks of 128 positions (``lm_head_chunk_size``), but every chunk is alive at once at the end of the forward pass,
Fabric's precision plugin returns each one cast to float32 (``convert_output``), and the cross-entropy saves a
float32 log-softmax of each for backward: about five times the bf16 logits at the forward peak.

Here the head and the loss run together inside the model's own forward (so Fabric's precision context, DDP and FSDP
see an ordinary forward), a chunk of tokens at a time under activation checkpointing: a chunk's logits are freed as
soon as its loss is computed, and recomputed in backward. What stays alive for backward is the final hidden state,
which the head's matmul kept anyway. A chunk's float32 logits are about the size of the hidden states (as Liger
Kernel's fused linear cross-entropy sizes them), and at least ``MIN_ROWS`` tokens so the matmuls stay large. The
price is one more head matmul per token in backward (2 x n_embd x vocab FLOPs: about 1% of a 7B LoRA step).
"""

from __future__ import annotations

from functools import partial

import torch
from litgpt.model import do_softcapping
from torch.utils.checkpoint import checkpoint

MIN_ROWS = 256
"""Fewest tokens in a chunk of the head"""


def rows_per_chunk(tokens: int, n_embd: int, vocab: int) -> int:
    """Tokens per chunk: the chunk's logits are about as large as the hidden states of all ``tokens``."""
    return max(MIN_ROWS, -(-tokens * n_embd // vocab))


def _chunk_loss(head_forward, softcap: float | None, ignore_index: int, hidden: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
    logits = head_forward(hidden)  # (rows, vocab)
    if softcap is not None:
        logits = do_softcapping(logits, softcap)
    # float32, as Fabric's output conversion gives the logits to litgpt's loss, but one chunk at a time
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="none")


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

    def head_loss(hidden: torch.Tensor) -> torch.Tensor:  # hidden: (B, T, n_embd), the final norm's output
        hidden = hidden[:, : targets.size(1)].reshape(-1, hidden.size(-1))  # (B * T', n_embd)
        rows = rows_per_chunk(hidden.size(0), hidden.size(1), config.padded_vocab_size)
        chunks = zip(hidden.split(rows), targets.reshape(-1).split(rows))
        if not torch.is_grad_enabled():  # validation: nothing is saved, so nothing to recompute
            return torch.cat([loss_of(h, t) for h, t in chunks])
        return torch.cat([checkpoint(loss_of, h, t, use_reentrant=False) for h, t in chunks])  # (B * T',)

    head.forward = head_loss
    config.final_logit_softcapping = None
    try:
        losses = model(input_ids)
    finally:
        del head.forward
        config.final_logit_softcapping = softcap
    counted = (targets != ignore_index).sum()
    return losses.sum() / counted.maximum(torch.ones_like(counted))  # no host sync for max(1, n)
