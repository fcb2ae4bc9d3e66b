"""Each script's own train_step (the one its fit() runs and --estimate traces): accumulation is exact, every target
token weighs the same, and no_backward_sync wraps all but the last micro-batch. Run against every script, so a
change to one script's step that breaks this is caught there."""

import io
import math
import shutil
from contextlib import nullcontext, redirect_stderr
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, load_script, lora_run, run_script
from memfit.args import StepSettings

FINETUNE = SCRIPTS[:4]


def _model(script, checkpoint_dir):
    """The script's model as its main() builds it, with its trainable parameters moved off their zero init (LoRA's B
    and the adapter gates start at zero, which would leave the other half of each pair without gradient)."""
    import lightning as L
    import yaml

    from memfit.training.loading import init_from_seed, load_model, module_names

    module = load_script(script)
    options = yaml.safe_load((checkpoint_dir / "model_config.yaml").read_text())
    if script.endswith("lora.py"):
        options |= dict(lora_r=8, lora_query=True, lora_value=True, lora_dropout=0.0)
    elif "adapter" in script:
        options |= dict(adapter_prompt_length=4, adapter_start_layer=0)
    config = module.Config(**options)
    torch.manual_seed(0)
    weights = None if script.startswith("pretrain") else checkpoint_dir / "lit_model.pth"
    model = load_model(
        module.GPT,
        config,
        weights,
        dtype=torch.float32,
        device=torch.device("cpu"),
        new_parameters=("lora_A", "lora_B", "adapter_wte", "gating_factor", "adapter_bias", "adapter_scale"),
    )
    if weights is None:  # pretraining from scratch: drawn where main() draws it
        init_from_seed(model, module_names(model), 0, torch.device("cpu"))
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
    loss, norm = module.train_step(
        fabric, model, optimizer, micro_batches, shares, StepSettings(), lambda name: nullcontext(), 1
    )
    if record_sync is not None:
        del fabric.no_backward_sync
    assert model.training and all(p.grad is None for p in trainable.values())  # zero_grad(set_to_none) ran
    return float(loss), float(norm), {n: before[n] - p.detach() for n, p in trainable.items()}


@pytest.mark.slow
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
        micro = [{key: v[i * m : (i + 1) * m] for key, v in batch.items()} for i in range(k)]
        results[k] = _step(module, fabric, model, micro, calls)
        assert calls == [True] * (k - 1) + [False]
    (loss1, norm1, delta1), (loss4, norm4, delta4) = results[1], results[4]
    assert math.isclose(loss1, loss4, rel_tol=1e-5) and math.isclose(norm1, norm4, rel_tol=1e-4)
    assert delta1.keys() == delta4.keys() and delta1
    for name in delta1:
        assert delta1[name].abs().sum() > 0, name
        torch.testing.assert_close(delta4[name], delta1[name], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_nonfinite_loss_stops_before_the_weights_change(script, embedded, max_norm):
    """Also with --train.max_norm: Fabric's clipping raised its own RuntimeError on a non-finite norm, so such a run
    (pretraining's defaults) ended in a traceback instead of the one-line stop."""
    from memfit.training.loop_parts import TrainingDiverged

    checkpoint_dir, _ = embedded
    module, fabric, model = _model(script, checkpoint_dir)
    with torch.no_grad():  # an inf in a trainable weight makes the loss and its gradient non-finite
        next(p for p in model.parameters() if p.requires_grad).view(-1)[0] = float("inf")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ids = torch.randint(0, 800, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids} if script.startswith("pretrain") else {"input_ids": ids, "labels": ids.clone()}
    optimizer = fabric.setup_optimizers(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0))
    with pytest.raises(TrainingDiverged, match="non-finite .* at step 3: this run's updates made .* inf/NaN"):
        module.train_step(
            fabric, model, optimizer, [batch], [1.0], StepSettings(max_norm), lambda name: nullcontext(), 3
        )
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), before[name], equal_nan=True)


