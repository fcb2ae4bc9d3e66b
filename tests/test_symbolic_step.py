"""memfit.prediction.symbolic_step: one symbolic trace of a script's step gives its ledger for any micro-batch size and
sequence length in the trace's region, to the byte what a concrete trace of that setting gives."""

import dataclasses

import pytest

from conftest import load_script, one_process_plan

# a model small enough that a concrete trace is a fraction of a second, with a vocabulary and a width that put the
# loss's chunking through both of its regimes on this grid (256-token chunks; then chunks of N x n_embd / vocab)
ARCHITECTURE = dict(
    n_layer=2,
    n_embd=128,
    n_head=4,
    n_query_groups=2,
    intermediate_size=344,
    vocab_size=1024,
    padded_vocab_size=1024,
    block_size=4096,
    mlp_class_name="LLaMAMLP",
    norm_class_name="RMSNorm",
    bias=False,
    parallel_residual=False,
    rotary_percentage=1.0,
)
GRID = [(2, 17), (2, 256), (2, 257), (3, 200), (2, 1000), (5, 700), (4, 2100), (2, 4000)]
"""(micro-batch size, sequence length): a chunk cut short and not, one chunk and several, both chunk sizes"""


def _script(kind: str):
    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.settings.run import ScriptStep

    if kind == "lora":
        config = Config(**ARCHITECTURE, lora_r=8, lora_alpha=16, lora_query=True, lora_value=True)
        return ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, load_script("finetune/lora.py").train_step)
    if kind in ("adapter", "adapter_v2"):
        import importlib

        module = load_script(f"finetune/{kind}.py")
        litgpt_module = importlib.import_module(f"litgpt.{kind}")
        config = litgpt_module.Config(**ARCHITECTURE, adapter_prompt_length=10, adapter_start_layer=1)
        return ScriptStep(litgpt_module.GPT, litgpt_module.Block, config, module.mark_trainable, module.train_step)
    from litgpt.model import GPT, Block, Config

    script = "finetune/full.py" if kind == "full" else "pretrain/pretrain.py"
    return ScriptStep(
        GPT, Block, Config(**ARCHITECTURE), None, load_script(script).train_step, text_batches=kind == "pretrain"
    )


def _as_numbers(ledger, unsaved: int) -> dict:
    return {
        "unsaved": unsaved,
        **{
            name: (
                record.peak,
                record.activations,
                dict(sorted(record.roles_at_end.items())),
                dict(sorted(record.beside_weights.items())),  # where a quantized layer's dequantized copy sits
            )
            for name, record in ledger.phases.items()
        },
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, settings",
    [
        ("lora", {}),
        ("lora", {"activation_checkpointing": 1, "precision": "bf16-true"}),
        ("full", {"accumulation": 2}),
        ("full", {"activation_checkpointing": 2}),
        ("pretrain", {"precision": "bf16-mixed", "accelerator": "cpu"}),
        ("pretrain", {"activation_checkpointing": 1}),
        ("adapter", {}),
        ("adapter_v2", {"precision": "bf16-true"}),
    ],
)
def test_the_formula_is_the_concrete_trace_to_the_byte(kind, settings):
    from memfit.prediction.fake_step import trace_step
    from memfit.prediction.symbolic_step import SymbolicStep

    script = _script(kind)
    plan = one_process_plan(micro_batch_size=2, accumulation=1, sequence_length=256, blocks=2)
    plan = dataclasses.replace(plan, **settings)
    formula = SymbolicStep(script, plan)
    for b, t in GRID:
        concrete = trace_step(
            script, dataclasses.replace(plan, micro_batch_size=b, sequence_length=t), whole_step=False
        )
        ledger, _, unsaved, _, events = formula.ledger(b, t)
        assert _as_numbers(ledger, unsaved) == _as_numbers(concrete[0], concrete[2]), (kind, settings, b, t)
        # the allocations each phase makes, which price the profiler window's host memory: a checkpointed block's
        # recomputation makes 2 more (of 470) in a symbolic trace, the adapter's backward 2 more (of 123), none of them
        # bytes the ledger counts
        assert [name for name, _ in events] == [name for name, _ in concrete[4]]
        assert all(abs(n - m) <= max(2, 0.01 * m) for (_, n), (_, m) in zip(events, concrete[4])), (events, concrete[4])
    # the grid crosses regions (the loss's chunks), and each region is traced once: fewer pieces than settings
    assert 1 < len(formula.pieces) < len(GRID), len(formula.pieces)
    assert formula.concrete_traces == 0


@pytest.mark.slow
def test_a_size_of_one_is_traced_concretely_and_the_formula_outside_its_region_is_never_used():
    """torch specializes sizes of 1 (broadcasting), so a micro-batch of 1 gets its own concrete trace; a setting past
    every piece's guards makes a new piece, never an evaluation of a formula that does not hold there. Another setting
    inside the piece is an evaluation equal to its concrete trace to the byte (the whole grid, over the pieces the
    loss's chunks make, is test_the_formula_is_the_concrete_trace_to_the_byte's, extended tier)."""
    from memfit.prediction.fake_step import trace_step
    from memfit.prediction.symbolic_step import SymbolicStep

    script = _script("lora")
    plan = one_process_plan(micro_batch_size=2, accumulation=1, sequence_length=256, blocks=2)
    formula = SymbolicStep(script, plan)
    formula.ledger(2, 300)
    (piece,) = formula.pieces
    assert piece.holds(2, 400) and not piece.holds(2, 100)  # fewer tokens than one chunk: another region
    assert "B" in str(piece.expressions["forward"]) and "T" in str(piece.expressions["forward"])
    evaluated = formula.ledger(3, 400)
    assert len(formula.pieces) == 1 and formula.concrete_traces == 0  # the piece's formula, not a trace
    concrete = trace_step(script, dataclasses.replace(plan, micro_batch_size=3, sequence_length=400), whole_step=False)
    assert _as_numbers(evaluated[0], evaluated[2]) == _as_numbers(concrete[0], concrete[2])
    one = formula.ledger(1, 300)
    assert formula.concrete_traces == 1 and len(formula.pieces) == 1
    concrete = trace_step(script, dataclasses.replace(plan, micro_batch_size=1, sequence_length=300), whole_step=False)
    assert _as_numbers(one[0], one[2]) == _as_numbers(concrete[0], concrete[2])


def test_plans_whose_estimate_reads_the_timeline_are_not_traced_as_a_formula():
    from memfit.prediction.symbolic_step import SymbolicStep, not_symbolic

    fsdp = one_process_plan(micro_batch_size=2, accumulation=1, sequence_length=64, strategy="fsdp", world_size=2)
    assert "FSDP" in not_symbolic(fsdp)
    # a quantized base's copies are placed from the formula's own counts (PhaseRecord.beside_weights)
    for quantize in (None, "torchao.nf4", "bnb.nf4"):
        assert (
            not_symbolic(one_process_plan(micro_batch_size=2, accumulation=1, sequence_length=64, quantize=quantize))
            is None
        )
    with pytest.raises(ValueError, match="not traced as a formula: FSDP"):
        SymbolicStep(_script("lora"), fsdp)
