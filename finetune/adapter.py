"""LLaMA-Adapter fine-tuning (`python finetune/adapter.py --quantize bnb.nf4`): learned prompts, gated into the
upper layers' attention, train while the base stays frozen. Shared flags: memfit/settings.py, or --help."""

from dataclasses import replace

from litgpt.adapter import GPT, Block, Config, mark_only_adapter_as_trainable

from memfit.adapters import recompute_prefix_when_training
from memfit.args import ADAPTER_TRAIN, AdapterArgs, TrainArgs
from memfit.cli import CLI
from memfit.recipe import Method, model_config, run
from memfit.settings import resolve_settings


# v1 trains only the prompts and their zero-initialised gates (v2 adds a bias and scale on every linear layer),
# so its updates are smaller and it wants a larger step.
TRAIN = replace(ADAPTER_TRAIN, lr=6e-2, min_lr=6e-3)


def setup(adapter: AdapterArgs = AdapterArgs(), train: TrainArgs = TRAIN, **flags) -> None:
    """Fine-tune a model with LLaMA-Adapter (v1): only the prompts and their gates train."""
    settings = resolve_settings("adapter", train=train, hparams=locals(), **flags)
    method = Method(GPT, Block, model_config(settings, Config, **adapter.config_options()), "lit_model.pth.adapter",
                    mark_trainable=mark_only_adapter_as_trainable, prepare=recompute_prefix_when_training,
                    new_parameters=("adapter_wte", "gating_factor"))
    return run(settings, method)  # --estimate predicts; otherwise Fabric launches memfit.recipe.main on every process


if __name__ == "__main__":
    CLI(setup)
