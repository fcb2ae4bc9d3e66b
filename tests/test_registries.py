"""The optimizer and quantization registries (memfit.optim.OPTIMIZERS, memfit.quantizers.QUANTIZERS): the flags'
choices come from them, each entry builds what it says, and what the estimate cannot model is refused."""

import dataclasses
import warnings

import pytest
import torch

from conftest import SCRIPTS, load_script, quiet, tiny_train
from memfit.args import OptimizerChoice
from memfit.cli import choices
from memfit.errors import UserError
from memfit.optim import OPTIMIZERS, make_optimizer, resolve_optimizer
from memfit.precision import QuantizeChoice, check_combination
from memfit.quantizers import QUANTIZERS


def test_the_flags_choices_are_the_registries():
    assert list(OptimizerChoice.__args__) == list(OPTIMIZERS)
    assert list(QuantizeChoice.__args__) == list(QUANTIZERS)
    for script in SCRIPTS:
        parameters = load_script(script).setup.__annotations__
        assert choices(eval(parameters["optimizer"], vars(load_script(script)))) == list(OPTIMIZERS), script


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_builds_what_its_entry_says(name):
    kind = OPTIMIZERS[name]
    weight = torch.nn.Parameter(torch.randn(64, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: "Paged optimizers are not supported on CPU"
        optimizer = make_optimizer(name, [weight], lr=1e-3, weight_decay=0.0, device="cpu", precision="32-true")
        weight.grad = torch.ones_like(weight)
        before = weight.detach().clone()
        optimizer.step()
    assert not torch.equal(before, weight.detach())  # it steps
    assert kind.torch_adamw == isinstance(optimizer, torch.optim.AdamW)
    assert (kind.bitsandbytes_state is not None) == type(optimizer).__module__.startswith("bitsandbytes")
    for class_path in kind.class_paths:  # litgpt's blocks name it
        assert resolve_optimizer({"class_path": class_path})[0] == name


def test_adamw_kernels_are_the_ones_named():
    weight = torch.nn.Parameter(torch.randn(4))
    foreach = make_optimizer("AdamW-foreach", [weight], 1e-3, 0.0, "cpu").defaults
    for_loop = make_optimizer("AdamW-for-loop", [weight], 1e-3, 0.0, "cpu").defaults
    fused = make_optimizer("AdamW", [weight], 1e-3, 0.0, "cpu").defaults
    under_16_mixed = make_optimizer("AdamW", [weight], 1e-3, 0.0, "cpu", precision="16-mixed").defaults
    assert (foreach["foreach"], for_loop["foreach"], fused["fused"]) == (True, False, True)
    assert not under_16_mixed["fused"] and under_16_mixed["foreach"]  # Lightning's scaler must unscale it


def test_an_optimizer_the_estimate_cannot_model_is_refused(tmp_path, monkeypatch, embedded):
    """An entry with no traced_as trains, but --estimate says it cannot price it instead of tracing it as AdamW."""
    import memfit.optim

    unmodelled = dataclasses.replace(OPTIMIZERS["SGD"], name="Unmodelled", traced_as=None, class_paths=())
    monkeypatch.setitem(memfit.optim.OPTIMIZERS, "Unmodelled", unmodelled)
    lora = load_script("finetune/lora.py")
    with pytest.raises(UserError, match="--estimate cannot model --optimizer Unmodelled"):
        lora.setup(estimate=True, optimizer="Unmodelled", train=tiny_train(), out_dir=tmp_path / "out")
    record = lora.setup(
        optimizer="Unmodelled",
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        **quiet(train=tiny_train(max_steps=2)),
    )
    assert len(record.losses) == 2


def test_each_quantizer_stores_what_its_entry_says():
    """The stored bytes an entry prices against what its library stores for one layer."""
    from memfit.quantize import replace_linear_layers

    numel = 256 * 512
    for kind in QUANTIZERS.values():
        if kind.library != "bitsandbytes" or kind.bits != 4:
            continue
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(512, 256, bias=False))
        weights = torch.randn(256, 512)
        replace_linear_layers(model, kind.mode, torch.float32, torch.device("cpu"))
        model.load_state_dict({"0.weight": weights}, assign=True)
        layer = model[0]
        stored = layer.weight.untyped_storage().nbytes()
        state = layer.weight.quant_state
        stored += state.absmax.untyped_storage().nbytes()
        if state.nested:  # double quantization: the scales' own scales
            stored += state.state2.absmax.untyped_storage().nbytes()
        assert kind.stored_bytes(numel) == pytest.approx(stored, rel=0.01, abs=64), kind.name


def test_a_quantizer_that_needs_a_precision_says_so():
    needy = [kind for kind in QUANTIZERS.values() if kind.needs_precision]
    assert needy  # bnb.int8-training: bitsandbytes' int8 computes in float16
    for kind in needy:
        check_combination(kind.needs_precision, kind.name)
        other = "bf16-true" if kind.needs_precision != "bf16-true" else "32-true"
        with pytest.raises(UserError, match=f"--quantize {kind.name} needs --precision {kind.needs_precision}"):
            check_combination(other, kind.name)
    with pytest.raises(UserError, match="--quantize 'bnb.nf3' is not one of bnb.nf4"):
        check_combination("bf16-true", "bnb.nf3")
