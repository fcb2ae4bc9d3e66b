"""Memory-efficient loading: meta device, torch.load(mmap=True, weights_only=True), load_state_dict(assign=True)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT

LORA = ("lora_A", "lora_B")  # the parameters a base checkpoint lacks


@pytest.mark.slow
def test_memfit_load_equals_litgpt_load(embedded):
    from litgpt.lora import GPT, Config

    from memfit.training.loading import load_model

    checkpoint_dir, _ = embedded
    config = Config.from_file(checkpoint_dir / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
    torch.manual_seed(0)
    reference = GPT(config)  # the ordinary way: full init, then copy the weights in
    reference.load_state_dict(torch.load(checkpoint_dir / "lit_model.pth", weights_only=True), strict=False)
    model = load_model(
        GPT,
        config,
        checkpoint_dir / "lit_model.pth",
        dtype=torch.float32,
        device=torch.device("cpu"),
        new_parameters=("lora_A", "lora_B"),
    )
    # LoRA B starts at zero, so outputs depend on the base weights alone
    x = torch.randint(0, 800, (2, 32))
    torch.testing.assert_close(model(x), reference(x))
    assert not any(p.is_meta for p in model.parameters())
    assert {n for n, p in model.named_parameters()} == {n for n, p in reference.named_parameters()}


@pytest.mark.slow
def test_quantized_load_is_close_to_full_precision(embedded):
    from litgpt.lora import GPT, Config

    from memfit.training.loading import load_model
    from memfit.training.quantizers import QUANTIZERS

    checkpoint_dir, _ = embedded
    config = Config.from_file(checkpoint_dir / "model_config.yaml", lora_r=8)
    path = checkpoint_dir / "lit_model.pth"
    x = torch.randint(0, 800, (2, 32))
    full = load_model(GPT, config, path, dtype=torch.float32, device=torch.device("cpu"), new_parameters=LORA)(x)
    for mode in ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq"):
        model = load_model(
            GPT,
            config,
            path,
            dtype=torch.float32,
            device=torch.device("cpu"),
            quantize=QUANTIZERS[mode],
            new_parameters=LORA,
        )
        import bitsandbytes as bnb

        linears = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert linears and all(m.weight.dtype == torch.uint8 for m in linears)
        out = model(x)
        # 4-bit weights perturb logits a little, but the prediction stays mostly the same
        agreement = (out.argmax(-1) == full.argmax(-1)).float().mean().item()
        assert agreement > 0.5, (mode, agreement)
        assert not torch.allclose(out, full)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A bf16 Llama-shaped checkpoint of ~230 MB with random weights (values do not matter for memory)."""
    from litgpt import GPT, Config

    directory = tmp_path_factory.mktemp("big")
    config = dict(
        name="big-llama",
        block_size=256,
        vocab_size=32000,
        padded_vocab_size=32000,
        n_layer=10,
        n_head=8,
        n_query_groups=8,
        n_embd=1024,
        intermediate_size=2816,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    (directory / "model_config.yaml").write_text(yaml.safe_dump(config))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(Config(**config)).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=generator) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    torch.save(state, directory / "lit_model.pth")
    del state
    assert (directory / "lit_model.pth").stat().st_size > 200e6
    return directory


def _probe(mode: str, checkpoint_dir: Path) -> float:
    """The loading benchmark's own probe (benchmarks/loading.py), in a fresh process: RssAnon added / file size."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/loading.py"), "--probe", mode, str(checkpoint_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["anon_added_peak_bytes"] / (checkpoint_dir / "lit_model.pth").stat().st_size


def test_loading_adds_little_anonymous_memory(big_checkpoint):
    mmap_assign = _probe("memfit", big_checkpoint)
    nf4 = _probe("memfit_nf4", big_checkpoint)
    plain = _probe("plain", big_checkpoint)
    print(
        f"RssAnon added while loading, as a fraction of the file: mmap+assign {mmap_assign:.1%}, "
        f"nf4 {nf4:.1%}, plain torch.load+load_state_dict {plain:.1%}"
    )
    assert mmap_assign < 0.10
    assert nf4 < 0.40
    assert plain >= 1.00


@pytest.mark.slow
def test_random_checkpoint_is_complete_and_reused(tmp_path, embedded):
    """The GPU benchmarks share one random-weight checkpoint per architecture: it loads into its architecture, it is
    written under another name first (no half-written lit_model.pth), and a second call reuses it."""
    from litgpt import GPT, Config

    from memfit.training.random_checkpoints import random_checkpoint

    changes = {"name": "pythia-14m-2-layers", "n_layer": 2}
    checkpoint = random_checkpoint("pythia-14m", tmp_path, **changes)
    assert checkpoint == tmp_path / "pythia-14m-2-layers"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "lit_model.pth",
        "model_config.yaml",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = Config.from_file(checkpoint / "model_config.yaml")
    assert config.n_layer == 2
    model = GPT(config)
    model.load_state_dict(torch.load(checkpoint / "lit_model.pth", weights_only=True, mmap=True), strict=True)
    # a network that can train: its logits depend on the input, and every block gets a gradient
    x = torch.randint(0, 100, (2, 8))
    logits = model(x)
    assert logits.std() > 0.01 and not torch.allclose(logits[0], logits[1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in model.named_parameters()
        if n.endswith(".weight") and "transformer.h." in n
    ), "a block gets no gradient"
    written = (checkpoint / "lit_model.pth").stat().st_mtime_ns
    assert random_checkpoint("pythia-14m", tmp_path, **changes) == checkpoint
    assert (checkpoint / "lit_model.pth").stat().st_mtime_ns == written


def test_init_from_seed_draws_the_same_whole_or_unit_by_unit():
    """Pretraining's initialisation (litgpt's initialize_weights, then ``init_from_seed``) gives the same weights to
    one process, which draws the whole model at once, and to an FSDP rank, which draws a unit at a time in another
    order (the blocks last to first, the final norm, then the rest) with checkpoint wrappers around the blocks; the tied
    embedding and head stay one parameter; another seed draws other values; the global generator is left where it
    was."""
    from lightning.fabric import Fabric
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    from memfit.training.loading import apply_activation_checkpointing, init_from_seed, module_names

    config = Config.from_name("pythia-14m", n_layer=2, vocab_size=64, padded_vocab_size=64)

    def built(tie: bool):
        with torch.device("meta"):
            model = GPT(config)
        initialize_weights(Fabric(accelerator="cpu", devices=1), model, n_layer=config.n_layer, n_embd=config.n_embd)
        if tie:
            model.transformer.wte.weight = model.lm_head.weight
        return model

    before = torch.random.get_rng_state()
    whole = built(tie=True)
    init_from_seed(whole, module_names(whole), 7, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert whole.transformer.wte.weight is whole.lm_head.weight

    units = built(tie=True)
    apply_activation_checkpointing(units, type(units.transformer.h[0]))
    names = module_names(units)
    for unit in [*reversed(list(units.transformer.h)), units.transformer.ln_f, units]:
        init_from_seed(unit, names, 7, torch.device("cpu"))
    assert units.transformer.wte.weight is units.lm_head.weight
    drawn = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in units.state_dict().items()}
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, drawn[name]), name

    other = built(tie=False)
    init_from_seed(other, module_names(other), 8, torch.device("cpu"))
    assert not torch.equal(other.transformer.h[0].attn.qkv.weight, whole.transformer.h[0].attn.qkv.weight)
    std = whole.transformer.h[0].attn.qkv.weight.std().item()
    assert abs(std - (2.0 / 5 / config.n_embd) ** 0.5) < 0.1 * std  # litgpt's GPT-NeoX init, not torch's default
