"""--activation_offloading (``memfit.training.activation_offload``): the saved activations really go to the host and
come back, training is unchanged, the estimate moves them off the device, and a CPU run refuses it in one line."""

import dataclasses

import pytest
import torch

from conftest import cuda, load_script, one_process_plan


def _tiny_gpt(seed: int = 0):
    from litgpt import GPT, Config

    torch.manual_seed(seed)
    config = Config(
        block_size=64,
        vocab_size=128,
        padded_vocab_size=128,
        n_layer=3,
        n_head=4,
        n_query_groups=2,
        n_embd=64,
        intermediate_size=128,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    return GPT(config)


def _gradients(model, tokens, hooks=None) -> dict:
    model.zero_grad(set_to_none=True)
    with hooks if hooks is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_saved_activations_go_to_the_host_and_back_and_the_gradients_are_the_same():
    """The hooks take the copies a GPU run takes, here from CPU tensors: the gradients equal the unhooked ones to the
    bit, the activations were really copied (and no parameter was)."""
    from memfit.training.activation_offload import OffloadedActivations

    model = _tiny_gpt()
    tokens = torch.randint(0, 128, (4, 33))
    plain = _gradients(model, tokens)
    hooks = OffloadedActivations(from_devices=("cpu",))
    offloaded = _gradients(model, tokens, hooks)
    assert hooks.moved > 4 * 32 * 64 * 4 * 3  # at least each block's input, in float32
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert hooks.moved < 40 * parameter_bytes  # activations of 128 tokens, not copies of the weights over and over
    for name in plain:
        assert torch.equal(plain[name], offloaded[name]), name


@pytest.mark.slow
def test_the_estimate_moves_the_activations_to_the_host_and_the_planner_prices_their_transfer(embedded):
    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.prediction.estimate import estimate
    from memfit.prediction.planner import slowdown, spill_seconds
    from memfit.settings.run import ScriptStep

    config = Config.from_file(embedded[0] / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
    script = ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, load_script("finetune/lora.py").train_step)
    plan = one_process_plan(micro_batch_size=4, accumulation=2, sequence_length=96, precision="bf16-true")
    kept = estimate(script, plan)
    moved = estimate(script, dataclasses.replace(plan, activation_offloading=True))
    for phase in ("forward", "backward"):
        saved = kept.phases[phase]["roles"]["activations"]
        assert moved.phases[phase]["roles"]["activations"] == saved // 4  # one of the 4 blocks' on the device
        assert moved.phases[phase]["peak"] == kept.phases[phase]["peak"] - saved + saved // 4
    assert moved.host["activations"] == kept.phases["forward"]["roles"]["activations"]
    assert spill_seconds(moved, 2**30) > 0 and slowdown(moved, kept, 2**30) > 1
    assert "--activation_offloading true" in moved.plan.as_flags()


@pytest.mark.slow
def test_a_cpu_run_refuses_activation_offloading_in_one_line(tmp_path, embedded):
    from conftest import run_in_process

    result = run_in_process("finetune/lora.py", "--accelerator", "cpu", "--activation_offloading", "true", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: --activation_offloading true moves saved")
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


@cuda
@pytest.mark.cuda
def test_offloading_lowers_the_device_peak_by_the_activations_and_trains_the_same():
    """On a GPU: the peak allocated in forward and backward falls by most of the activations, gradients equal."""
    from memfit.training.activation_offload import OffloadedActivations

    model = _tiny_gpt().cuda()
    tokens = torch.randint(0, 128, (64, 65), device="cuda")

    def peak(hooks=None):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = _gradients(model, tokens, hooks)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, grads

    kept, plain = peak()
    hooks = OffloadedActivations()
    moved, offloaded = peak(hooks)
    print(f"peak above the weights: kept {kept:,} B, offloaded {moved:,} B, moved to the host {hooks.moved:,} B")
    assert kept - moved > 0.5 * hooks.moved
    # not to the bit: CUDA's embedding backward adds with atomics in no fixed order (two plain runs differ too)
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
