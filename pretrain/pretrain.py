"""Pretraining from scratch on plain text, e.g. tiny-shakespeare:

    python pretrain/pretrain.py --checkpoint_dir DIR --data PlainText --data.path ../shared/data/tinyshakespeare.txt

The tokenizer (and, unless --model_name is given, the architecture) come from --checkpoint_dir; its weights are
not loaded. With nothing given, the embedded tiny Llama's architecture and tokenizer learn the embedded corpus.
The shared flags are documented in memfit/settings.py.
"""

from litgpt.model import GPT, Block, Config

from memfit.args import TrainArgs
from memfit.cli import CLI
from memfit.data import PlainText  # noqa: F401  (makes `--data PlainText` resolvable)
from memfit.loop import text_loss, text_targets
from memfit.recipe import Method, model_config, run
from memfit.settings import refuse_quantize, resolve_settings


# Sized for the embedded corpus (well under a minute on 2 CPU cores); real runs take theirs from recipes/.
TRAIN = TrainArgs(save_interval=50, global_batch_size=16, micro_batch_size=8, lr_warmup_steps=10, max_steps=100,
                  max_seq_length=128, lr=3e-3, min_lr=3e-4, max_norm=1.0)


def setup(train: TrainArgs = TRAIN, **flags) -> None:
    """Pretrain a model from scratch."""
    settings = resolve_settings("pretrain", train=train, hparams=locals(), **flags)
    refuse_quantize(settings)
    method = Method(GPT, Block, model_config(settings, Config), "lit_model.pth", from_scratch=True, loss_fn=text_loss,
                    targets_fn=text_targets)
    return run(settings, method)  # --estimate predicts; otherwise Fabric launches memfit.recipe.main on every process


if __name__ == "__main__":
    CLI(setup)
