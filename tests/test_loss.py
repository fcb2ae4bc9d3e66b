"""memfit.training.loss: the same loss and gradients as litgpt's chunked head and cross-entropy, with far less
memory."""

import json

import lightning as L
import pytest
import torch
from litgpt.lora import GPT, Config

import memfit.training.loss
from conftest import published_benchmark
from memfit.training.loss import next_token_loss, rows_per_chunk


def _fabric_model(precision: str, head_trains: bool = True, **options):
    """Every parameter trains (full fine-tuning, the head's LoRA too), or only LoRA's, on q and v (the head is
    frozen: LoRA's usual settings)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    torch.manual_seed(0)
    config = Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=512,
        vocab_size=1000,
        padded_vocab_size=1024,
        lora_r=4,
        lora_alpha=8,
        lora_query=True,
        lora_value=True,
        lora_head=head_trains,
        **options,
    )
    with fabric.init_module():
        model = GPT(config)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # off its zero init, so lora_A gets a gradient too
            torch.nn.init.normal_(param, std=0.02)
        param.requires_grad = head_trains or "lora_" in name
    return fabric, fabric.setup_module(model)


def _litgpt_loss(model, input_ids, labels):
    """litgpt's fine-tuning loss, as the published-figures benchmark models it."""
    return published_benchmark().litgpt_loss(model, {"input_ids": input_ids, "labels": labels})


def _loss_and_grads(fabric, model, loss_fn):
    model.zero_grad()
    loss = loss_fn()
    fabric.backward(loss)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("length, softcap", [(300, None), (257, None), (129, 30.0), (100, None)])
@pytest.mark.parametrize("head_trains", [True, False], ids=["head-trains", "head-frozen"])
def test_same_loss_and_gradients_as_litgpt(precision, length, softcap, head_trains):
    """Lengths around the chunk boundaries (257 = 2 x 128 + 1: litgpt's last chunk has no target), Gemma 2's final
    soft-capping, which GPT.forward applies after the head, and both ways backward goes (recomputed logits for a head
    that trains, gradients taken in forward for a frozen one)."""
    fabric, model = _fabric_model(precision, head_trains, final_logit_softcapping=softcap)
    ids = torch.randint(0, 1000, (3, length))
    labels = ids.clone()
    labels[:, :10] = -100  # a masked prompt
    theirs, their_grads = _loss_and_grads(fabric, model, lambda: _litgpt_loss(model, ids, labels))
    ours, our_grads = _loss_and_grads(fabric, model, lambda: next_token_loss(model, ids, labels[..., 1:]))
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert our_grads.keys() == their_grads.keys()
    assert len(our_grads) == (34 if head_trains else 4)  # all, or LoRA's A and B on the two layers' qkv
    assert ("_forward_module.lm_head.linear.weight" in our_grads) == head_trains
    tolerance = dict(rtol=1e-4, atol=1e-6) if precision == "32-true" else dict(rtol=2e-2, atol=2e-4)
    for name in their_grads:
        torch.testing.assert_close(our_grads[name], their_grads[name], **tolerance, msg=name)
    assert model.lm_head.forward.__func__ is type(model.lm_head).forward  # the head is itself again
    assert model.config.final_logit_softcapping == softcap
    with torch.no_grad():  # validation takes the path without checkpointing
        torch.testing.assert_close(next_token_loss(model, ids, labels[..., 1:]), theirs, rtol=1e-6, atol=1e-6)


def test_recomputed_head_sees_the_same_dropout(monkeypatch):
    """LoRA on the head with dropout: backward recomputes a head that trains, and must draw the same dropout mask as
    forward (the gradients equal a run without recomputation)."""
    fabric, model = _fabric_model("32-true", lora_dropout=0.5)
    ids = torch.randint(0, 1000, (2, 300))  # 598 targets: three chunks
    torch.manual_seed(1)
    recomputed, recomputed_grads = _loss_and_grads(fabric, model, lambda: next_token_loss(model, ids, ids[..., 1:]))
    monkeypatch.setattr(memfit.training.loss, "checkpoint", lambda function, *args, use_reentrant: function(*args))
    torch.manual_seed(1)
    kept, kept_grads = _loss_and_grads(fabric, model, lambda: next_token_loss(model, ids, ids[..., 1:]))
    assert recomputed == kept
    for name in kept_grads:
        torch.testing.assert_close(recomputed_grads[name], kept_grads[name], rtol=0, atol=0, msg=name)


