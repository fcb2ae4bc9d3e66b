"""The sample a run generates after each validation (``--eval.max_new_tokens``), as litgpt's scripts print one."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from functools import partial

import torch

from memfit.errors import UserError

TEXT_PROMPT_TOKENS = 16
"""Plain text's sample starts from this many tokens of a validation block"""


def sample_prompt(data, tokenizer, evaluate_example, seed: int) -> torch.Tensor:
    """The prompt litgpt's scripts generate from: a validation record in the data's prompt template (instruction
    data), or the start of a validation block (plain text). ``evaluate_example``: first, random, or an index; as in
    litgpt, an index past the validation set is the training sample of that index."""
    dataset = data.val_dataloader().dataset
    count = len(dataset)
    index = {"first": 0, "random": int(torch.randint(count, (1,), generator=torch.Generator().manual_seed(seed)))}.get(
        evaluate_example, evaluate_example
    )
    index = int(index)
    if index >= count:
        dataset = data.train_dataloader().dataset
        if index >= len(dataset):
            raise UserError(
                f"--eval.evaluate_example {index} is past both the validation set ({count} samples) and"
                f" the training set ({len(dataset)}); give an index below {max(count, len(dataset))}"
            )
    records = getattr(dataset, "data", None)
    if records is not None and getattr(data, "prompt_style", None) is not None:
        record = records[index]
        return tokenizer.encode(data.prompt_style.apply(prompt=record["instruction"], **record))
    return dataset[index]["input_ids"][:TEXT_PROMPT_TOKENS]


def generate_sample(
    fabric, model, tokenizer, prompt: torch.Tensor | None, max_new_tokens: int, step: int, phases=None
) -> str | None:
    """Generates ``max_new_tokens`` tokens from ``prompt`` and prints them; ``phases(name)``: the run's phase measure
    (``memfit.settings.instruments.Instruments.phase``), around the generation.

    Sampling draws random numbers: it runs on a forked RNG, so a run with samples trains exactly as one without.
    """
    if prompt is None or not max_new_tokens:
        return None
    from litgpt.generate.base import generate  # litgpt's sampler, imported only by runs that generate

    prompt = prompt.to(fabric.device)
    gpt = next(m for m in model.modules() if hasattr(m, "rope_cache"))  # litgpt's GPT, under Fabric's (FSDP's) wrappers
    max_returned_tokens = len(prompt) + max_new_tokens
    if max_returned_tokens > gpt.config.block_size:
        fabric.print(
            f"Sample skipped: {len(prompt)} prompt + {max_new_tokens} new tokens exceed the model's context"
            f" ({gpt.config.block_size} tokens)"
        )
        return None
    devices = [fabric.device] if fabric.device.type == "cuda" else []
    measured = phases("generation") if phases is not None else nullcontext()
    with measured, torch.random.fork_rng(devices=devices), torch.no_grad():
        with kv_cached(model, max_returned_tokens, fabric.init_tensor):
            output = generate(model, prompt, max_returned_tokens, temperature=0.8, eos_id=tokenizer.eos_id)
    text = tokenizer.decode(output[len(prompt) :])
    fabric.print(f"Sample after step {step}: {text!r}")
    return text


@contextmanager
def kv_cached(model, length: int, init_tensor=nullcontext):
    """``model`` (litgpt's GPT, or a wrapper that forwards to it) ready to generate up to ``length`` tokens, as
    litgpt's generation expects it, and back as training left it after: what a run's sample does, and what the
    estimate traces of it (``memfit.prediction.fake_step``). ``init_tensor``: where the cache is made (Fabric's
    ``init_tensor``: the precision's dtype, the device)."""
    gpt = next(m for m in model.modules() if hasattr(m, "rope_cache"))
    trained_length, cos, sin = gpt.max_seq_length, gpt.cos, gpt.sin
    model.eval()
    try:
        # Training sizes the rope cache for its longest sample; the sample may run longer, up to the context.
        gpt.max_seq_length = max(trained_length, length)
        with init_tensor():
            model.set_kv_cache(batch_size=1)  # keys and values of every block, for the whole length, and its mask
        yield
    finally:
        model.clear_kv_cache()
        # training's own rope tensors back (recomputed ones would be float32 where training's are in the model's
        # dtype); with them in place, the length's setter has nothing to recompute
        gpt.cos, gpt.sin = cos, sin
        gpt.max_seq_length = trained_length
        model.train()


def run_sampler(fabric, run, model, tokenizer, val_loader, phases=None) -> Callable[..., str | None]:
    """``sample(step=N)``: the run's sample after a validation, from the prompt ``--eval.evaluate_example`` picks (None
    where ``--eval.max_new_tokens`` is 0 or there is no validation data), measured as the "generation" phase by
    ``phases``. ``run``: a ``memfit.settings.run.Run``."""
    prompt = None
    if run.eval.max_new_tokens and val_loader is not None:
        prompt = sample_prompt(run.data, tokenizer, run.eval.evaluate_example, run.seed)
    return partial(
        generate_sample,
        fabric,
        model=model,
        tokenizer=tokenizer,
        prompt=prompt,
        max_new_tokens=run.eval.max_new_tokens,
        phases=phases,
    )
