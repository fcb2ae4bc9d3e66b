"""Full fine-tuning: every weight trains. The heaviest method: weights, gradients and two AdamW moments per
parameter; use --strategy fsdp --fsdp.cpu_offload true, --activation_checkpointing or --optimizer AdamW8bit.

    python finetune/full.py --precision bf16-true

The shared flags (--precision, --data, --strategy, ...) are documented in memfit/settings.py.
"""

from litgpt.model import GPT, Block, Config

from memfit.args import TrainArgs
from memfit.cli import CLI
from memfit.recipe import Method, model_config, run
from memfit.settings import refuse_quantize, resolve_settings


# Sized for the embedded default (about a minute on 2 CPU cores); real models take theirs from recipes/.
TRAIN = TrainArgs(save_interval=40, global_batch_size=8, micro_batch_size=4, lr_warmup_steps=8, max_steps=60, lr=1e-3, min_lr=1e-4)


def setup(train: TrainArgs = TRAIN, **flags) -> None:
    """Fine-tune every weight of a model."""
    settings = resolve_settings("full", train=train, hparams=locals(), **flags)
    refuse_quantize(settings)
    method = Method(GPT, Block, model_config(settings, Config), "lit_model.pth")
    return run(settings, method)  # --estimate predicts; otherwise Fabric launches memfit.recipe.main on every process


if __name__ == "__main__":
    CLI(setup)
