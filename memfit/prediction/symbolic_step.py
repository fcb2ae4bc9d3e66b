"""The traced step as a formula of the micro-batch size and the sequence length.

``memfit.prediction.fake_step.trace_step`` runs the script's own ``train_step`` on fake tensors. Run once with the
micro-batch size B and the sequence length T as symbols of torch's symbolic shapes (a ``ShapeEnv``, what
``torch.compile``'s dynamic shapes use), every size the step allocates is an expression in B and T, and so is every
byte count its ledger keeps: each phase's peak (a max over the live bytes at each allocation), the bytes each role
holds at its end, the activations saved, the bytes alive at each linear weight's products (where a quantized layer's
dequantized copy sits) and the linear layers' inputs autograd did not keep. The ledger of any
(B, T) is then an evaluation, byte for byte the ledger a concrete trace of that (B, T) gives (tests/test_symbolic_step.py).

A formula holds where its guards hold: the conditions torch and the step checked on the way (how many chunks the loss
runs in, whether a chunk is cut short, the model's context), a region of settings that run the same operations. A
setting outside every region traced so far is traced again, with its own sizes as the symbols' hints: another piece.
B or T below 2 is traced concretely: torch specializes sizes 0 and 1 (broadcasting), so no symbolic trace covers them.
One figure is not exact: the number of allocations each phase makes (which prices the profiler window's host memory)
is the piece's own, and a checkpointed block's recomputation makes 2 more (of 470) in a symbolic trace than in a
concrete one (the adapter's backward 2 more of 123), none of them bytes the ledger counts.

What it costs (``benchmarks/symbolic_step.py``, ``profiles/cpu/symbolic_step.json``): one symbolic trace takes many
concrete ones' time (torch's symbolic arithmetic, and the live-bytes counter's), then each setting is microseconds.
It pays where many settings of one plan are asked for, not where a search needs a few.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from memfit.observatory.ledger import Ledger, PhaseRecord
from memfit.prediction.fake_step import Plan, as_expression, trace_step
from memfit.settings.run import ScriptStep

SIZES = ("micro_batch_size", "sequence_length")
"""The plan's sizes a formula is of, in the order its functions take them"""


def not_symbolic(plan: Plan) -> str | None:
    """Why ``plan``'s step is not traced as a formula, in a few words; None where it is. FSDP's estimate reads the
    traced timeline allocation by allocation (``memfit.prediction.estimate.fsdp_phases``), which a formula does not
    keep; a quantized layer's dequantized weight is placed from the bytes alive at its products, which it keeps."""
    if plan.strategy == "fsdp":
        return "FSDP's estimate reads the step's timeline"
    return None


@dataclasses.dataclass
class _Piece:
    """One symbolic trace: its guards and its ledger's byte counts, as functions of (B, T)."""

    holds: Callable[[int, int], bool]
    phases: dict[str, dict[str, Callable]]
    """Per phase: ``peak``, ``activations`` and ``role:NAME`` (its bytes at the phase's end)"""
    beside_weights: dict[str, dict[tuple, Callable]]
    """Per phase, the bytes alive at the products with each shape of linear weight (``PhaseRecord.beside_weights``)"""
    unsaved: Callable[[int, int], int]
    phase_events: list
    model: torch.nn.Module
    expressions: dict[str, sympy.Expr]
    """Each phase's peak as an expression in ``B`` and ``T``, for a reader"""


