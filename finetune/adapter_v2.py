"""LLaMA-Adapter v2 fine-tuning (`python finetune/adapter_v2.py --quantize bnb.nf4`): v1's gated prompts plus a
learned bias and scale on every linear layer. Shared flags: memfit/settings.py, or --help."""

from litgpt.adapter_v2 import GPT, Block, Config, mark_only_adapter_v2_as_trainable

from memfit.adapters import recompute_prefix_when_training
from memfit.args import ADAPTER_TRAIN, AdapterArgs, TrainArgs
from memfit.cli import CLI
from memfit.recipe import Method, model_config, run
from memfit.settings import resolve_settings


def setup(adapter: AdapterArgs = AdapterArgs(), train: TrainArgs = ADAPTER_TRAIN, **flags) -> None:
    """Fine-tune a model with LLaMA-Adapter v2: prompts, gates, and per-layer bias and scale train."""
    settings = resolve_settings("adapter_v2", train=train, hparams=locals(), **flags)
    config = model_config(settings, Config, **adapter.config_options())
    method = Method(GPT, Block, config, "lit_model.pth.adapter_v2", mark_only_adapter_v2_as_trainable,
                    prepare=recompute_prefix_when_training,
                    new_parameters=("adapter_wte", "gating_factor", "adapter_bias", "adapter_scale"))
    return run(settings, method)  # --estimate predicts; otherwise Fabric launches memfit.recipe.main on every process


if __name__ == "__main__":
    CLI(setup)