def _peak_allocated(function, tmp_path) -> int:
    """The CPU allocator's peak during ``function``, above what was allocated when it started: the profiler's
    memory events, each carrying the running total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    totals = [
        e["args"]["Total Allocated"]
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("name") == "[memory]"
    ]
    return max(totals) - totals[0]


@pytest.mark.parametrize("head_trains", [False, True], ids=["lora", "full"])
def test_the_logits_never_exist_whole(tmp_path, head_trains):
    """A vocabulary large against the model (as real ones are): litgpt's path holds every chunk of float32 logits,
    its reshaped copy and the log-softmax at once; Memfit's holds a chunk's worth, whichever way backward goes."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    config = Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=512,
        vocab_size=16384,
        padded_vocab_size=16384,
        lora_r=4,
        lora_query=True,
        lora_value=True,
    )
    with fabric.init_module():
        model = GPT(config)
    for name, param in model.named_parameters():
        param.requires_grad = head_trains or "lora_" in name
    model = fabric.setup_module(model)
    ids = torch.randint(0, 16384, (4, 512))
    float32_logits = ids.numel() * config.padded_vocab_size * 4  # 128 MiB
    theirs = _peak_allocated(lambda: fabric.backward(_litgpt_loss(model, ids, ids)), tmp_path)
    ours = _peak_allocated(lambda: fabric.backward(next_token_loss(model, ids, ids[..., 1:])), tmp_path)
    assert theirs > 2 * float32_logits  # the cost being removed is there to remove
    chunk = rows_per_chunk(ids.numel(), config.n_embd, config.padded_vocab_size) * config.padded_vocab_size * 4
    assert chunk == float32_logits // 8
    # a few chunk-sized buffers at a time (logits, log-softmax, their gradients) and the blocks' activations
    assert ours < 4 * chunk and ours < theirs / 4, (ours / 2**20, theirs / 2**20)  # measured: 54 and 293 MiB


@pytest.mark.parametrize("head_trains", [True, False], ids=["head-trains", "head-frozen"])
def test_no_target_gives_zero_loss_and_zero_gradients(head_trains):
    """Every target masked, or samples of one token (no target at all): the loss is 0 and backward runs."""
    fabric, model = _fabric_model("32-true", head_trains)
    for ids, targets in (
        (torch.randint(0, 1000, (2, 40)), torch.full((2, 39), -100)),
        (torch.randint(0, 1000, (2, 1)), torch.zeros((2, 0), dtype=torch.long)),
    ):
        loss, grads = _loss_and_grads(fabric, model, lambda: next_token_loss(model, ids, targets))
        assert loss.item() == 0.0 and all(not g.any() for g in grads.values())


def _plain_model(precision: str, **options):
    """litgpt's own GPT, every parameter trained: full fine-tuning's and pretraining's head is a plain nn.Linear."""
    from litgpt.model import GPT as PlainGPT

    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    torch.manual_seed(0)
    shape = dict(n_layer=2, n_head=4, n_embd=64, block_size=512, vocab_size=1000, padded_vocab_size=1024)
    config = Config(**shape | options)
    with fabric.init_module():
        model = PlainGPT(config)
    return fabric, fabric.setup_module(model)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("length, softcap, bias", [(300, None, False), (129, 30.0, True), (1, None, False)])