def test_adamw_on_float16_weights_takes_huge_steps_on_small_gradients_and_a_divergence_says_so():
    """Under --precision 16-true torch's AdamW keeps its state in float16, where its default eps (1e-8) and a small
    gradient's square are 0: the step is the gradient over eps alone. The warning and the divergence line name that
    (the full fine-tune of the embedded model went from loss 6.8 to 1059 in 20 steps; with eps 1e-4, to 3.6). Each
    kernel: float32 moves a weight lr a step; float16 with eps 1e-4 about as much; with the default eps, far more."""
    import lightning as L

    from memfit.training.loop_parts import TrainingDiverged, stop_if_diverged
    from memfit.training.optim import OPTIMIZERS, float16_adamw_warning, make_optimizer

    def moved(kernel, dtype, eps, steps=100):  # a steady gradient of 1e-4, as a rarely used weight gets
        weight = torch.nn.Parameter(torch.zeros(64, dtype=dtype))
        optimizer = make_optimizer(OPTIMIZERS[kernel], [weight], lr=1e-3, weight_decay=0.0, eps=eps)
        for _ in range(steps):
            weight.grad = torch.full_like(weight, 1e-4)
            optimizer.step()
        return float(weight.float().abs().max()), optimizer

    for kernel in ("AdamW", "AdamW-foreach", "AdamW-for-loop"):
        assert moved(kernel, torch.float32, 1e-8)[0] == pytest.approx(0.1, rel=1e-3), kernel  # lr a step
        assert not moved(kernel, torch.float16, 1e-8)[0] < 0.5, kernel  # fused: 0.66, the others inf
        assert 0.05 < moved(kernel, torch.float16, 1e-4)[0] < 0.11, kernel

    assert "eps 1e-08" in float16_adamw_warning("16-true", "AdamW-foreach", {})
    for precision, optimizer, args in [
        ("16-true", "AdamW", {"eps": 1e-4}),
        ("bf16-true", "AdamW", {}),
        ("16-mixed", "AdamW", {}),
        ("16-true", "AdamW8bit", {}),
        ("16-true", "SGD", {}),
    ]:
        assert float16_adamw_warning(precision, optimizer, args) is None, (precision, optimizer, args)

    fabric = L.Fabric(accelerator="cpu", devices=1)
    nan = torch.tensor(float("nan"))
    with pytest.raises(TrainingDiverged, match="AdamW's state is float16 .* eps 1e-08"):
        stop_if_diverged(fabric, torch.nn.Linear(2, 2), moved("AdamW", torch.float16, 1e-8, 1)[1], nan, nan, 5)
    with pytest.raises(TrainingDiverged, match="likely --train.lr 0.001 is too high"):
        stop_if_diverged(fabric, torch.nn.Linear(2, 2), moved("AdamW", torch.float32, 1e-8, 1)[1], nan, nan, 5)


@pytest.mark.slow
def test_a_loss_far_worse_than_guessing_stops_before_the_weights_change(embedded):
    """A finite loss can mean a destroyed model: 16-true AdamW took the embedded full fine-tune from 6.8 to 1059
    (ln 1024 = 6.93) and the run saved it as a success. After the first step, a loss over 3x a uniform guess's stops
    the run as a non-finite one does; on the first step it is the checkpoint's or the data's, and training goes on."""
    from memfit.training.loop_parts import TrainingDiverged

    checkpoint_dir, _ = embedded
    module, fabric, model = _model("finetune/full.py", checkpoint_dir)
    with torch.no_grad():  # confidently wrong: a finite loss far above ln(vocab)
        model.lm_head.weight.mul_(1000)
    ids = torch.randint(0, 800, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    optimizer = fabric.setup_optimizers(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-9))
    loss, _ = module.train_step(fabric, model, optimizer, [batch], [1.0], StepSettings(), lambda name: nullcontext(), 1)
    assert math.isfinite(float(loss)) and float(loss) > 3 * math.log(model.config.padded_vocab_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(
        TrainingDiverged, match=r"loss [0-9.]+, over 3x a uniform guess's \(ln 1024 = 6.93\), at step 2"
    ):
        module.train_step(fabric, model, optimizer, [batch], [1.0], StepSettings(), lambda name: nullcontext(), 2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name])


@pytest.mark.slow
@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_gradient_scaler_overflow_is_skipped_not_a_divergence(script, embedded, max_norm):
    """16-mixed (GPUs without bf16) scales the loss by 2**16 at first, and an overflow there is routine: the scaler's
    step skips the update and halves the scale. Memfit stopped such a run at the first overflow (exit 4, 'non-finite
    gradient norm'), and without --train.max_norm it logged the norm of the scaled gradients. The same plugin and
    scaler Fabric uses on CUDA run here on CPU, started at 2**24 so that the first steps overflow."""
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision

    checkpoint_dir, _ = embedded
    module, _, model = _model(script, checkpoint_dir)
    ids = torch.randint(0, 800, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids} if script.startswith("pretrain") else {"input_ids": ids, "labels": ids.clone()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    module.loss_fn(model, batch).backward()  # float32 gradients: what the norm should be
    reference = float(torch.nn.utils.get_total_norm([p.grad for p in trainable if p.grad is not None]))
    for p in trainable:
        p.grad = None
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(model.module)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(trainable, lr=1e-3))
    skipped, step = 0, 1
    while True:
        before = [p.detach().clone() for p in trainable]
        _, norm = module.train_step(
            fabric, model, optimizer, [batch], [1.0], StepSettings(max_norm), lambda name: nullcontext(), step
        )
        if all(torch.equal(b, p) for b, p in zip(before, trainable)):
            assert not math.isfinite(float(norm))  # skipped: the overflow, and nothing else
            skipped, step = skipped + 1, step + 1
            assert skipped < 20
            continue
        break
    assert skipped >= 1 and plugin.scaler.get_scale() < 2.0**24
    assert float(norm) == pytest.approx(reference, rel=0.05)  # unscaled, as float32 measures it


