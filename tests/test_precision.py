"""memfit.training.precision: what each --precision becomes on this machine, and a 16-bit run on a CPU that has no
16-bit instructions called slow before it starts."""

import torch


def test_16_bit_precision_on_a_cpu_without_16_bit_instructions_is_called_slow(monkeypatch):
    """A CPU without AVX512-BF16 or AMX emulates 16-bit matmuls: a run there says so (and suggests 32-true), decided
    from torch's own probes of the CPU. Both CPU families' answers are checked, not only this one's. (No wall-clock
    assertion here: how much slower emulation is depends on the machine and its load.)"""
    from memfit.training.precision import cpu_description
    from memfit.training.precision import slow_half_precision_on_this_cpu as note

    assert note("32-true", "cpu") is None and note("bf16-true", "cuda") is None
    for bf16, amx in [(True, False), (False, True), (False, False)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        for precision in ("bf16-true", "bf16-mixed", "16-true"):
            said = note(precision, "cpu")
            assert (said is None) == (bf16 or amx), (precision, bf16, amx)
            assert said is None or f"--precision {precision}" in said and "32-true" in said
        # and the benchmarks' record of the machine says which family their 16-bit figures come from
        assert ("none (bf16 and float16 emulated)" in cpu_description()) == (not bf16 and not amx)
