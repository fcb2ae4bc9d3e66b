"""Checkpoint dirs of real architectures with random weights: a run's memory and speed rehearsed where the weights
cannot be downloaded (an air-gapped machine, a lent GPU, the tests), since neither depends on their values; and the
small model of an architecture that the config hub's short runs train.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from litgpt import Config

from memfit.training.embedded import ensure_embedded


def write_random_checkpoint(
    model_name: str | Config,
    directory: Path,
    dtype: torch.dtype = torch.bfloat16,
    **overrides,
) -> Path:
    """A litgpt checkpoint dir for a real architecture (``Config.from_name``, or a ``Config`` as it is) with random
    weights.

    For GPU tests and benchmarks, where weights cannot be downloaded: memory and speed do not depend on the values.
    The whole state is made in host memory before it is saved (13.5 GB for a 7B model in bf16). The embedded
    tokenizer is copied in (its ids fit any vocabulary) so the dir is complete. ``lit_model.pth`` is written under
    another name and renamed, so a dir that has one holds a complete checkpoint and can be reused
    (``random_checkpoint``).
    """
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = overrides.pop("name", None)  # a changed architecture gets its own name (from_name takes no ``name``)
    config = model_name if isinstance(model_name, Config) else Config.from_name(model_name, **overrides)
    config.name = name or config.name
    save_config(config, directory)
    embedded_checkpoint, _ = ensure_embedded()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(embedded_checkpoint / name, directory / name)
    with torch.device("meta"):
        shapes = {k: (v.shape, v.is_floating_point()) for k, v in GPT(config).state_dict().items()}
    # drawn on the GPU where there is one: a 7B model's 6.7e9 normal draws took minutes on the CPU, which a lent
    # GPU's session cannot spare (the values differ between the two, which no memory or speed figure depends on)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(0)
    state = {}
    for key, (shape, floating) in shapes.items():
        tensor = torch.empty(shape, dtype=dtype if floating else torch.long, device=device)
        if floating and key.endswith("weight") and len(shape) > 1:  # embeddings and linear layers
            tensor.normal_(0.0, 0.02, generator=generator)
        elif floating:
            # a 1-D weight is a norm's scale (the blocks' norm_1/norm_2 and the final ln_f): 1, as a trained model's
            # are near; a zero scale would zero the logits and every gradient
            tensor.fill_(1.0 if key.endswith("weight") else 0.0)
        else:
            tensor.zero_()
        state[key] = tensor.cpu()
    partial = directory / "lit_model.pth.partial"
    torch.save(state, partial)
    partial.rename(directory / "lit_model.pth")
    return directory


def random_checkpoint(model_name: str, parent: Path, **overrides) -> Path:
    """``parent/<name>``: made by ``write_random_checkpoint`` unless a complete one is already there, so benchmarks
    run one after another (``--checkpoints``) write a 7B checkpoint once."""
    directory = Path(parent) / overrides.get("name", model_name)
    if not (directory / "lit_model.pth").is_file():
        write_random_checkpoint(model_name, directory, **overrides)
    return directory


def same_architecture_small(config: Config, vocab_size: int = 1024) -> dict:
    """The fields that turn a litgpt ``Config`` into a few-million-parameter model of the same architecture: two
    blocks, four heads of 16 (grouped-query attention kept as it is: multi-head, multi-query or grouped), a 128-wide
    MLP, the embedded tokenizer's vocabulary. Everything else (MLP and norm classes, rotary fraction, sliding windows,
    soft-capping, parallel residual, biases, block size) stays as the architecture has it.

    For running a real recipe of a model too big for the machine with only the checkpoint swapped (the config hub's
    short runs): the code path is the architecture's, the arithmetic a CPU can do in seconds."""
    n_head = 4
    if config.n_query_groups == config.n_head:
        groups = n_head
    elif config.n_query_groups == 1:
        groups = 1
    else:
        groups = 2
    return dict(
        n_layer=2,
        n_head=n_head,
        n_query_groups=groups,
        head_size=16,
        n_embd=64,
        intermediate_size=128,
        vocab_size=vocab_size,
        padded_vocab_size=vocab_size,
    )
