"""Pretraining from scratch on plain text, e.g. tiny-shakespeare:

    python pretrain/pretrain.py --checkpoint_dir DIR --data PlainText --data.path ../shared/data/tinyshakespeare.txt

The tokenizer (and, unless --model_name is given, the architecture) come from --checkpoint_dir; its weights are
not loaded. With nothing given, the embedded tiny Llama's architecture and tokenizer learn the embedded corpus, so
it works offline. The file reads top to bottom: setup() checks the flags and starts Fabric; main() builds the model
and data; fit() is the loop; train_step() is one optimizer step, which is also what --estimate runs, on fake tensors.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from litgpt.data import DataModule
from litgpt.model import GPT, Block, Config
from litgpt.pretrain import initialize_weights
from litgpt.tokenizer import Tokenizer
from tqdm import tqdm

from memfit.args import DDPArgs, EvalArgs, FSDPArgs, LogArgs, LoggerChoice, ProfileArgs, StepSettings, TrainArgs
from memfit.failure.failures import guarded_run
from memfit.observatory.report import RunRecord, run_overview
from memfit.prediction.estimate_report import estimate_run
from memfit.settings.cli import CLI
from memfit.settings.instruments import Instruments
from memfit.settings.recipe import resolve_pretraining
from memfit.settings.run import Run, ScriptStep
from memfit.training.checkpoint import WEIGHTS_FILES, CheckpointFiles, base_files, load_for_resume, save_checkpoint
from memfit.training.data import pretraining_data
from memfit.training.loading import (
    init_from_seed,
    load_model,
    module_names,
    prepare_model,
)
from memfit.training.loggers import make_logger
from memfit.training.loop_parts import Counters, gradient_norm, loss_shares, stop_if_diverged, warmup_steps
from memfit.training.loss import next_token_loss
from memfit.training.optim import OptimizerChoice, build_optimizer, pretrain_schedule
from memfit.training.precision import PrecisionChoice, compute_dtype, fabric_precision
from memfit.training.quantizers import QuantizeChoice
from memfit.training.sample import run_sampler
from memfit.training.signals import Preempted, RunSignals
from memfit.training.strategy import keeps_gradient_buckets, run_strategy
from memfit.units import fmt_bytes

WEIGHTS_FILE = WEIGHTS_FILES["pretrain"]  # litgpt's name for this method's weights


def setup(
    checkpoint_dir: Path | None = None,
    out_dir: Path = Path("out/pretrain"),
    precision: PrecisionChoice | None = None,
    quantize: QuantizeChoice | None = None,
    data: DataModule | None = None,
    # Sized for the embedded corpus (well under a minute on 2 CPU cores); real runs take theirs from recipes/.
    train: TrainArgs = TrainArgs(
        save_interval=50,
        global_batch_size=16,
        micro_batch_size=8,
        lr_warmup_steps=10,
        max_steps=100,
        max_seq_length=128,
        lr=3e-3,
        min_lr=3e-4,
        max_norm=1.0,
    ),
    eval: EvalArgs = EvalArgs(interval=40, max_iters=20),
    optimizer: OptimizerChoice | dict = "AdamW",
    optimizer_in_backward: bool = False,
    activation_checkpointing: bool | int = False,
    activation_offloading: bool = False,
    compile: bool = False,
    accelerator: Literal["auto", "cpu", "cuda", "gpu"] = "auto",
    devices: int | Literal["auto"] = 1,
    num_nodes: int = 1,
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    fsdp: FSDPArgs = FSDPArgs(),
    ddp: DDPArgs = DDPArgs(),
    model_name: str | None = None,
    model_config: Config | None = None,
    tokenizer_dir: Path | None = None,
    initial_checkpoint_dir: Path | None = None,
    logger_name: LoggerChoice = "tensorboard",
    log: LogArgs = LogArgs(),
    profile: ProfileArgs = ProfileArgs(),
    profile_dir: Path = Path("out/profiles"),
    resume: bool | Literal["auto"] | Path = False,
    resume_with_changed_data: bool = False,
    overwrite: bool = False,
    seed: int = 1337,
    estimate: bool = False,
    memory_budget: str | None = None,
) -> RunRecord | object:
    """Pretrain a model from scratch.

    The flags every recipe shares (precision, devices, resume, profile, ...) are described once, in
    memfit/settings/flag_help.py; --help and docs/flags.md show them all.

    Args:
        checkpoint_dir: A litgpt checkpoint dir whose model_config.yaml and tokenizer are used (its weights are not
            loaded), also given first without the flag; `org/name` is looked up under checkpoints/. Default: the
            embedded tiny Llama's architecture and tokenizer, and its corpus.
        quantize: Refused: every weight trains, and quantized weights cannot (finetune/lora.py trains on a quantized
            base).
        data: A DataModule of plain text: ``--data PlainText --data.path FILE.txt`` (a file, or a directory of .txt
            files, read into memory), or litgpt's ``--data TextFiles --data.train_data_path DIR`` (litdata's
            streaming format; needs litdata). Default: the embedded corpus.
        train: Training settings.
        eval: Validation settings.
        strategy: auto (one process as it is; several: fsdp, litgpt's choice), ddp (replicated model), fsdp
            (sharded: torch's fully_shard, on GPUs or CPUs).
        model_name: A model name from litgpt's config table (e.g. pythia-160m) whose architecture replaces the
            checkpoint dir's; with --estimate, no checkpoint is needed at all.
        model_config: The architecture as litgpt's Config fields (the `model_config:` block of litgpt's pretraining
            configs); replaces --model_name and the checkpoint dir's.
        tokenizer_dir: Where the tokenizer is (tokenizer.json or tokenizer.model), as litgpt's pretrain takes it.
            Default: --checkpoint_dir.
        initial_checkpoint_dir: A litgpt checkpoint dir whose lit_model.pth starts the weights (continued
            pretraining). Default: litgpt's random initialisation.
    """
    # the flags as given (setup()'s parameters: nothing else is bound yet), for hyperparameters.yaml, which --config
    # of it reruns
    flags = dict(locals())
    # every flag checked (a bad value ends in one line) and resolved into the run, before anything is built
    run, script = resolve_pretraining(flags, GPT, Block, train_step, validate)
    if estimate:
        return estimate_run(run, script)

    fabric = L.Fabric(
        accelerator=run.accelerator,
        devices=run.devices,
        num_nodes=run.num_nodes,
        # from scratch: each rank initialises one unit at a time as it shards it, never the whole model
        strategy=run_strategy(run, block_class=Block, init_seed=seed if initial_checkpoint_dir is None else None),
        loggers=make_logger(run),
        # bitsandbytes' precision plugin for --quantize (on CPU too); checkpoint files written where they are asked
        # to be, not staged in $TMPDIR (memfit.training.checkpoint.CheckpointFiles; FSDP's are torch's, in save_fsdp)
        **fabric_precision(
            run.precision,
            run.quantize,
            run.accelerator,
            checkpoint_io=CheckpointFiles() if run.strategy != "fsdp" else None,
        ),
    )
    return fabric.launch(main, run, script)


def main(fabric: L.Fabric, run: Run, script: ScriptStep) -> RunRecord:
    # Every process launched (by Fabric, torchrun or srun) named the run in setup(): rank 0's name is the run's, so
    # that each rank's trace lands in the one profile dir
    instruments = Instruments(fabric, run, run_dir=fabric.broadcast(run.run_dir))
    counters = Counters()
    # one run per --out_dir at a time; out of memory, divergence, a full disk, a preemption or Ctrl-C end in a few lines
    with guarded_run(fabric, run, script, counters, instruments.memory) as signals:
        fabric.seed_everything(run.seed)

        tokenizer = Tokenizer(run.tokenizer_dir or run.checkpoint_dir)
        # tokenized into blocks, the longest in the step profiled by default: an out-of-memory comes early
        data = pretraining_data(fabric, run, tokenizer, target_tokens)

        with instruments.phase("load"):
            # FSDP shards from CPU memory: loading each rank's full copy onto its GPU first would defeat it.
            device = torch.device("cpu") if run.strategy == "fsdp" else fabric.device
            # Built on the meta device and initialised as litgpt does, or from --initial_checkpoint_dir's weights
            initial = run.initial_checkpoint_dir / "lit_model.pth" if run.initial_checkpoint_dir else None
            model = load_model(
                GPT,
                run.config,
                initial,
                dtype=compute_dtype(run.precision),
                device=device,
                sharded=run.strategy == "fsdp",
                show_progress=fabric.is_global_zero,
            )
            if initial is None:  # from scratch: litgpt's pretraining initialisation (GPT-NeoX's), its own function,
                # sets each layer's init; the model is still on the meta device, so nothing is drawn yet
                initialize_weights(fabric, model, n_layer=run.config.n_layer, n_embd=run.config.n_embd)
            # --train.tie_embeddings (the head and the embedding one parameter, as litgpt's pretraining), the draw
            # from the seed (FSDP draws each unit as it shards it: memfit.training.strategy), checkpointing, the rope
            # cache for the longest sample: as the estimate prepares its model
            draw = initial is None and run.strategy != "fsdp"
            prepare_model(
                model,
                script,
                initialize=(lambda m: init_from_seed(m, module_names(m), run.seed, device)) if draw else None,
                activation_checkpointing=0 if run.strategy == "fsdp" else run.activation_checkpointing,  # FSDP: its own
                activation_offloading=run.activation_offloading,
                compile=run.compile,
                max_seq_length=data.longest,
            )
            model = fabric.setup_module(model)
            optimizer = build_optimizer(
                run.optimizer,
                model.parameters(),
                run.train.lr,
                run.train.weight_decay,
                in_backward=run.optimizer_in_backward,
                precision=run.precision,
                **run.optimizer_args,
            )
            if not run.optimizer_in_backward:  # one stepped by its own hooks inside backward is not Fabric's to step
                optimizer = fabric.setup_optimizers(optimizer)
        instruments.watch(model, optimizer)
        warmup = warmup_steps(
            run.train.lr_warmup_steps, run.train.lr_warmup_fraction, data.steps_per_epoch, data.max_steps
        )
        # litgpt counts the schedule in micro-batch iterations of one process, to max_tokens whatever max_steps stops at;
        # a block holds max_seq_length tokens trained and one more, the last target
        tokens_per_micro_batch = run.train.micro_batch_size * (data.longest_train - 1)
        max_iters = (
            run.train.max_tokens // fabric.world_size // tokens_per_micro_batch
            if run.train.max_tokens
            else data.max_steps * run.accumulation
        )
        warmup_iters = min(
            max_iters,
            math.ceil(run.train.lr_warmup_fraction * len(data.batches.loader))
            if run.train.lr_warmup_fraction
            else warmup * run.accumulation,
        )
        scheduler = pretrain_schedule(optimizer, warmup_iters, max_iters, run.accumulation, run.train.min_lr)
        state = {"optimizer": optimizer, "scheduler": scheduler, "counters": counters, "data": data.batches}

        def save(name: str) -> Path:
            # every weight; the model's config and tokenizer travel with them
            # the config trained (from --model_name too) is written as model_config.yaml, so litgpt loads the weights
            with instruments.phase("save"):
                return save_checkpoint(
                    fabric,
                    out_dir=run.out_dir,
                    name=name,
                    weights_file=WEIGHTS_FILE,
                    model=model,
                    state=state,
                    hparams=run.hparams,
                    weights_filter=None,
                    extra_files=base_files(run.tokenizer_dir or run.checkpoint_dir),
                    prompt_style=None,
                    model_config=run.config,
                )

        if run.resume_from is not None:
            with instruments.phase("resume"):
                resumed_from = load_for_resume(fabric, run.resume_from, WEIGHTS_FILE, model, state)
            fabric.print(f"Resumed from {resumed_from} at step {counters.step}")

        fabric.print(run_overview(run, model, data, world_size=fabric.world_size, warmup=warmup))
        sample = run_sampler(fabric, run, model, tokenizer, data.val_loader, phases=instruments.phase)
        record = instruments.record
        if data.val_loader is not None and run.eval.initial_validation and counters.step == 0:
            with instruments.phase("validation"):
                val_loss = validate(fabric, model, data.val_loader, run.eval.max_iters)
            fabric.print(f"Initial validation: loss {val_loss:.3f}")
            fabric.log_dict({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, step=0)

        fit(
            fabric,
            run,
            model=model,
            state=state,
            max_steps=data.max_steps,
            val_loader=data.val_loader,
            instruments=instruments,
            save=save,
            sample=sample,
            signals=signals,
        )

        if data.val_loader is not None and run.eval.final_validation:
            with instruments.phase("validation"):
                val_loss = validate(fabric, model, data.val_loader, run.eval.max_iters)
            record.val_losses.append(val_loss)
            fabric.log_dict({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, step=counters.step)
            record.samples.append(sample(step=counters.step))
        record.samples = [text for text in record.samples if text is not None]  # None: no sample asked for
        record.last_checkpoint = save("final")

    # The run is saved. What follows is optional: a failure in it is a warning, never a lost run.
    return instruments.publish(counters.step)


def fit(
    fabric: L.Fabric,
    run: Run,
    *,
    model,
    state: dict,
    max_steps: int,
    val_loader,
    instruments: Instruments,
    save,
    sample,
    signals: RunSignals,
) -> None:
    optimizer, scheduler, counters, train_batches = (
        state["optimizer"],
        state["scheduler"],
        state["counters"],
        state["data"],
    )
    train, record = run.train, instruments.record
    settings = StepSettings.of(train)  # what each step needs from the flags
    progress = tqdm(
        total=max_steps,
        initial=counters.step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=fabric.global_rank != 0,
        mininterval=0.5,
    )
    saved_step = counters.step  # the step the latest checkpoint holds (a resumed run's, or 0: nothing to save)
    # the bar closes on any exit, so an error line is not followed by a stale bar
    with instruments.steps(counters.step, max_steps), progress:
        while counters.step < max_steps and (train.max_tokens is None or counters.tokens < train.max_tokens):
            if signum := signals.requested(fabric):  # preempted: keep the steps taken, before the scheduler's kill
                if counters.step > saved_step:
                    record.last_checkpoint = save(f"step-{counters.step:06d}")
                raise Preempted(signum, counters.step)
            t0 = time.perf_counter()
            micro_batches = [next(train_batches) for _ in range(run.accumulation)]
            shares = loss_shares(fabric, [target_tokens(batch) for batch in micro_batches], train.loss_weighting)
            loss, norm = instruments.step(
                train_step,
                optimizer,
                micro_batches,
                fabric=fabric,
                model=model,
                shares=shares,
                settings=settings,
                step=counters.step + 1,
            )
            lr = optimizer.param_groups[0]["lr"]  # this step's: the scheduler now sets the next one's
            scheduler.step()
            # a block's max_seq_length positions, as litgpt counts them (the block's extra token is only a target)
            tokens = sum(target_tokens(batch) for batch in micro_batches) * fabric.world_size
            counters.step += 1
            counters.tokens += tokens
            loss = loss.item()
            record.losses.append(loss)

            if counters.step % train.log_interval == 0 or counters.step == max_steps:
                tokens_per_s = tokens / (time.perf_counter() - t0)
                fabric.log_dict(
                    {
                        "loss": loss,
                        "learning_rate": lr,
                        "grad_norm": float(norm),
                        "tokens_per_s": tokens_per_s,
                        "epoch": train_batches.epoch,
                        **instruments.scalars(),
                    },
                    step=counters.step,
                )
                progress.set_postfix_str(
                    f"loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | peak {fmt_bytes(instruments.step_peak())}",
                    refresh=False,
                )
            if val_loader is not None and counters.step % run.eval.interval == 0 and counters.step < max_steps:
                with instruments.phase("validation"):
                    val_loss = validate(fabric, model, val_loader, run.eval.max_iters)
                record.val_losses.append(val_loss)
                record.samples.append(sample(step=counters.step))
                fabric.log_dict({"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}, step=counters.step)
            if train.save_interval and counters.step % train.save_interval == 0 and counters.step < max_steps:
                record.last_checkpoint = save(f"step-{counters.step:06d}")
                saved_step = counters.step
            progress.update(1)


def train_step(
    fabric,
    model,
    optimizer,
    micro_batches: list[dict],
    shares: list[float],
    settings: StepSettings,
    phases,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``micro_batches``; ``shares[i]`` is micro-batch i's share of the step's target tokens.

    ``phases(name)`` measures each phase's memory. Returns the step's loss per target token, over all ranks, and the
    gradient norm.
    ``--estimate`` runs this function on fake tensors, so what is predicted is what runs.
    """
    loss_sum = torch.zeros((), device=fabric.device)
    for i, batch in enumerate(micro_batches):
        # DDP skips its all-reduce on all but the last micro-batch; FSDP reduce-scatters every micro-batch's
        # gradients into the rank's shard unless --fsdp.accumulate_unsharded (memfit.training.strategy). One process: a
        # no-op.
        with fabric.no_backward_sync(model, enabled=i < len(micro_batches) - 1):
            with phases("forward"):
                loss = loss_fn(model, batch)  # the mean over this micro-batch's target tokens
            with phases("backward"):
                # DDP and FSDP average gradients over ranks, hence the world size: the step's gradient is the sum
                # over all its target tokens divided by their number.
                fabric.backward(loss * (shares[i] * fabric.world_size))
        loss_sum += loss.detach().float() * shares[i]
    # shares are of the whole step's target tokens, so the sum over ranks is the step's loss: the same on every rank
    # (what one process would log, and what each rank's divergence check sees, so all stop together or none)
    loss = fabric.all_reduce(loss_sum, reduce_op="sum") if fabric.world_size > 1 else loss_sum
    with phases("optimizer_step"):
        norm = (
            fabric.clip_gradients(model, optimizer, max_norm=settings.max_norm, error_if_nonfinite=False)
            if settings.max_norm
            else gradient_norm(fabric, model, optimizer)
        )
        stop_if_diverged(fabric, model=model, optimizer=optimizer, loss=loss, norm=norm, step=step)
        optimizer.step()
    with phases("zero_grad"):
        # freed, unless they are views into DDP's buckets, which stay (memfit.training.strategy)
        optimizer.zero_grad(set_to_none=not keeps_gradient_buckets(fabric, model, len(micro_batches)))
    return loss, norm


@torch.no_grad()
def validate(fabric: L.Fabric, model, val_loader, max_iters: int) -> float:
    model.eval()
    losses = [loss_fn(model, batch).float() for _, batch in zip(range(max_iters), val_loader)]
    model.train()
    loss = torch.stack(losses).mean() if losses else torch.tensor(float("nan"))
    return fabric.all_reduce(loss.to(fabric.device), reduce_op="mean").item()


def loss_fn(model, batch: dict) -> torch.Tensor:
    """Next-token loss on plain-text blocks: ``input_ids`` (B, T+1) gives inputs (B, T) and targets (B, T)."""
    input_ids, targets = batch["input_ids"][:, :-1], batch["input_ids"][:, 1:]
    # 128 positions at a time, logits recomputed in backward: no (B, T, vocab) tensor or float32 copy
    # (memfit.training.loss)
    return next_token_loss(model, input_ids, targets)


def target_tokens(batch: dict) -> int:
    """Every position of a text block but the first is a target."""
    return batch["input_ids"][:, 1:].numel()


if __name__ == "__main__":
    CLI(setup)
