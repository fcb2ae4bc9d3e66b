"""Optimizers by name and the learning-rate schedule (linear warm-up, then cosine decay to ``min_lr``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from memfit.errors import UserError
from memfit.training.bitsandbytes_layers import import_bitsandbytes


@dataclass(frozen=True)
class OptimizerKind:
    """One ``--optimizer`` choice, described once: the flag's choices, litgpt's ``class_path`` names for it, what
    its constructor takes, how the estimate models its state and how the planner prices it all come from here.
    Adding an optimizer is one entry in ``OPTIMIZERS`` (and its case in tests/test_optim.py)."""

    name: str
    build: Callable[..., torch.optim.Optimizer]
    """``build(params, lr, weight_decay, precision, **init_args)``: the optimizer over trainable ``params``"""
    init_args: tuple[str, ...]
    """Constructor arguments a litgpt block's ``init_args`` may give beside lr and weight_decay"""
    class_paths: tuple[str, ...] = ()
    """litgpt's ``class_path`` values that mean this optimizer"""
    traced_as: str | None = None
    """The torch optimizer ``--estimate``'s fake step runs for it (its own name for torch's); None: the estimate
    cannot model it and ``--estimate`` refuses it rather than price it as another"""
    bitsandbytes_state: str | None = None
    """bitsandbytes' state, priced analytically over the AdamW-shaped trace: "8bit" or "32bit" moments"""
    paged: bool = False
    """State in CUDA managed memory (bitsandbytes' paged optimizers; on CPU the same as unpaged)"""
    torch_adamw: bool = False
    """torch's AdamW: its state takes the parameters' dtype (the 16-true eps warning applies)"""
    step_cost: float = 1.0
    """The planner's time factor against fused AdamW"""
    planner_tries: bool = False
    """The planner offers it as an alternative to the optimizer given"""

    @property
    def keeps_adam_moments(self) -> bool:
        """AdamW's update with its two moments, in any kernel or state format: where the given optimizer is one, the
        planner offers the others in its place (SGD, without moments, is another training)."""
        return self.torch_adamw or self.bitsandbytes_state is not None


def _torch_adamw(kernel: str):
    def build(params, lr: float, weight_decay: float, precision: str, **extra) -> torch.optim.Optimizer:
        if kernel == "fused" and precision != "16-mixed":
            # fused is the fastest and leanest kernel where supported (CUDA, and CPU in recent torch); else foreach
            try:
                return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True, **extra)
            except (RuntimeError, ValueError):
                pass
        foreach = kernel != "for-loop"
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=foreach, **extra)

    return build


def _sgd(params, lr: float, weight_decay: float, precision: str, **extra) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **({"momentum": 0.9} | extra))


def _bitsandbytes(class_name: str):
    def build(params, lr: float, weight_decay: float, precision: str, **extra) -> torch.optim.Optimizer:
        return getattr(import_bitsandbytes().optim, class_name)(params, lr=lr, weight_decay=weight_decay, **extra)

    return build


_ADAM_ARGS = ("betas", "eps", "amsgrad")
OPTIMIZERS: dict[str, OptimizerKind] = {
    kind.name: kind
    for kind in (
        OptimizerKind(
            "AdamW",
            _torch_adamw("fused"),
            _ADAM_ARGS,
            class_paths=("AdamW", "torch.optim.AdamW"),
            traced_as="AdamW",
            torch_adamw=True,
            planner_tries=True,
        ),
        # PyTorch's default where fused is not asked for: fast, but step() builds temporaries as large as the
        # parameters; kept as a choice so that its memory can be estimated and compared
        OptimizerKind(
            "AdamW-foreach", _torch_adamw("foreach"), _ADAM_ARGS, traced_as="AdamW-foreach", torch_adamw=True
        ),
        # one parameter at a time: scratch of one tensor, slower on many small tensors
        OptimizerKind(
            "AdamW-for-loop",
            _torch_adamw("for-loop"),
            _ADAM_ARGS,
            traced_as="AdamW-for-loop",
            torch_adamw=True,
            step_cost=1.05,
        ),
        OptimizerKind(
            "SGD",
            _sgd,
            ("momentum", "dampening", "nesterov"),
            class_paths=("SGD", "torch.optim.SGD"),
            traced_as="SGD",
        ),
        OptimizerKind(
            "AdamW8bit",
            _bitsandbytes("AdamW8bit"),
            ("betas", "eps"),
            class_paths=("AdamW8bit", "bitsandbytes.optim.AdamW8bit"),
            traced_as="AdamW",
            bitsandbytes_state="8bit",
            step_cost=1.02,
            planner_tries=True,
        ),
        OptimizerKind(
            "PagedAdamW",
            _bitsandbytes("PagedAdamW"),
            ("betas", "eps"),
            class_paths=("PagedAdamW", "bitsandbytes.optim.PagedAdamW"),
            traced_as="AdamW",
            bitsandbytes_state="32bit",
            paged=True,
        ),
        OptimizerKind(
            "PagedAdamW8bit",
            _bitsandbytes("PagedAdamW8bit"),
            ("betas", "eps"),
            class_paths=("PagedAdamW8bit", "bitsandbytes.optim.PagedAdamW8bit"),
            traced_as="AdamW",
            bitsandbytes_state="8bit",
            paged=True,
            step_cost=1.02,
            planner_tries=True,
        ),
    )
}
OptimizerChoice = Literal[tuple(OPTIMIZERS)]  # --optimizer's choices, as --help lists them
_CLASS_NAMES = {path: kind.name for kind in OPTIMIZERS.values() for path in kind.class_paths}