class SymbolicStep:
    """The traced step of ``plan`` (its sizes aside) as formulas of its micro-batch size and sequence length, traced
    into pieces as settings are asked for (``ledger``)."""

    def __init__(self, script: ScriptStep, plan: Plan, whole_step: bool = False) -> None:
        reason = not_symbolic(plan)
        if reason is not None:
            raise ValueError(f"not traced as a formula: {reason}")
        self.script, self.plan, self.whole_step = script, plan, whole_step
        self.pieces: list[_Piece] = []
        self.concrete_traces = 0
        """Settings traced concretely (B or T below 2)"""

    def ledger(self, micro_batch_size: int, sequence_length: int) -> tuple[Ledger, torch.nn.Module, int, None, list]:
        """What ``trace_step`` returns for the plan at these sizes (its timeline None: a formula keeps none)."""
        b, t = micro_batch_size, sequence_length
        plan = dataclasses.replace(self.plan, micro_batch_size=b, sequence_length=t)
        if b < 2 or t < 2:
            self.concrete_traces += 1
            ledger, model, unsaved, _, events = trace_step(self.script, plan, whole_step=self.whole_step)
            return ledger, model, unsaved, None, events
        piece = next((piece for piece in self.pieces if piece.holds(b, t)), None)
        if piece is None:
            piece = self._trace(b, t)
            self.pieces.append(piece)
        ledger = Ledger(device="fake", measures="predicted")
        for name, values in piece.phases.items():
            ledger.phases[name] = PhaseRecord(
                peak=values["peak"](b, t),
                activations=values["activations"](b, t),
                roles_at_end={key[5:]: f(b, t) for key, f in values.items() if key.startswith("role:")},
                beside_weights={shape: f(b, t) for shape, f in piece.beside_weights[name].items()},
            )
        return ledger, piece.model, piece.unsaved(b, t), None, piece.phase_events

    def _trace(self, b: int, t: int) -> _Piece:
        shape_env = ShapeEnv()
        sizes = [_symbol(shape_env, name, hint) for name, hint in zip(("B", "T"), (b, t), strict=True)]
        plan = dataclasses.replace(self.plan, **dict(zip(SIZES, sizes, strict=True)))
        ledger, model, unsaved, _, events = trace_step(
            self.script, plan, whole_step=self.whole_step, shape_env=shape_env
        )
        symbols = tuple(size.node.expr for size in sizes)
        guards = [guard.expr for guard in shape_env.guards]
        phases = {
            name: {
                "peak": _function(record.peak, symbols),
                "activations": _function(record.activations, symbols),
                **{f"role:{role}": _function(size, symbols) for role, size in record.roles_at_end.items()},
            }
            for name, record in ledger.phases.items()
        }
        beside_weights = {
            name: {shape: _function(at, symbols) for shape, at in record.beside_weights.items()}
            for name, record in ledger.phases.items()
        }
        return _Piece(
            holds=_all_hold(guards, symbols),
            phases=phases,
            beside_weights=beside_weights,
            unsaved=_function(unsaved, symbols),
            phase_events=events,
            model=model,
            expressions={
                name: as_expression(record.peak).xreplace(dict(zip(symbols, sympy.symbols("B T"), strict=True)))
                for name, record in ledger.phases.items()
            },
        )


def _symbol(shape_env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    # a ConstantSource names the symbol; DYNAMIC: never specialized to its hint (torch keeps it at least 2)
    from torch._dynamo.source import ConstantSource

    symbol = shape_env.create_symbol(hint, source=ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
    return shape_env.create_symintnode(symbol, hint=hint)


# torch's own sympy functions in the sizes (a chunk's rows are a ceiling division), as Python evaluates them
_FUNCTIONS = {
    "FloorDiv": lambda a, b: a // b,
    "CleanDiv": lambda a, b: a // b,
    "CeilDiv": lambda a, b: -(-a // b),
    "PythonMod": lambda a, b: a % b,
    "Mod": lambda a, b: a % b,
    "Max": max,
    "Min": min,
}


def _function(value, symbols: tuple) -> Callable[[int, int], int]:
    """``value`` (an int or a SymInt) as a function of the symbols' values, computed in Python's integers; checked
    against sympy's own evaluation the first time it runs, which it falls back to where they differ."""
    expression = as_expression(value)
    if not expression.free_symbols:
        constant = int(expression)
        return lambda b, t: constant
    fast = sympy.lambdify(symbols, expression, modules=[_FUNCTIONS, "math"])

    def exact(b: int, t: int) -> int:
        return int(expression.xreplace(dict(zip(symbols, (sympy.Integer(b), sympy.Integer(t)), strict=True))))

    checked: list[Callable] = []

    def evaluated(b: int, t: int) -> int:
        if not checked:
            try:
                agrees = int(fast(b, t)) == exact(b, t)
            except (NameError, TypeError):  # a function of torch's that the table above does not hold
                agrees = False
            checked.append(fast if agrees else exact)
        return int(checked[0](b, t))

    return evaluated


def _all_hold(guards: list, symbols: tuple) -> Callable[[int, int], bool]:
    """Whether every guard of a trace holds at (B, T)."""
    conditions = [sympy.lambdify(symbols, guard, modules=[_FUNCTIONS, "math"]) for guard in guards]

    def exact(guard, b: int, t: int) -> bool:
        return bool(guard.xreplace(dict(zip(symbols, (sympy.Integer(b), sympy.Integer(t)), strict=True))))

    def holds(b: int, t: int) -> bool:
        for guard, condition in zip(guards, conditions, strict=True):
            try:
                if not condition(b, t):
                    return False
            except (NameError, TypeError):
                if not exact(guard, b, t):
                    return False
        return True

    return holds