@pytest.mark.slow
def test_a_resume_under_16_mixed_restores_the_gradient_scaler(tmp_path, embedded):
    """The scale 16-mixed reached is part of the training state: a resume that started again at 2**16 would skip
    steps the uninterrupted run took. Saved in training_state.pth and restored into the resumed run's scaler."""
    import lightning as L
    from lightning.fabric.plugins.precision import MixedPrecision

    from memfit.training.checkpoint import load_for_resume, save_checkpoint

    checkpoint_dir, _ = embedded
    scalers = []
    for _ in range(2):  # the run, then its resumption
        module, _, model = _model("finetune/full.py", checkpoint_dir)
        scalers.append(torch.amp.GradScaler("cpu", init_scale=2.0**24))
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scalers[-1])])
        model = fabric.setup_module(model.module)
        optimizer = fabric.setup_optimizers(
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        )
        state = {"optimizer": optimizer}
        if len(scalers) == 1:
            ids = torch.randint(0, 800, (2, 17), generator=torch.Generator().manual_seed(0))
            for step in range(1, 4):  # the first ones overflow and lower the scale
                module.train_step(
                    fabric,
                    model,
                    optimizer,
                    [{"input_ids": ids, "labels": ids.clone()}],
                    [1.0],
                    StepSettings(),
                    lambda name: nullcontext(),
                    step,
                )
            assert scalers[0].get_scale() < 2.0**24
            save_checkpoint(fabric, tmp_path, "step-000003", "lit_model.pth", model, state, {})
        else:
            load_for_resume(fabric, tmp_path / "step-000003", "lit_model.pth", model, state)
    assert scalers[1].state_dict() == scalers[0].state_dict()


def test_16_mixed_gets_an_adamw_whose_gradients_lightning_can_unscale():
    """Fused AdamW unscales 16-mixed's gradients inside its step, and Lightning's precision plugin then refuses to
    unscale them for the norm or clipping: every 16-mixed run stopped at its first step on an H200. Under 16-mixed
    make_optimizer builds an AdamW the plugin unscales (its real GradScaler, on CPU here), and the fused one
    elsewhere."""
    from lightning.fabric.plugins.precision import MixedPrecision

    from memfit.training.optim import OPTIMIZERS, make_optimizer

    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.full((4,), 2.0**16)
    plugin = MixedPrecision("16-mixed", "cpu")
    plugin.scaler.scale(torch.ones(()))  # a step's loss, scaled: the scaler's scale exists from then on
    with pytest.raises(NotImplementedError, match="optimizers handling the unscaling"):
        plugin.unscale_gradients(make_optimizer(OPTIMIZERS["AdamW"], [weight], 1e-3, 0.0, precision="bf16-true"))
    optimizer = make_optimizer(OPTIMIZERS["AdamW"], [weight], 1e-3, 0.0, precision="16-mixed")
    plugin.unscale_gradients(optimizer)
    assert torch.equal(weight.grad, torch.ones(4))  # divided by the scaler's initial scale, 2**16


@pytest.mark.slow
def test_divergence_stops_at_that_step_and_keeps_the_last_good_checkpoint(tmp_path, embedded):
    result = run_script(
        "finetune/lora.py",
        "--train.lr",
        "1e6",
        "--train.save_interval",
        "1",
        "--train.max_steps",
        "20",
        "--profile.enabled",
        "false",
        "--logger_name",
        "csv",
        cwd=tmp_path,
    )
    assert result.returncode == 4, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "non-finite" in error[0] and "--train.lr 1000000.0 is too high" in error[0], error
    assert "check the checkpoint" not in error[0]  # the weights this run's own updates broke are not the base's
    step = int(error[0].split(" at step ")[1].split(":")[0])
    out = tmp_path / "out/finetune/lora"
    assert not (out / "final").exists()
    saved = sorted(p.name for p in out.glob("step-*"))
    assert saved == [f"step-{s:06d}" for s in range(1, step)]  # every good step, nothing from the bad one
    for name in saved:
        weights = torch.load(out / name / "lit_model.pth.lora", weights_only=True)["model"]
        assert all(torch.isfinite(v).all() for v in weights.values()), name
    assert f"the latest checkpoint is {Path('out/finetune/lora') / saved[-1]}" in result.stderr


@pytest.mark.slow
def test_nan_in_the_base_weights_is_named_at_step_one(tmp_path, embedded):
    source, _ = embedded
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    state = torch.load(ckpt / "lit_model.pth", weights_only=True)
    state["transformer.h.2.mlp.fc_1.weight"][3, 5] = float("nan")
    torch.save(state, ckpt / "lit_model.pth")
    from memfit.training.data import embedded_data

    with pytest.raises(SystemExit) as exit_info, redirect_stderr(io.StringIO()) as err:
        lora_run(tmp_path, checkpoint_dir=ckpt, data=embedded_data(embedded[1]))
    assert exit_info.value.code == 4
    assert "at step 1: the weights hold inf/NaN (transformer.h.2.mlp.fc_1." in err.getvalue(), err.getvalue()
    assert err.getvalue().rstrip().endswith("Nothing was saved for that step; no checkpoint was written before it.")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
