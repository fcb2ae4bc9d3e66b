"""The optimizer registry (memfit.training.optim.OPTIMIZERS): --optimizer's choices come from it, each entry builds what
it says, litgpt's class paths resolve to it, and an optimizer the estimate cannot model is refused."""

import dataclasses
import inspect
import warnings

import pytest
import torch

from conftest import SCRIPTS, load_script, quiet, tiny_train
from memfit.errors import UserError
from memfit.settings.cli import choices
from memfit.training.optim import OPTIMIZERS, OptimizerChoice, build_optimizer, make_optimizer, resolve_optimizer


def test_the_flag_choices_are_the_registry():
    assert list(OptimizerChoice.__args__) == list(OPTIMIZERS)
    for script in SCRIPTS:
        parameters = inspect.signature(load_script(script).setup, eval_str=True).parameters
        assert choices(parameters["optimizer"].annotation) == list(OPTIMIZERS), script


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_builds_what_its_entry_says(name):
    kind = OPTIMIZERS[name]
    weight = torch.nn.Parameter(torch.randn(64, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: "Paged optimizers are not supported on CPU"
        optimizer = make_optimizer(OPTIMIZERS[name], [weight], lr=1e-3, weight_decay=0.0, precision="32-true")
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
    foreach = make_optimizer(OPTIMIZERS["AdamW-foreach"], [weight], 1e-3, 0.0).defaults
    for_loop = make_optimizer(OPTIMIZERS["AdamW-for-loop"], [weight], 1e-3, 0.0).defaults
    fused = make_optimizer(OPTIMIZERS["AdamW"], [weight], 1e-3, 0.0).defaults
    under_16_mixed = make_optimizer(OPTIMIZERS["AdamW"], [weight], 1e-3, 0.0, precision="16-mixed").defaults
    assert (foreach["foreach"], for_loop["foreach"], fused["fused"]) == (True, False, True)
    assert not under_16_mixed["fused"] and under_16_mixed["foreach"]  # Lightning's scaler must unscale it


@pytest.mark.slow
def test_an_optimizer_the_estimate_cannot_model_is_refused(tmp_path, monkeypatch, embedded):
    """An entry with no traced_as trains, but --estimate says it cannot price it instead of tracing it as AdamW."""
    import memfit.training.optim

    unmodelled = dataclasses.replace(OPTIMIZERS["SGD"], name="Unmodelled", traced_as=None, class_paths=())
    monkeypatch.setitem(memfit.training.optim.OPTIMIZERS, "Unmodelled", unmodelled)
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


def test_in_backward_steps_each_parameter_from_its_gradient_hook():
    """build_optimizer (the run's and the estimate's) with in_backward: one optimizer per parameter, stepped as its
    gradient is complete and the gradient freed, the same update as stepping after backward."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(2)]
    twins = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    inputs = torch.randn(4, 8)
    hooked = build_optimizer(OPTIMIZERS["AdamW"], weights, 1e-2, 0.0, in_backward=True, precision="32-true")
    after = build_optimizer(OPTIMIZERS["AdamW"], twins, 1e-2, 0.0, in_backward=False, precision="32-true")
    (inputs @ weights[0] @ weights[1]).sum().backward()
    assert all(w.grad is None for w in weights)  # stepped and freed inside backward
    (inputs @ twins[0] @ twins[1]).sum().backward()
    after.step()
    for weight, twin in zip(weights, twins):
        torch.testing.assert_close(weight, twin)
    hooked.step()  # a no-op for the loop: the hooks stepped
    torch.testing.assert_close(weights[0], twins[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_registered_optimizer_is_estimated_or_refused_in_one_line(tmp_path, embedded, name, capsys):
    """A registry entry can break the estimate (torch's Adafactor traced as itself raised inside its step): each
    entry's --estimate prints a predicted peak, or is refused with one UserError, never a traceback."""
    lora = load_script("finetune/lora.py")
    try:
        lora.setup(estimate=True, optimizer=name, train=tiny_train(), out_dir=tmp_path / "out")
    except UserError as refused:
        assert "--estimate cannot model" in str(refused), refused
        return
    assert "Predicted peak: " in capsys.readouterr().out
