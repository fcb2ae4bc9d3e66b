"""The --help text of the flags that mean the same in every recipe, kept once: a script's setup() docstring
describes its own flags (the method's, its data, its defaults), and ``memfit.settings.cli.make_parser`` adds these
for the rest of its signature, so ``--help`` still shows every flag."""

SHARED_FLAG_HELP = {
    "out_dir": ("Where checkpoints go (step-*/ and final/)."),
    "precision": (
        "Fabric precision: 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true (Lightning's older 32, 16 and bf16, "
        "which litgpt passes on, mean 32-true, 16-mixed and bf16-mixed). Default: bf16-true on a GPU that supports "
        "it, else 32-true."
    ),
    "optimizer": (
        "A name from the choices below (``memfit.training.optim.OPTIMIZERS`` describes each: AdamW is fused where "
        "supported, AdamW-foreach's step allocates scratch about the size of the parameters), which takes --train.lr "
        "and --train.weight_decay; or litgpt's block, {class_path: torch.optim.AdamW, init_args: {lr: 2e-4, "
        "weight_decay: 0.0, betas: [0.9, 0.95]}}, whose lr and weight_decay then set --train.lr and "
        "--train.weight_decay. (litgpt's CLI gives a name the class's own defaults, lr 1e-3 and weight decay 0.01 for "
        "AdamW: give them as --train.lr and --train.weight_decay for litgpt's meaning.)"
    ),
    "optimizer_in_backward": (
        "Step each parameter's optimizer as soon as its gradient is ready and free the gradient (needs no gradient "
        "accumulation and no clipping)."
    ),
    "activation_checkpointing": (
        "Recompute transformer blocks' activations in backward instead of keeping them: true (every block), false, or "
        "a number of blocks (spread evenly over the depth): the fewest that fit is what --estimate --memory_budget "
        "offers."
    ),
    "activation_offloading": (
        "Keep the activations saved for backward in pinned host memory until backward needs them (a GPU's memory for "
        "PCIe transfers; refused on a CPU run, whose host is its device)."
    ),
    "compile": (
        "Compile each transformer block with torch.compile (inductor), as torchtune and torchtitan do: faster steps "
        "once the first step has compiled them (seconds on a GPU, about half a minute for a small model on a CPU, "
        "which needs a C++ compiler). Off by default: the first step's wait; LoRA recompiles for each new sequence "
        "length (its grouped convolution's backward is compiled for one length); with --estimate, the compiled step is "
        "predicted (what each block saves for backward as torch.compile's partitioner chooses). Under --strategy "
        "fsdp each block is compiled before it is sharded, as torchtitan does."
    ),
    "accelerator": ("cpu, cuda (gpu) or auto (the GPU when present)."),
    "devices": ("Devices (processes) per node, or auto: every visible GPU (one process on CPU)."),
    "num_nodes": ("Nodes (launch with torchrun or SLURM; see the README)."),
    "fsdp": ("FSDP settings: cpu_offload, sharding_strategy, accumulate_unsharded, state_dict_type."),
    "ddp": ("DDP settings: gradient_as_bucket_view (false: torch's default, as litgpt runs DDP)."),
    "logger_name": (
        "Where per-step scalars go: tensorboard or csv (in the run's profile dir), or wandb or mlflow (when "
        "installed; WANDB_MODE=offline and MLFLOW_TRACKING_URI are honoured)."
    ),
    "log": ("The wandb/MLflow project, run name and wandb group (litgpt's --log.project/run/group)."),
    "profile": ("The memory-profiler window, counted in optimizer steps."),
    "profile_dir": (
        "Where each run's profile dir (trace, scalars, ledger, picture, summary) is created: under out/ by default, "
        "apart from the measurements the project commits in profiles/."
    ),
    "resume": (
        "Continue a run: true, from the latest step-* checkpoint in out_dir; auto, from it if there is one (else "
        "start); or a step-* checkpoint dir (litgpt's forms)."
    ),
    "resume_with_changed_data": (
        "Resume although the training samples differ from those the checkpoint was trained on (a checkpoint records "
        "their fingerprint; a resume onto other data is refused without this flag)."
    ),
    "overwrite": (
        "Start afresh in an out_dir that holds an earlier run, deleting its step-*/ and final/ checkpoints (without "
        "it, such an out_dir is refused: resume it, or choose a fresh one)."
    ),
    "seed": ("Random seed."),
    "sample_order": (
        "The training samples' order. longest_early: shuffled by --seed each epoch, with the longest samples (a "
        "global batch of them) in step 3, the step profiled by default, so a batch that does not fit fails in the "
        "first minutes; litgpt: litgpt's own order, the permutation its DataLoader draws from --data.seed, to "
        "reproduce a litgpt run. Neither depends on the --profile.* flags."
    ),
    "estimate": (
        "Print the predicted peak memory of these settings, by role and phase, and exit without training (works from "
        "--model_name alone, no weights needed)."
    ),
    "memory_budget": (
        "With --estimate, say whether the settings fit this much memory, then list the settings that do, the same "
        "training first, each group fastest first (24GiB; 24GB is 10^9-byte GB; or a card: 4090, A100-40GB, H100); "
        "in a run, the budget the out-of-memory explanation plans for (default: what "
        "the device has free)."
    ),
    "access_token": (
        "A Hugging Face token for data modules that download gated data (e.g. --data LIMA); never written into a "
        "checkpoint. Memfit downloads no checkpoints."
    ),
}
