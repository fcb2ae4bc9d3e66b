"""Each script's own train_step (the one its fit() runs and --estimate traces): accumulation is exact, every target
token weighs the same, and no_backward_sync wraps all but the last micro-batch. Run against every script, so a
change to one script's step that breaks this is caught there."""

import math
from contextlib import nullcontext

import pytest
import torch

from conftest import SCRIPTS, load_script

FINETUNE = SCRIPTS[:4]


def _model(script, checkpoint_dir):
    """The script's model as its main() builds it, with its trainable parameters moved off their zero init (LoRA's B
    and the adapter gates start at zero, which would leave the other half of each pair without gradient)."""
    import lightning as L
    import yaml

    from memfit.loading import load_model

    module = load_script(script)
    options = yaml.safe_load((checkpoint_dir / "model_config.yaml").read_text())
    if script.endswith("lora.py"):
        options |= dict(lora_r=8, lora_query=True, lora_value=True, lora_dropout=0.0)
    elif "adapter" in script:
        options |= dict(adapter_prompt_length=4, adapter_start_layer=0)
    config = module.Config(**options)
    torch.manual_seed(0)
    weights = None if script.startswith("pretrain") else checkpoint_dir / "lit_model.pth"
    model = load_model(module.GPT, config, weights, dtype=torch.float32, device=torch.device("cpu"),
                       new_parameters=("lora_A", "lora_B", "adapter_wte", "gating_factor", "adapter_bias",
                                       "adapter_scale"))
    mark = getattr(module, "mark_trainable", None) or getattr(module, "mark_only_lora_as_trainable", None)
    if mark is not None:
        mark(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or "gating_factor" in name):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    return module, fabric, fabric.setup_module(model)


def _step(module, fabric, model, micro_batches, record_sync=None):
    """One train_step with plain SGD at lr 1: the parameters move by exactly minus the step's gradient."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = fabric.setup_optimizers(torch.optim.SGD(trainable.values(), lr=1.0))
    counts = [module.target_tokens(batch) for batch in micro_batches]
    shares = [count / sum(counts) for count in counts]
    if record_sync is not None:
        original = fabric.no_backward_sync

        def recording(module_, enabled=True):
            record_sync.append(enabled)
            return original(module_, enabled=enabled)

        fabric.no_backward_sync = recording
    loss, norm = module.train_step(fabric, model, optimizer, micro_batches, shares, None, lambda name: nullcontext(), 1)
    if record_sync is not None:
        del fabric.no_backward_sync
    assert model.training and all(p.grad is None for p in trainable.values())  # zero_grad(set_to_none) ran
    return float(loss), float(norm), {n: before[n] - p.detach() for n, p in trainable.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_accumulated_step_equals_one_big_batch(script, embedded):
    """k micro-batches of m take the optimizer step of one batch of k*m, with no_backward_sync around the first k-1."""
    checkpoint_dir, _ = embedded
    generator = torch.Generator().manual_seed(0)
    # equal-length samples, every token a target: the big batch's mean loss is the mean of the micro-batch means
    ids = torch.randint(0, 800, (8, 25 if script.startswith("pretrain") else 24), generator=generator)
    batch = {"input_ids": ids} if script.startswith("pretrain") else {"input_ids": ids, "labels": ids.clone()}
    results = {}
    for k in (1, 4):
        module, fabric, model = _model(script, checkpoint_dir)
        m = 8 // k
        calls = []
        micro = [{key: v[i * m:(i + 1) * m] for key, v in batch.items()} for i in range(k)]
        results[k] = _step(module, fabric, model, micro, calls)
        assert calls == [True] * (k - 1) + [False]
    (loss1, norm1, delta1), (loss4, norm4, delta4) = results[1], results[4]
    assert math.isclose(loss1, loss4, rel_tol=1e-5) and math.isclose(norm1, norm4, rel_tol=1e-4)
    assert delta1.keys() == delta4.keys() and delta1
    for name in delta1:
        assert delta1[name].abs().sum() > 0, name
        torch.testing.assert_close(delta4[name], delta1[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("script", FINETUNE)
def test_every_target_token_weighs_the_same_with_uneven_masks_and_lengths(script, embedded):
    """Two micro-batches with 3 and 40 target tokens step as one batch holding both (the mean over all 43 target
    tokens), not as the mean of the two micro-batch means."""
    from litgpt.utils import chunked_cross_entropy

    checkpoint_dir, _ = embedded
    g = torch.Generator().manual_seed(0)
    short = torch.randint(0, 800, (1, 12), generator=g)
    long = torch.randint(0, 800, (1, 48), generator=g)
    short_labels = torch.full_like(short, -100)
    short_labels[0, -3:] = short[0, -3:]  # 3 targets
    long_labels = long.clone()
    long_labels[0, :8] = -100  # 40 targets: labels 8..47 (label 0 is never predicted)
    micro = [{"input_ids": short, "labels": short_labels}, {"input_ids": long, "labels": long_labels}]
    module, fabric, model = _model(script, checkpoint_dir)
    assert [module.target_tokens(b) for b in micro] == [3, 40]

    # the reference: one batch, the short sample padded at the end (causal attention: padding changes no earlier
    # logit), its mean over all 43 targets, and the SGD step it gives
    reference_module, reference_fabric, reference = _model(script, checkpoint_dir)
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([torch.nn.functional.pad(short, (0, pad)), long])
    labels = torch.cat([torch.nn.functional.pad(short_labels, (0, pad), value=-100), long_labels])
    logits = reference(ids)
    expected_loss = chunked_cross_entropy(logits[..., :-1, :], labels[..., 1:])
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters() if p.requires_grad}

    loss, _, delta = _step(module, fabric, model, micro)
    assert math.isclose(loss, expected_loss.item(), rel_tol=1e-5)
    for name, grad in expected.items():
        # atol: the step is read back as a difference of weights, exact to float32 rounding of the weights
        torch.testing.assert_close(delta[name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_nonfinite_loss_stops_before_the_weights_change(script, embedded):
    from memfit.training import TrainingDiverged

    checkpoint_dir, _ = embedded
    module, fabric, model = _model(script, checkpoint_dir)
    with torch.no_grad():  # an inf in a trainable weight makes the loss and its gradient non-finite
        next(p for p in model.parameters() if p.requires_grad).view(-1)[0] = float("inf")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.randint(0, 800, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids} if script.startswith("pretrain") else {"input_ids": ids, "labels": ids.clone()}
    optimizer = fabric.setup_optimizers(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0))
    with pytest.raises(TrainingDiverged, match="non-finite .* at step 3: the weights hold inf/NaN"):
        module.train_step(fabric, model, optimizer, [batch], [1.0], None, lambda name: nullcontext(), 3)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), before[name], equal_nan=True)
