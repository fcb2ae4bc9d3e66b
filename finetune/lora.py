"""LoRA fine-tuning; with --quantize, QLoRA (a frozen 4-bit base with trainable low-rank adapters).

    python finetune/lora.py --precision bf16-true --quantize bnb.nf4

With no --checkpoint_dir it trains the embedded default (a tiny Llama generated locally), so it works offline.
The shared flags (--precision, --quantize, --data, --strategy, ...) are documented in memfit/settings.py and
listed by --help.
"""

from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

from memfit.args import TrainArgs
from memfit.cli import CLI
from memfit.recipe import Method, model_config, run
from memfit.settings import resolve_settings

# Sized for the embedded default (about a minute on 2 CPU cores); real models take theirs from recipes/.
TRAIN = TrainArgs(save_interval=40, global_batch_size=8, micro_batch_size=4, lr_warmup_steps=8, max_steps=80, lr=3e-3, min_lr=3e-4)


def setup(
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    train: TrainArgs = TRAIN,
    **flags,
) -> None:
    """Fine-tune a model with LoRA; with --quantize, QLoRA.

    Args:
        lora_r: The LoRA rank.
        lora_alpha: The LoRA alpha (the update is scaled by alpha / r).
        lora_dropout: Dropout on the LoRA input.
        lora_query: Apply LoRA to the attention query projection.
        lora_key: Apply LoRA to the attention key projection.
        lora_value: Apply LoRA to the attention value projection.
        lora_projection: Apply LoRA to the attention output projection.
        lora_mlp: Apply LoRA to the MLP.
        lora_head: Apply LoRA to the output head.
    """
    settings = resolve_settings("lora", train=train, hparams=locals(), **flags)
    lora = {name: value for name, value in locals().items() if name.startswith("lora_")}
    method = Method(
        GPT, Block, model_config(settings, Config, **lora),
        weights_file="lit_model.pth.lora",  # litgpt's name: `litgpt merge_lora` reads it
        mark_trainable=mark_only_lora_as_trainable,
        new_parameters=("lora_A", "lora_B"),
    )
    return run(settings, method)  # --estimate predicts; otherwise Fabric launches memfit.recipe.main on every process


if __name__ == "__main__":
    CLI(setup)
