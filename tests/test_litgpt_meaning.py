"""A litgpt setting means in Memfit what it means in litgpt: where litgpt's scripts make a choice of their own (the
strategy on several devices, the optimizer under bitsandbytes quantization), Memfit makes the same one or says by name
what it does instead. Each test reads litgpt's own code for its side."""

import inspect

import pytest
import torch

from conftest import hub_file, load_script, run_in_process


def plan_line(stdout: str) -> str:
    """The settings the estimate assumed: the line under its title."""
    lines = stdout.splitlines()
    return next(lines[i + 1] for i, line in enumerate(lines) if line.startswith("Estimate for"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, checkpointed", [("finetune/full.py", True), ("finetune/lora.py", True), ("pretrain/pretrain.py", False)]
)
def test_several_devices_with_strategy_auto_are_litgpts_fsdp(script, checkpointed, tmp_path, embedded):
    """litgpt's scripts shard with FSDP on several devices, each block checkpointed in fine-tuning, not in
    pretraining; Memfit's --strategy auto does the same, and the estimate's header names the strategy, the device
    count and the checkpointing it assumed."""
    import litgpt.finetune.full
    import litgpt.finetune.lora
    import litgpt.pretrain

    # litgpt's full.py and pretrain.py use Lightning's FSDPStrategy; its lora.py torch's fully_shard through
    # ModelParallelStrategy, with its parallelize_fn's checkpointing on by default
    if script == "finetune/lora.py":
        source = inspect.getsource(litgpt.finetune.lora.setup)
        assert "ModelParallelStrategy(" in source and "devices * num_nodes > 1" in source
        default = inspect.signature(litgpt.finetune.lora.parallelize_fn).parameters["activation_checkpointing"].default
        assert default is checkpointed
    else:
        module = litgpt.finetune.full if script == "finetune/full.py" else litgpt.pretrain
        source = inspect.getsource(module.setup)
        assert "FSDPStrategy(" in source and "devices * num_nodes > 1" in source
        assert ("activation_checkpointing_policy={Block}" in source) == checkpointed

    result = run_in_process(script, "--devices", "2", "--estimate", "true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    described = plan_line(result.stdout)
    assert "fsdp x2" in described and ("activation_checkpointing" in described) == checkpointed, described
    # the peak is a rank's: the cards line says each rank needs one ("Fits one GPU" alone read as the whole run's)
    assert "Fits one GPU per rank (2 ranks): 4090 (" in result.stdout, result.stdout
    result = run_in_process(script, "--devices", "2", "--strategy", "ddp", "--estimate", "true", cwd=tmp_path)
    assert "fsdp" not in plan_line(result.stdout) and "ddp x2" in plan_line(result.stdout)


@pytest.mark.slow
def test_a_hub_qlora_files_adamw_is_kept_and_litgpts_paged_swap_is_named(tmp_path):
    """litgpt swaps the AdamW of a QLoRA file for bitsandbytes' PagedAdamW (its instantiate_bnb_optimizer, with the
    block's lr, weight decay and betas); Memfit keeps the named AdamW and says so, and the block with litgpt's class
    path builds the same PagedAdamW with the same settings as litgpt's swap."""
    import torch
    import yaml
    from litgpt.utils import instantiate_bnb_optimizer

    from memfit.training.optim import OPTIMIZERS, make_optimizer, resolve_optimizer

    hub = hub_file("finetune/llama-2-7b/qlora.yaml")
    block = yaml.safe_load(hub.read_text())["optimizer"]
    params = [torch.nn.Parameter(torch.zeros(8))]
    theirs = instantiate_bnb_optimizer(block, params)
    paged = {**block, "class_path": "bitsandbytes.optim.PagedAdamW"}
    name, schedule, args = resolve_optimizer(paged)
    ours = make_optimizer(OPTIMIZERS[name], params, schedule["lr"], schedule["weight_decay"], **args)
    assert type(ours) is type(theirs)
    keys = ("lr", "weight_decay", "betas", "eps")
    assert {k: ours.defaults[k] for k in keys} == {k: theirs.defaults[k] for k in keys} | {
        "betas": tuple(theirs.defaults["betas"])
    }  # litgpt passes the file's list; the values are compared

    result = run_in_process(
        "finetune/lora.py",
        "--config",
        str(hub),
        "--estimate",
        "true",
        "--model_name",
        "Llama-2-7b-hf",
        "--train.max_seq_length",
        "64",
        cwd=tmp_path,
    )
    assert "litgpt trains --quantize bnb.nf4 with bitsandbytes' PagedAdamW in place of" in result.stdout
    assert "AdamW" in plan_line(result.stdout) and "Paged" not in plan_line(result.stdout)


@pytest.mark.slow
def test_a_checkpoint_dir_after_config_and_an_optimizer_block_after_config_are_taken(tmp_path, embedded):
    """litgpt takes ``finetune lora --config FILE CHECKPOINT_DIR``; and an --optimizer block after a file with one
    replaces the file's (jsonargparse's merge of the two ended in an AttributeError traceback)."""
    checkpoint_dir, _ = embedded
    hub = hub_file("finetune/tiny-llama/lora.yaml")
    result = run_in_process(
        "finetune/lora.py",
        "--config",
        str(hub),
        str(checkpoint_dir),
        "--estimate",
        "true",
        "--train.max_seq_length",
        "32",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"Estimate for lora on {checkpoint_dir.name}," in result.stdout
    result = run_in_process(
        "finetune/lora.py",
        "--config",
        str(hub),
        str(checkpoint_dir),
        "--optimizer",
        "{class_path: torch.optim.SGD, init_args: {lr: 0.1}}",
        "--estimate",
        "true",
        "--train.max_seq_length",
        "32",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SGD" in plan_line(result.stdout)


@pytest.mark.slow
def test_a_pretraining_hub_file_estimates_without_litdata_or_its_tokenizer_dir(tmp_path):
    """The estimate reads neither the streaming data nor the tokenizer: a hub file's absent tokenizer_dir and a
    machine without litdata do not stop it."""
    from conftest import ROOT, run_script

    hub = hub_file("pretrain/debug.yaml")
    result = run_script(
        "pretrain/pretrain.py",
        "--config",
        str(hub),
        "--estimate",
        "true",
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "tests/without_packages"), "MEMFIT_TEST_WITHOUT": "litdata"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Predicted peak:" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("module", ["TinyLlama", "MicroLlama"])
def test_litgpts_pretraining_data_without_its_dirs_is_one_line(module, tmp_path):
    (tmp_path / "none/slimpajama/train").mkdir(parents=True)  # a dir, but not litdata's format: one line too
    result = run_in_process(
        "pretrain/pretrain.py", "--data", module, "--data.data_path", str(tmp_path / "none"), cwd=tmp_path
    )
    assert result.returncode == 2
    # without litdata installed the line says that first; with it, which dir is not litdata's format
    assert result.stderr.strip().startswith(f"error: --data {module} reads litdata")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_pretraining_from_scratch_is_initialised_as_litgpts_pretraining(tmp_path, embedded):
    """litgpt's pretraining initialises with GPT-NeoX's scheme (its initialize_weights: std sqrt(2 / 5 / n_embd), the
    output projections 1 / sqrt(n_embd) / n_layer), not the model's own std 0.02. One step at the warm-up's first
    learning rate, 0, leaves the initial weights in final/: each tensor's spread is that of litgpt's function applied
    to the same architecture."""
    import torch
    from litgpt.model import GPT
    from litgpt.pretrain import initialize_weights

    result = run_in_process(
        "pretrain/pretrain.py",
        "--train.max_steps",
        "1",
        "--train.lr_warmup_steps",
        "2",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        "--precision",
        "32-true",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ours = torch.load(tmp_path / "out/pretrain/final/lit_model.pth", weights_only=True)["model"]
    from litgpt import Config

    config = Config.from_file(tmp_path / "out/pretrain/final/model_config.yaml")

    class NotFSDP:  # litgpt's function asks only whether Lightning's FSDPStrategy will initialise the model
        strategy = None

    torch.manual_seed(0)
    reference = GPT(config)
    initialize_weights(NotFSDP(), reference, n_layer=config.n_layer, n_embd=config.n_embd)
    theirs = reference.state_dict()
    checked = 0
    for name, tensor in ours.items():
        if name.endswith(".weight") and tensor.dim() == 2 and tensor.numel() > 4096:
            expected = theirs[name].float().std().item()
            assert abs(tensor.float().std().item() - expected) < 0.1 * expected, name
            checked += 1
    assert checked >= 3 * config.n_layer  # every block's projections at least
    proj = next(t for n, t in ours.items() if n.endswith("attn.proj.weight"))
    assert (
        abs(proj.float().std().item() - 1 / config.n_embd**0.5 / config.n_layer)
        < 0.1 / config.n_embd**0.5 / config.n_layer
    )


def test_an_optimizer_by_name_takes_the_runs_lr_and_help_names_litgpts_defaults():
    """litgpt's CLI builds an optimizer given by name with the class's defaults; Memfit's with --train.lr and
    --train.weight_decay. --help says so and names litgpt's values, which are litgpt's own."""
    import torch
    from litgpt.utils import instantiate_torch_optimizer

    from conftest import load_script
    from memfit.settings.cli import make_parser

    theirs = instantiate_torch_optimizer("AdamW", [torch.nn.Parameter(torch.zeros(2))])
    assert (theirs.defaults["lr"], theirs.defaults["weight_decay"]) == (1e-3, 0.01)
    help_text = " ".join(make_parser(load_script("finetune/lora.py").setup).format_help().split())
    assert "litgpt's CLI gives a name the class's own defaults, lr 1e-3 and weight decay 0.01 for AdamW" in help_text


@pytest.mark.slow
def test_a_real_model_takes_litgpts_defaults_and_the_embedded_default_keeps_its_own(tmp_path, embedded):
    """The signature's training settings are sized for the embedded default (lr 3e-3, 80 steps, a global batch of 8),
    and a real model's run took them too: lr 3e-3 for a 7B model. A real checkpoint (here the embedded weights
    copied elsewhere, as a user's own) takes litgpt's defaults for the script where nothing is given, read here from
    litgpt's own setup() and torch's AdamW (which litgpt's "AdamW" gets), and the run's first lines say which; a
    --config file's values and the flags given still win, and the embedded default keeps its own."""
    import shutil

    import litgpt.finetune.lora
    import yaml

    litgpt_train = inspect.signature(litgpt.finetune.lora.setup).parameters["train"].default
    litgpt_eval = inspect.signature(litgpt.finetune.lora.setup).parameters["eval"].default
    adamw = inspect.signature(torch.optim.AdamW).parameters
    checkpoint = tmp_path / "my-model"
    shutil.copytree(embedded[0], checkpoint)
    data = ["--data", "JSON", "--data.json_path", str(embedded[1]), "--data.val_split_fraction", "0.05"]
    quick = ["--train.max_steps", "1", "--profile.enabled", "false", "--eval.final_validation", "false"]

    def settings(*args: str, out: str) -> tuple[dict, str]:
        result = run_in_process("finetune/lora.py", *args, *quick, "--out_dir", out, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        saved = yaml.safe_load((tmp_path / out / "final/hyperparameters.yaml").read_text())
        return saved, result.stdout

    real, stdout = settings("--checkpoint_dir", str(checkpoint), *data, out="real")
    for field in ("global_batch_size", "micro_batch_size", "lr_warmup_steps", "epochs", "save_interval"):
        assert real["train"][field] == getattr(litgpt_train, field), (field, real["train"])
    assert real["train"]["lr"] == adamw["lr"].default and real["train"]["weight_decay"] == adamw["weight_decay"].default
    assert (real["eval"]["interval"], real["eval"]["max_iters"]) == (litgpt_eval.interval, litgpt_eval.max_iters)
    (note,) = [line for line in stdout.splitlines() if line.startswith("note: a real model")]
    assert "--train.global_batch_size 16 --train.micro_batch_size 1" in note and "--train.lr 0.001" in note, note
    assert "--train.max_steps" not in note  # given

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"train": {"lr": 2e-4, "global_batch_size": 8}}))
    chosen, _ = settings(
        "--config",
        str(recipe),
        "--checkpoint_dir",
        str(checkpoint),
        *data,
        "--train.micro_batch_size",
        "2",
        out="chosen",
    )
    assert (chosen["train"]["lr"], chosen["train"]["global_batch_size"]) == (2e-4, 8)  # the file's
    assert chosen["train"]["micro_batch_size"] == 2  # the flag's
    assert chosen["train"]["lr_warmup_steps"] == litgpt_train.lr_warmup_steps  # given by neither

    own, stdout = settings(out="embedded")
    signature = inspect.signature(load_script("finetune/lora.py").setup).parameters["train"].default
    assert (own["train"]["lr"], own["train"]["global_batch_size"]) == (signature.lr, signature.global_batch_size)
    assert "note: a real model" not in stdout
