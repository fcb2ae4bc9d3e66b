"""memfit.observatory.roles: what each role holds now, by address, from real tensors (the ledger and the out-of-memory
explanation read these), and what autograd still saves for backward."""

import torch

from memfit.observatory.roles import SavedActivations, role_addresses, role_sizes


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model[0].requires_grad_(False)  # frozen, as a fine-tune's base
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def test_each_role_holds_what_its_tensors_take():
    model, optimizer = _model_and_optimizer()
    frozen = (32 * 64 + 64) * 4
    trainable = (64 * 8 + 8) * 4
    assert role_sizes(model, optimizer) == {
        "params_quantized": 0,
        "params_trainable": trainable,
        "params_frozen": frozen,
        "gradients": 0,
        "optimizer_state": 0,
    }
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    sizes = role_sizes(model, optimizer)
    assert sizes["gradients"] == trainable  # only the trained layer's
    # two moments a parameter, and a step counter each (a 0-d float32 tensor on CPU)
    assert sizes["optimizer_state"] == 2 * trainable + 2 * 4
    optimizer.zero_grad(set_to_none=True)
    assert role_sizes(model, optimizer)["gradients"] == 0


def test_a_storage_is_counted_once_under_the_role_found_first():
    """Tied weights (one storage in two modules) are one parameter's bytes, not two."""
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    addresses = role_addresses(model, None)
    assert list(addresses.values()) == [("params_trainable", 16 * 8 * 4)]


def test_saved_activations_are_what_backward_still_needs():
    model, _ = _model_and_optimizer()
    inputs = torch.randn(4, 32)
    with SavedActivations(model) as saved:
        out = model(inputs)
    # the first layer is frozen and its input needs no gradient: nothing saved for it; ReLU keeps its output
    # (4 x 64 float32) and the second layer its input, the same storage: counted once
    assert saved.bytes == 4 * 64 * 4
    assert set(saved.addresses.values()) == {4 * 64 * 4}
    out.sum().backward()
    del out
