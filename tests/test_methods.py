"""Every script and memory technique of the toolbox, on CPU: adapters, full, pretraining, DDP, activation
checkpointing, the optimizers, optimizer-in-backward, and resume for each method."""

import math
from pathlib import Path

import pytest
import torch

from conftest import (
    SCRIPTS,
    WEIGHTS,
    load_script,
    loss_fell,
    run_in_process,
    run_script,
    run_summary,
    script_summary,
    shared_file,
    step_losses,
    tiny_train,
)

pytestmark = pytest.mark.slow  # every test here runs a recipe


def _losses(tmp_path) -> list[float]:
    return step_losses(tmp_path / "profiles")


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_script_runs_with_no_arguments(tmp_path, embedded, script):
    """As a user runs it: no flags. The loss falls; a profile and checkpoints are written, like lora.py."""
    result = run_script(script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")
    name = summary["script"]
    losses = step_losses(tmp_path / "out" / "profiles")
    assert loss_fell(losses, by=1.5), losses
    assert summary["profile_traces"], summary
    final = tmp_path / "out" / ("pretrain" if name == "pretrain" else f"finetune/{name}") / "final"
    weights = torch.load(final / WEIGHTS[name], weights_only=True)["model"]
    if name in ("full", "pretrain"):
        assert "transformer.wte.weight" in weights
    else:
        # what litgpt marks trainable: prompts and gates (v1); plus linear bias/scale and norms (v2)
        assert weights and all(("adapter" in k or "gating" in k or "norm" in k or "ln_f" in k) for k in weights)
        assert not any(k.endswith("attn.qkv.linear.weight") for k in weights)
    assert (final / "hyperparameters.yaml").is_file()


@pytest.mark.parametrize("script", ["finetune/adapter.py", "finetune/adapter_v2.py"])
def test_adapters_train_on_a_quantized_base(tmp_path, embedded, script):
    lr = 6e-2 if script.endswith("adapter.py") else 1e-2
    script_summary(script, tmp_path, quantize="bnb.nf4", precision="32-true", train=tiny_train(max_steps=30, lr=lr))
    assert loss_fell(_losses(tmp_path), by=0.5), _losses(tmp_path)


@pytest.mark.parametrize(
    "script, args, says",
    [
        ("finetune/full.py", ["--quantize", "bnb.nf4"], "full trains every weight"),
        ("pretrain/pretrain.py", ["--quantize", "bnb.nf4-dq"], "pretrain trains every weight"),
        (
            "finetune/lora.py",
            ["--strategy", "fsdp", "--fsdp.sharding_strategy", "HYBRID_SHARD"],
            "on one node (--num_nodes 1) that is FULL_SHARD",
        ),
        ("finetune/lora.py", ["--strategy", "fsdp", "--fsdp.sharding_strategy", "NO_SHARD"], "that is --strategy ddp"),
        ("finetune/full.py", ["--fsdp.cpu_offload", "true"], "needs --strategy fsdp"),
        ("finetune/full.py", ["--fsdp.accumulate_unsharded", "true"], "needs --strategy fsdp"),
        ("finetune/full.py", ["--ddp.gradient_as_bucket_view", "false"], "needs DDP: --strategy ddp on 2 processes"),
        (
            "pretrain/pretrain.py",
            ["--ddp.gradient_as_bucket_view", "false", "--devices", "2"],
            "(this run is FSDP); drop it",
        ),
        ("finetune/lora.py", ["--optimizer_in_backward", "true"], "needs --train.global_batch_size equal to"),
        (
            "finetune/full.py",
            [
                "--optimizer_in_backward",
                "true",
                "--devices",
                "2",
                "--strategy",
                "ddp",
                "--train.global_batch_size",
                "8",
                "--train.micro_batch_size",
                "4",
            ],
            "before DDP averages it over the 2 processes",
        ),
        (
            "finetune/lora.py",
            ["--quantize", "torchao.nf4", "--devices", "2", "--strategy", "ddp"],
            "on several processes needs --strategy fsdp",
        ),
        ("finetune/lora.py", ["--quantize", "torchao.nf4", "--strategy", "fsdp"], "needs 2 processes or more"),
        (
            "finetune/adapter.py",
            ["--quantize", "bnb.nf4", "--devices", "2", "--strategy", "fsdp"],
            "lose their quantization state when FSDP shards them",
        ),
        ("finetune/adapter.py", ["--model_name", "Llama-9"], "not in litgpt's config table"),
        (
            "pretrain/pretrain.py",
            ["--data", "memfit.training.data.PlainText", "--data.path", "missing.txt"],
            "does not exist",
        ),
    ],
)
def test_methods_refuse_what_they_cannot_do(tmp_path, script, args, says):
    result = run_in_process(script, *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_ddp_on_two_cpu_processes(tmp_path, embedded):
    result = run_script(
        "finetune/lora.py",
        "--accelerator",
        "cpu",
        "--devices",
        "2",
        "--strategy",
        "ddp",
        "--train.max_steps",
        "20",
        "--train.global_batch_size",
        "8",
        "--train.micro_batch_size",
        "2",
        "--precision",
        "32-true",
        "--logger_name",
        "csv",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")  # one run dir: both ranks agreed on its name
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert "2 process(es) x 2 micro-batch(es) of 2" in result.stdout
    assert loss_fell(step_losses(tmp_path / "out" / "profiles"), by=0.5, window=4), step_losses(
        tmp_path / "out" / "profiles"
    )
    (run_dir,) = (tmp_path / "out" / "profiles").iterdir()
    assert {p.name.split(".")[0] for p in run_dir.glob("*.pt.trace.json.gz")} == {"rank0", "rank1"}
    assert (tmp_path / "out/finetune/lora/final/lit_model.pth.lora").is_file()


def _ddp_estimate(tmp_path, gradient_as_bucket_view: bool = True):
    """``--estimate`` of the DDP runs below: full fine-tuning on 2 CPU processes, two micro-batches of 4 a rank."""
    full = load_script("finetune/full.py")
    return full.setup(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        ddp=full.DDPArgs(gradient_as_bucket_view=gradient_as_bucket_view),
        precision="32-true",
        estimate=True,
        train=tiny_train(global_batch_size=16, micro_batch_size=4, max_steps=3),
        out_dir=tmp_path / "estimate",
        profile_dir=tmp_path / "estimate-profiles",
    )


def test_ddps_gradient_buckets_are_counted_held_once_and_estimated(tmp_path, embedded):
    """DDP keeps every gradient in its all-reduce buckets from the first step to the last: the CPU ledger counts them
    in every phase, forward included (they were allocated before the recorded step, where a CPU profiler sees
    nothing: the ledger missed them), they are held once with two micro-batches a rank (freed by zero_grad, the
    first micro-batch made a second copy beside the buckets: 8.01 MiB for 4.00), and the estimate prices them: each
    phase's peak within 3% of the run's."""
    import json

    flags = ["--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", "--precision", "32-true"]
    batches = ["--train.global_batch_size", "16", "--train.micro_batch_size", "4"]  # two micro-batches a rank
    result = run_script(
        "finetune/full.py", *flags, *batches, "--train.max_steps", "3", "--logger_name", "csv", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ledger = json.loads(next((tmp_path / "out" / "profiles").glob("*/ledger.json")).read_text())["phases"]
    from litgpt import GPT, Config

    config = Config.from_file(embedded[0] / "model_config.yaml")
    gradient_bytes = 4 * sum(p.numel() for p in GPT(config).parameters())  # float32
    for name, phase in ledger.items():
        assert phase["found_at_peak_bytes"]["gradients"] == pytest.approx(gradient_bytes, rel=0.001), (name, phase)
    estimate = _ddp_estimate(tmp_path)
    for name, predicted in estimate.phases.items():
        measured = ledger[name]["peak_bytes"]
        assert abs(predicted["peak"] - measured) <= 0.03 * measured, (name, predicted["peak"], measured)
        assert predicted["roles"]["gradients"] == pytest.approx(gradient_bytes, rel=0.001), (name, predicted)
    # the second step's start, where DDP rebuilds its buckets beside the first (two micro-batches: the gradients stay
    # its views): the weights, AdamW's two moments and the gradients twice, all float32, every weight trained
    assert estimate.bucket_rebuild == pytest.approx(5 * gradient_bytes, rel=0.001)


def test_ddps_buckets_as_litgpt_runs_them_are_a_second_copy_of_the_gradients_counted_and_estimated(tmp_path, embedded):
    """``--ddp.gradient_as_bucket_view false``, torch's default, which litgpt, Lightning and Thunder run: DDP's
    buckets are a copy of the gradients beside them for the whole run. The CPU ledger finds them (through DDP's
    communication hook: made when DDP wraps the model, before any profiler), twice the gradients in each phase of the
    step; the estimate prices them, each phase's peak within 3% of the run's, its first optimizer step's too."""
    import json

    flags = ["--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", "--precision", "32-true"]
    flags += ["--ddp.gradient_as_bucket_view", "false"]
    batches = ["--train.global_batch_size", "16", "--train.micro_batch_size", "4"]  # two micro-batches a rank
    result = run_script(
        "finetune/full.py", *flags, *batches, "--train.max_steps", "3", "--logger_name", "csv", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "out" / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())["phases"]
    tensor_peaks = json.loads((run_dir / "summary.json").read_text())["tensor_peak_bytes"]
    from litgpt import GPT, Config

    config = Config.from_file(embedded[0] / "model_config.yaml")
    gradient_bytes = 4 * sum(p.numel() for p in GPT(config).parameters())  # float32
    for name in ("forward", "backward", "optimizer_step"):
        found = ledger[name]["found_at_peak_bytes"]["gradients"]
        assert found == pytest.approx(2 * gradient_bytes, rel=0.001), (name, found)
    estimate = _ddp_estimate(tmp_path, gradient_as_bucket_view=False)
    for name, predicted in estimate.phases.items():
        measured = ledger[name]["peak_bytes"]
        assert abs(predicted["peak"] - measured) <= 0.03 * measured, (name, predicted["peak"], measured)
    first = estimate.run_phases["first_optimizer_step"]["peak"]
    assert abs(tensor_peaks["first_optimizer_step"] - first) <= 0.03 * first, (tensor_peaks, first)
    assert estimate.bucket_rebuild == 0  # the gradients are no bucket's views: nothing keeps the first bucket


@pytest.mark.slow
def test_ddps_bucket_rebuild_makes_no_second_copy_of_the_gradients_where_a_step_is_one_micro_batch():
    """benchmarks/ddp_first_bucket.py's plain DDP loop on 2 CPU processes, the profiler started before DDP wraps the
    model: with the gradients zeroed in place, the second step, where DDP rebuilds its buckets, rises one gradient
    copy above its start (the gradients, views of the first bucket, keep it alive while the new ones are made); with
    the scripts' zero_grad (``memfit.training.strategy.keeps_gradient_buckets``: freed before the rebuild) it rises as
    later steps do, the first bucket is freed either way, and the weights are the same."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))  # by name: the processes it spawns import its train function
    import ddp_first_bucket as benchmark

    gradient_bytes = 8 * (512 * 512 + 512) * 4
    in_place, scripts = benchmark.measure([(True, "in place"), (True, "memfit")])
    rise = in_place["highest_above_start"]
    assert rise["step 2"] >= gradient_bytes > rise["step 3"], rise
    rise = scripts["highest_above_start"]
    assert rise["step 2"] == pytest.approx(rise["step 3"], rel=0.01), rise
    assert max(in_place["net"]["step 2"], scripts["net"]["step 2"]) < gradient_bytes // 100  # the first bucket freed
    assert in_place["weights"] == scripts["weights"]


def _saved_activation_bytes_and_grads(model, batch):
    """Bytes autograd keeps for backward (activations; parameters excluded), and the gradients."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), 0

    def pack(tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = load_script("finetune/full.py").loss_fn(model, batch)
    loss.backward()
    # the checkpoint wrapper renames parameters; compare under the plain model's names
    return total, {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def test_activation_checkpointing_saves_activation_memory_with_equal_gradients(embedded):
    from litgpt.model import GPT, Block, Config

    from memfit.training.loading import apply_activation_checkpointing, load_model

    checkpoint_dir, _ = embedded
    config = Config.from_file(checkpoint_dir / "model_config.yaml")
    ids = torch.randint(0, 800, (4, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    results = []
    for checkpointing in (False, True):
        model = load_model(
            GPT, config, checkpoint_dir / "lit_model.pth", dtype=torch.float32, device=torch.device("cpu")
        )
        if checkpointing:
            assert apply_activation_checkpointing(model, Block) == config.n_layer
        results.append(_saved_activation_bytes_and_grads(model, batch))
    (plain_bytes, plain_grads), (ckpt_bytes, ckpt_grads) = results
    print(f"saved activations: {plain_bytes / 2**20:.1f} MiB plain, {ckpt_bytes / 2**20:.1f} MiB checkpointed")
    assert ckpt_bytes < 0.5 * plain_bytes
    assert plain_grads.keys() == ckpt_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(ckpt_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6)


def test_activation_checkpointing_flag_trains(tmp_path, embedded):
    summary = script_summary(
        "finetune/full.py", tmp_path, activation_checkpointing=True, train=tiny_train(max_steps=20, lr=1e-3)
    )
    assert summary["last_loss"] < summary["first_loss"]


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD", "AdamW8bit", "PagedAdamW", "PagedAdamW8bit"])
def test_every_optimizer_trains_on_cpu(tmp_path, embedded, optimizer):
    lr = 3e-2 if optimizer == "SGD" else 3e-3
    script_summary("finetune/lora.py", tmp_path, optimizer=optimizer, train=tiny_train(max_steps=30, lr=lr))
    assert loss_fell(_losses(tmp_path), by=0.5), (optimizer, _losses(tmp_path))


def test_optimizer_in_backward_matches_a_normal_step(tmp_path, embedded):
    """Stepping each parameter inside backward gives the same weights as one optimizer.step() after it."""
    train = tiny_train(max_steps=8, global_batch_size=4, micro_batch_size=4)
    script_summary("finetune/full.py", tmp_path / "normal", train=train, optimizer="AdamW")
    script_summary(
        "finetune/full.py", tmp_path / "in_backward", train=train, optimizer="AdamW", optimizer_in_backward=True
    )
    a = torch.load(tmp_path / "normal/out/final/lit_model.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "in_backward/out/final/lit_model.pth", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)


def test_pretrain_on_tinyshakespeare_with_a_sentencepiece_tokenizer(tmp_path):
    import yaml

    text = shared_file("tinyshakespeare.txt")
    tokenizer = shared_file("llama2_tokenizer.model")
    checkpoint_dir = tmp_path / "tokenizer-only"
    checkpoint_dir.mkdir()
    (checkpoint_dir / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    config = dict(
        name="shakespeare-tiny",
        block_size=128,
        vocab_size=32000,
        padded_vocab_size=32000,
        n_layer=2,
        n_head=4,
        n_embd=64,
        intermediate_size=172,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    (checkpoint_dir / "model_config.yaml").write_text(yaml.safe_dump(config))
    result = run_script(
        "pretrain/pretrain.py",
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--data",
        "PlainText",
        "--data.path",
        str(text),
        "--train.max_steps",
        "8",
        "--train.lr",
        "1e-2",
        "--train.lr_warmup_steps",
        "2",
        "--eval.max_iters",
        "2",
        "--profile.enabled",
        "false",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "out" / "profiles")
    assert summary["last_loss"] < summary["first_loss"] - 2.0, summary  # from ~ln(32000) = 10.4


def test_pretraining_a_named_architecture_saves_its_config(tmp_path, embedded):
    """--model_name replaces the checkpoint dir's architecture; the checkpoint's model_config.yaml must then be the
    trained one (not the base dir's copy), so that litgpt builds the right model and loads the weights strictly."""
    import yaml
    from litgpt import GPT, Config

    from conftest import tiny_train
    from memfit.args import ProfileArgs

    load_script("pretrain/pretrain.py").setup(
        model_name="pythia-14m",
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        logger_name="csv",
        train=tiny_train(max_steps=2, micro_batch_size=2, global_batch_size=2, max_seq_length=32),
        profile=ProfileArgs(enabled=False),
    )
    final = tmp_path / "out/final"
    saved = yaml.safe_load((final / "model_config.yaml").read_text())
    assert saved["name"] == "pythia-14m" and saved["n_layer"] == Config.from_name("pythia-14m").n_layer
    model = GPT(Config.from_file(final / "model_config.yaml"))
    model.load_state_dict(torch.load(final / "lit_model.pth", weights_only=True)["model"], strict=True)


def test_litgpt_pretraining_config_with_model_config_and_tokenizer_dir(tmp_path, embedded):
    """A config in the shape of litgpt's config_hub/pretrain/*.yaml: the architecture as a model_config block, the
    tokenizer from tokenizer_dir, devices auto, max_tokens, litgpt's optimizer block. It trains that architecture and
    saves it as model_config.yaml, with the tokenizer it read. As in litgpt, model_config replaces model_name, which
    is then a label that need not be in litgpt's table (tinystories.yaml names "stories15M"); the run's profile dir
    takes the model_config's name."""
    import yaml

    from memfit.settings.cli import CLI

    checkpoint_dir, json_path = embedded
    architecture = dict(
        name="tiny-from-config",
        block_size=128,
        vocab_size=1024,
        padded_vocab_size=1024,
        n_layer=2,
        n_head=4,
        n_query_groups=4,
        n_embd=64,
        intermediate_size=128,
        bias=False,
        rotary_percentage=1.0,
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    config = {
        "model_name": "stories15M",
        "model_config": architecture,
        "out_dir": str(tmp_path / "out"),
        "precision": "32-true",
        "initial_checkpoint_dir": None,
        "resume": False,
        "devices": "auto",
        "num_nodes": 1,
        "tokenizer_dir": str(checkpoint_dir),
        "logger_name": "csv",
        "seed": 42,
        "data": {
            "class_path": "memfit.training.data.PlainText",
            "init_args": {"path": str(json_path.with_name("corpus.txt"))},
        },
        "train": {
            "save_interval": 1000,
            "log_interval": 1,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "max_tokens": 4 * 32 * 3,
            "max_seq_length": 32,
            "max_norm": 1.0,
            "min_lr": 4e-5,
            "lr_warmup_steps": 1,
            "tie_embeddings": True,
        },
        "eval": {"interval": 1000, "max_iters": 2, "initial_validation": False, "final_validation": True},
        "optimizer": {
            "class_path": "torch.optim.AdamW",
            "init_args": {"lr": 4e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
    }
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(config))
    CLI(load_script("pretrain/pretrain.py").setup, ["--config", str(path), "--profile_dir", str(tmp_path / "p")])
    final = tmp_path / "out/final"
    saved = yaml.safe_load((final / "model_config.yaml").read_text())
    assert saved["name"] == "tiny-from-config" and saved["n_layer"] == 2 and saved["n_embd"] == 64
    (run_dir,) = (tmp_path / "p").iterdir()  # named after the architecture trained, not the dir lending a tokenizer
    assert run_dir.name.startswith("pretrain-tiny-from-config-"), run_dir.name
    assert (final / "tokenizer.json").read_bytes() == (checkpoint_dir / "tokenizer.json").read_bytes()
    state = torch.load(final / "training_state.pth", weights_only=False)
    # litgpt's horizon: max_tokens over full steps of 4 blocks of 32 trained tokens (a block holds 32 + 1)
    assert state["counters"]["step"] == 384 // (4 * 32) and state["optimizer"]["param_groups"][0]["weight_decay"] == 0.1
    # tie_embeddings: true (as tinystories.yaml): the head is the embedding, trained as one parameter
    weights = torch.load(final / "lit_model.pth", weights_only=True)["model"]
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])


def _first_batch_loss_of_weights(weights: Path, checkpoint_dir: Path, corpus: Path, seed: int) -> float:
    """The loss of the model in ``weights`` on the first step's batch of a 1-step pretraining run (4 blocks of 64
    tokens), computed apart from the script: litgpt's GPT loaded with torch.load, litgpt's cross-entropy on the
    whole logits. Only the batch comes from memfit's data code, which the run uses too."""
    import lightning as L
    from litgpt import GPT, Config, Tokenizer
    from litgpt.utils import chunked_cross_entropy

    from memfit.training.data import PlainText, build_dataloaders

    batches, *_ = build_dataloaders(
        L.Fabric(accelerator="cpu", devices=1),
        data=PlainText(path=corpus),
        tokenizer=Tokenizer(checkpoint_dir),
        micro_batch_size=4,
        max_seq_length=64,
        seed=seed,
        targets_fn=lambda batch: batch["input_ids"][:, 1:].numel(),
    )
    batches.place_longest(max_steps=1, accumulation=1, micro_batch_size=4, global_batch_size=4)
    input_ids = next(batches)["input_ids"]  # (4, 65): 64 inputs and the 64 targets shifted by one
    model = GPT(Config.from_file(checkpoint_dir / "model_config.yaml"))
    model.load_state_dict(torch.load(weights, weights_only=True))
    with torch.no_grad():
        return chunked_cross_entropy(model(input_ids[:, :-1]), input_ids[:, 1:]).item()


def test_initial_checkpoint_dir_starts_pretraining_from_its_weights(tmp_path, embedded, monkeypatch):
    """--initial_checkpoint_dir loads lit_model.pth: the first step's loss is the loaded model's loss on that step's
    batch, computed apart from the script (not a margin below a random model, which depends on how the CPU built
    the embedded default). A planted defect, the weights loaded and then initialised again, fails that comparison;
    a dir without weights is refused in one line."""
    from conftest import run_summary, tiny_train
    from memfit.args import ProfileArgs
    from memfit.errors import UserError

    checkpoint_dir, json_path = embedded
    pretrain = load_script("pretrain/pretrain.py")
    expected = _first_batch_loss_of_weights(
        checkpoint_dir / "lit_model.pth", checkpoint_dir, json_path.with_name("corpus.txt"), seed=1337
    )

    def first_loss(name: str) -> float:
        pretrain.setup(
            initial_checkpoint_dir=checkpoint_dir,
            out_dir=tmp_path / name / "out",
            profile_dir=tmp_path / name / "p",
            logger_name="csv",
            profile=ProfileArgs(enabled=False),
            seed=1337,
            train=tiny_train(max_steps=1, micro_batch_size=4, global_batch_size=4, max_seq_length=64),
        )
        return run_summary(tmp_path / name / "p")["first_loss"]

    assert first_loss("initial") == pytest.approx(expected, rel=1e-5, abs=1e-5)
    # the embedded model has read the corpus's prompts: its weights are worth far more than a random model's ln 1024
    # = 6.93 (4.08 on an AVX2 CPU, 4.17 from a model built with MKL and oneDNN held to SSE4, whose build differs)
    assert expected < math.log(1024) - 1.5, expected

    load_model = pretrain.load_model

    def load_then_initialise(*args, **kwargs):  # the planted defect: the loaded weights drawn over
        model = load_model(*args, **kwargs)
        model.apply(model._init_weights)
        return model

    monkeypatch.setattr(pretrain, "load_model", load_then_initialise)
    assert first_loss("defect") != pytest.approx(expected, rel=1e-3)
    monkeypatch.undo()
    with pytest.raises(
        UserError, match="--initial_checkpoint_dir .* has no lit_model.pth; give a litgpt checkpoint dir"
    ):
        pretrain.setup(initial_checkpoint_dir=tmp_path, out_dir=tmp_path / "x")