def test_a_trained_linear_head_gives_litgpts_loss_and_gradients(precision, length, softcap, bias):
    """The plain head's gradients, taken chunk by chunk in forward into one buffer, against litgpt's whole-logits
    loss: in each precision (bf16-mixed's float32 weights under autocast), with soft-capping and a head bias."""
    fabric, model = _plain_model(precision, final_logit_softcapping=softcap, lm_head_bias=bias)
    assert type(model.lm_head) is torch.nn.Linear
    ids = torch.randint(0, 1000, (3, length))
    labels = ids.clone()
    labels[:, :10] = -100
    theirs, their_grads = _loss_and_grads(fabric, model, lambda: _litgpt_loss(model, ids, labels))
    ours, our_grads = _loss_and_grads(fabric, model, lambda: next_token_loss(model, ids, labels[..., 1:]))
    # a 16-bit matmul with a bias rounds by the chunk's shape: litgpt's chunks of 128 rows and these of 256 give
    # losses 7e-6 apart (so did recomputing the chunks in backward)
    exact = precision == "32-true" or not bias
    torch.testing.assert_close(ours, theirs, **(dict(rtol=1e-6, atol=1e-6) if exact else dict(rtol=2e-5, atol=0)))
    assert our_grads.keys() == their_grads.keys()
    assert ("_forward_module.lm_head.bias" in our_grads) == bias
    tolerance = dict(rtol=1e-4, atol=1e-6) if precision == "32-true" else dict(rtol=2e-2, atol=2e-4)
    for name in their_grads:
        assert our_grads[name].dtype == their_grads[name].dtype, name
        torch.testing.assert_close(our_grads[name], their_grads[name], **tolerance, msg=name)


def test_a_trained_linear_head_holds_one_gradient_of_its_weight(tmp_path):
    """A head that outweighs a chunk of its logits (as Llama-3-70B's 2 GiB head does its 0.13 GiB chunks), eight
    chunks: the loss holds the weight's gradient once and about one chunk of logits at a time. Recomputing each chunk
    in backward (the path of a head that is not a plain nn.Linear, such as LoRA's) held, on top of it, the chunk's
    own weight gradient while it was added to the sum, and autograd's four chunk-sized buffers of the cross-entropy."""
    ids = torch.randint(0, 8192, (2, 1024))  # 2 x 1023 targets
    rows = rows_per_chunk(2046, 512, 8192)
    head = 8192 * 512 * 4  # 16 MiB; a chunk of float32 logits is 8 MiB
    assert -(-2046 // rows) == 8

    def peak(plain: bool) -> int:
        fabric, model = _plain_model(
            "32-true", n_layer=1, n_head=8, n_embd=512, vocab_size=8192, padded_vocab_size=8192, block_size=1024
        )
        if not plain:
            # a head with a forward of its own (as LoRA's has); a subclass that keeps nn.Linear's (FSDP2's unit
            # class) computes as a plain one
            own = {"forward": lambda self, x: torch.nn.functional.linear(x, self.weight, self.bias)}
            model.lm_head.__class__ = type("Head", (torch.nn.Linear,), own)
        return _peak_allocated(lambda: fabric.backward(next_token_loss(model, ids, ids[..., 1:])), tmp_path)

    fused, recomputed = peak(plain=True), peak(plain=False)
    assert recomputed - fused > 0.75 * head, (fused / 2**20, recomputed / 2**20)  # measured: 112.6 and 129.1 MiB


def test_a_unit_class_of_fsdp_around_a_linear_head_is_still_the_plain_path():
    """FSDP2's ``fully_shard`` swaps a unit's class for a subclass that keeps ``nn.Linear``'s forward (``FSDPLinear``):
    the loss takes such a head's own path, where a head with a forward of its own (LoRA's, a quantized layer) is
    recomputed. tests/test_fsdp.py measures the difference on 2 processes."""
    from torch.distributed.fsdp import FSDPModule

    from memfit.training.loss import _plain_linear

    head = torch.nn.Linear(4, 8, bias=False)
    assert _plain_linear(head)
    head.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # as fully_shard names it
    assert _plain_linear(head)
    head.__class__ = type("Head", (torch.nn.Linear,), {"forward": lambda self, x: x @ self.weight.T})
    assert not _plain_linear(head)
    assert not _plain_linear(torch.nn.Embedding(4, 8))
