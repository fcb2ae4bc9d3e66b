"""The quantization registry (memfit.training.quantizers.QUANTIZERS): --quantize's choices come from it, each entry's
stored bytes are what its library stores, and a method that needs a precision says so."""

import pytest
import torch

from memfit.errors import UserError
from memfit.training.precision import check_combination
from memfit.training.quantizers import QUANTIZERS, QuantizeChoice


def test_the_flag_choices_are_the_registry():
    assert list(QuantizeChoice.__args__) == list(QUANTIZERS)
    # each entry takes one of the two routes the loading code knows, by its behaviour, not its name
    for kind in QUANTIZERS.values():
        assert kind.replaces_layers != kind.quantizes_loaded_weights, kind.name
        assert kind.shards_with_fsdp == kind.quantizes_loaded_weights, kind.name


def test_each_quantizer_stores_what_its_entry_says():
    """The stored bytes an entry prices against what its library stores for one layer."""
    from memfit.training.bitsandbytes_layers import replace_linear_layers

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


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_every_registered_quantizer_is_estimated_or_refused_in_one_line(tmp_path, embedded, name, capsys):
    """Each entry's --estimate (with the precision the entry needs, if any) prints a predicted peak, or is refused
    with one UserError naming the flag, never a traceback."""
    from conftest import load_script, tiny_train

    lora = load_script("finetune/lora.py")
    precision = QUANTIZERS[name].needs_precision or "bf16-true"
    try:
        lora.setup(estimate=True, quantize=name, precision=precision, train=tiny_train(), out_dir=tmp_path / "out")
    except UserError as refused:
        assert "--quantize" in str(refused), refused
        return
    assert "Predicted peak: " in capsys.readouterr().out