def optimizer_kind(name: str) -> OptimizerKind:
    if name not in OPTIMIZERS:
        raise UserError(f"--optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def resolve_optimizer(optimizer: str | dict) -> tuple[str, dict, dict]:
    """``--optimizer`` as Memfit's name or litgpt's block (``class_path`` and ``init_args``), as
    ``(name, lr and weight_decay given in the block, other constructor arguments)``. Unknown keys are refused."""
    if isinstance(optimizer, str):
        return optimizer_kind(optimizer).name, {}, {}
    if not isinstance(optimizer, dict) or "class_path" not in optimizer or set(optimizer) - {"class_path", "init_args"}:
        raise UserError(
            f"--optimizer {optimizer!r}: give a name (AdamW, SGD, ...) or litgpt's block with class_path and init_args"
        )
    class_path, args = optimizer["class_path"], dict(optimizer.get("init_args") or {})
    if class_path not in _CLASS_NAMES:
        raise UserError(f"--optimizer class_path {class_path!r} is not one of {', '.join(sorted(_CLASS_NAMES))}")
    name = _CLASS_NAMES[class_path]
    schedule = {key: args.pop(key) for key in ("lr", "weight_decay") if key in args}
    if name == "AdamW":  # the kernel choice, as torch.optim.AdamW takes it
        fused, foreach = args.pop("fused", None), args.pop("foreach", None)
        name = (
            "AdamW-foreach" if foreach and not fused else "AdamW-for-loop" if foreach is False and not fused else name
        )
    taken = OPTIMIZERS[_CLASS_NAMES[class_path]].init_args
    unknown = sorted(set(args) - set(taken))
    if unknown:
        raise UserError(
            f"--optimizer init_args {unknown[0]!r} is not taken by {class_path} here; it takes lr,"
            f" weight_decay, {', '.join(taken)}"
        )
    if "betas" in args:
        args["betas"] = tuple(args["betas"])
    return name, schedule, args


FLOAT16_TINY = 2.0**-24
"""The smallest positive float16 (a subnormal, about 6e-08): anything below it is 0 in float16"""


def float16_adamw_warning(precision: str, optimizer: str, args: dict) -> str | None:
    """Under 16-true the trained weights, and so torch's AdamW state, are float16. AdamW's default eps (1e-8) and
    any squared gradient under FLOAT16_TINY (gradients under about 2.4e-4 after its (1 - beta2) factor, common) are
    then 0. The foreach and for-loop kernels divide by that 0 on the first step (inf); the fused kernel computes each
    step in float32 but keeps no second moment between steps, so a steady small gradient's step grows as lr x
    sqrt(step) (10 x lr by step 100). Measured on the embedded full fine-tune (fused, 20 steps): loss 6.8 to 1059
    with the default eps, 6.8 to 3.6 with eps 1e-4."""
    eps = args.get("eps", 1e-8)
    if precision != "16-true" or not optimizer_kind(optimizer).torch_adamw or eps >= FLOAT16_TINY:
        return None
    return (
        f"warning: --precision 16-true keeps AdamW's state in float16, where its eps {eps:g} and small squared"
        " gradients are 0: steps on small gradients grow without bound (or are inf) and training can diverge;"
        " use eps 1e-4: --optimizer '{class_path: torch.optim.AdamW, init_args: {eps: 1e-4}}', or bf16-true (the"
        " same memory) or 16-mixed where --quantize allows (bnb.int8-training needs 16-true)"
    )


def float16_adamw(optimizer) -> bool:
    """A live optimizer in the state float16_adamw_warning warns of: torch's AdamW on float16 weights with an eps
    that is 0 in float16 (what a divergence is then put down to)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
    return isinstance(optimizer, torch.optim.AdamW) and any(
        group["eps"] < FLOAT16_TINY and any(p.dtype == torch.float16 for p in group["params"])
        for group in optimizer.param_groups
    )


def make_optimizer(
    kind: OptimizerKind,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    precision: str = "",
    **extra,
) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer`` names. ``precision`` is the run's: under 16-mixed AdamW is not fused, since the
    fused kernel unscales 16-mixed's gradients inside its step, and Lightning's precision plugin then refuses to
    unscale them for the gradient norm or clipping ("Gradient clipping is not implemented for optimizers handling the
    unscaling"). The foreach kernel costs temporaries about as large as the parameters at the step; the estimate builds
    the same optimizer (``OptimizerKind.traced_as``)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise UserError("the model has no trainable parameters with these settings")
    return kind.build(params, lr, weight_decay, precision, **extra)


def build_optimizer(
    kind: OptimizerKind, params, lr: float, weight_decay: float, *, in_backward: bool, precision: str, **extra
) -> torch.optim.Optimizer:
    """The run's optimizer, as the script and the estimate's fake step build it: ``make_optimizer``'s, or with
    ``in_backward`` (--optimizer_in_backward) one per parameter stepped from its gradient hook."""
    if in_backward:
        return OptimizerInBackward(kind, params, lr, weight_decay, **extra)
    return make_optimizer(kind, params, lr, weight_decay, precision=precision, **extra)


def finetune_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int):
    """litgpt's fine-tuning schedule (``litgpt.finetune.lora.get_lr_scheduler``, the same in its other fine-tuning
    scripts), per optimizer step: the learning rate is ``step / warmup_steps`` of the peak during the warm-up (0 at the
    first step), then a cosine from the peak to 0 over the remaining steps. ``--train.min_lr`` plays no part, as in
    litgpt's fine-tuning (pretraining decays to it).

    litgpt chains a LambdaLR and a CosineAnnealingLR with SequentialLR, which warns at the switch (it steps the
    cosine with an epoch argument) and divides by zero without a warm-up; this is the closed form of the same values
    (tests/test_schedules.py compares it with litgpt's own scheduler)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / max(1, max_steps - warmup_steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def pretrain_schedule(
    optimizer: torch.optim.Optimizer, warmup_iters: int, max_iters: int, accumulation: int, min_lr: float
):
    """litgpt's pretraining schedule, its own ``litgpt.pretrain.get_lr``: a linear warm-up over ``warmup_iters``
    micro-batch iterations from 0, then a cosine to ``min_lr`` at ``max_iters`` (litgpt's horizon:
    ``--train.max_tokens`` over the tokens of one micro-batch of one process, whatever ``--train.max_steps`` stops at).

    Evaluated once per optimizer step, at the step's first micro-batch (iteration ``step * accumulation``, from 0): then
    ``step / warm-up`` and the cosine's progress are the same for any accumulation, so the run on 1, 2 or 4 processes is
    the same training. litgpt sets it at every micro-batch and its optimizer step uses the last one's, ``accumulation -
    1`` iterations later: the same values where a step is one micro-batch, a step's warm-up increment early at most
    otherwise (tests/test_schedules.py)."""
    from litgpt.pretrain import get_lr

    peak = optimizer.param_groups[0]["lr"]

    def factor(step: int) -> float:  # step: optimizer steps taken so far
        # litgpt's loop never reaches max_iters; where a run does (a horizon under one step), the last iteration's
        # value stands (get_lr divides by zero there when the warm-up is the whole horizon)
        iteration = min(step * accumulation, max(0, max_iters - 1))
        return get_lr(peak, iteration, warmup_iters, max_iters, min_lr) / peak if peak else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per parameter, stepped from ``register_post_accumulate_grad_hook`` as soon as its gradient is
    complete; the gradient is freed right after, so at most one parameter's gradient is alive at a time.

    ``step`` and ``zero_grad`` are no-ops for the training loop. ``param_groups`` are the inner optimizers' own
    dicts, so an LR scheduler driving this object drives them all.
    """

    def __init__(self, kind: OptimizerKind, params, lr: float, weight_decay: float, **extra) -> None:
        self.inner = [make_optimizer(kind, [p], lr, weight_decay, **extra) for p in params if p.requires_grad]
        if not self.inner:
            raise UserError("the model has no trainable parameters with these settings")
        super().__init__([g["params"][0] for o in self.inner for g in o.param_groups], {"lr": lr})
        self.param_groups = [g for o in self.inner for g in o.param_groups]
        self.handles = []
        for optimizer in self.inner:
            (param,) = optimizer.param_groups[0]["params"]
            self.handles.append(param.register_post_accumulate_grad_hook(self._hook(optimizer)))

    @staticmethod
    def _hook(optimizer: torch.optim.Optimizer):
        def step_and_free(_param: torch.Tensor) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step_and_free

    def step(self, closure=None):  # the hooks already stepped
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return {"inner": [o.state_dict() for o in self.inner]}

    def load_state_dict(self, state_dict: dict) -> None:
        for optimizer, state in zip(self.inner, state_dict["inner"]):
            optimizer.load_state_dict(state)
        self.param_groups = [g for o in self.inner for g in o.param_groups]

    @property
    def state(self):
        return {p: s for o in self.inner for p, s in o.state.items()}

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ assigns it
        pass
