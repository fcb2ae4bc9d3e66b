"""LoRA fine-tuning; with --quantize, QLoRA (a frozen 4-bit base with trainable low-rank adapters).

    python finetune/lora.py --precision bf16-true --quantize bnb.nf4

With no --checkpoint_dir it trains the embedded default (a tiny Llama generated locally) so the run works offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from litgpt.data import DataModule
from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

from memfit.args import EvalArgs, LoggerChoice, OptimizerChoice, TrainArgs
from memfit.cli import CLI
from memfit.loading import load_model
from memfit.loop import CheckpointSpec, sft_loss
from memfit.precision import PrecisionChoice, QuantizeChoice
from memfit.profiling import ProfileArgs
from memfit.recipe import Settings, make_fabric, train


def setup(
    checkpoint_dir: Path | None = None,
    out_dir: Path = Path("out/finetune/lora"),
    precision: PrecisionChoice | None = None,
    quantize: QuantizeChoice | None = None,
    accelerator: Literal["auto", "cpu", "cuda", "gpu"] = "auto",
    devices: int = 1,
    num_nodes: int = 1,
    lora_r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.05,
    lora_query: bool = True,
    lora_key: bool = False,
    lora_value: bool = True,
    lora_projection: bool = False,
    lora_mlp: bool = False,
    lora_head: bool = False,
    data: DataModule | None = None,
    train: TrainArgs = TrainArgs(
        save_interval=40, log_interval=1, global_batch_size=8, micro_batch_size=4,
        lr_warmup_steps=8, max_steps=80, lr=3e-3, min_lr=3e-4,
    ),
    eval: EvalArgs = EvalArgs(interval=40, max_iters=20),
    optimizer: OptimizerChoice = "AdamW",
    logger_name: LoggerChoice = "tensorboard",
    profile: ProfileArgs = ProfileArgs(),
    profile_dir: Path = Path("profiles"),
    resume: bool = False,
    seed: int = 1337,
) -> None:
    """Fine-tune a model with LoRA; with --quantize, QLoRA.

    Arguments:
        checkpoint_dir: A litgpt checkpoint dir (lit_model.pth, model_config.yaml, tokenizer). Default: the embedded
            tiny Llama and its instruction dataset, generated locally.
        out_dir: Where checkpoints go (step-*/ and final/).
        precision: Fabric precision: 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true. Default: bf16-true on a
            GPU that supports it, else 32-true.
        quantize: Quantize the frozen base with bitsandbytes (works on CPU too).
        accelerator: cpu, cuda (gpu) or auto (the GPU when present).
        devices: Devices (processes) per node.
        num_nodes: Nodes.
        lora_r: The LoRA rank.
        lora_alpha: The LoRA alpha (the update is scaled by alpha / r).
        lora_dropout: Dropout on the LoRA input.
        lora_query: Apply LoRA to the attention query projection.
        lora_key: Apply LoRA to the attention key projection.
        lora_value: Apply LoRA to the attention value projection.
        lora_projection: Apply LoRA to the attention output projection.
        lora_mlp: Apply LoRA to the MLP.
        lora_head: Apply LoRA to the output head.
        data: A litgpt DataModule, e.g. ``--data JSON --data.json_path FILE --data.val_split_fraction 0.1``.
            Default: the embedded instruction dataset (needs no --checkpoint_dir).
        train: Training settings (batch sizes, steps, learning rate and schedule, clipping, intervals).
        eval: Validation settings.
        optimizer: AdamW (fused where supported), SGD, or bitsandbytes AdamW8bit, PagedAdamW, PagedAdamW8bit.
        logger_name: Where per-step scalars go: tensorboard or csv (in the run's profile dir).
        profile: The memory-profiler window, counted in optimizer steps.
        profile_dir: Where each run's profile dir (trace, scalars, summary) is created.
        resume: Continue from the latest step-* checkpoint in out_dir.
        seed: Random seed.
    """
    settings = Settings.from_setup(locals(), script="lora")
    config = Config.from_file(
        settings.checkpoint_dir / "model_config.yaml",
        lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        lora_query=lora_query, lora_key=lora_key, lora_value=lora_value,
        lora_projection=lora_projection, lora_mlp=lora_mlp, lora_head=lora_head,
    )
    fabric = make_fabric(settings)
    fabric.launch(main, settings, config)


def main(fabric, settings: Settings, config: Config) -> None:
    def build_model():
        model = load_model(
            GPT, config, settings.checkpoint_dir / "lit_model.pth",
            dtype=settings.dtype, device=fabric.device, quantize=settings.quantize,
        )
        mark_only_lora_as_trainable(model)
        return model

    # litgpt's file name, so `litgpt merge_lora` reads the result.
    spec = CheckpointSpec(weights_file="lit_model.pth.lora", trainable_only=True)
    train(fabric, settings, config.block_size, build_model, spec, sft_loss)


if __name__ == "__main__":
    CLI(setup)
