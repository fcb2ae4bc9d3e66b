"""CUDA's autocast rules on a trace that runs on the CPU, for an estimate of a ``-mixed`` run on a GPU.

The estimate traces on fake CPU tensors under the CPU's autocast. The two policies differ: CUDA's computes softmax,
log_softmax, layer_norm, exp, rsqrt, sum, pow and more in float32 (casting 16-bit inputs up, so the float32 copies
are what autograd saves), where the CPU's keeps them in 16 bits. A CUDA estimate traced with the CPU's rules misses
those copies, most for LayerNorm models (Pythia, Phi). ``CudaAutocastRules`` applies CUDA's float32 list over the
CPU's autocast; ``tests/test_estimate.py`` checks the list against torch's own CUDA autocast kernels, which run on
fake CUDA tensors on any machine.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

FLOAT32_ON_CUDA = frozenset(
    {
        "softmax",
        "log_softmax",
        "softmin",
        "layer_norm",
        "group_norm",
        "normalize",
        "norm",
        "exp",
        "expm1",
        "log",
        "log1p",
        "log2",
        "log10",
        "rsqrt",
        "reciprocal",
        "pow",
        "__pow__",
        "__rpow__",
        "sum",
        "prod",
        "cumsum",
        "cumprod",
        "softplus",
        "cosh",
        "sinh",
        "tan",
        "acos",
        "asin",
        "erfinv",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "kl_div",
        "nll_loss",
        "cross_entropy",
        "binary_cross_entropy_with_logits",
    }
)
"""The functions (by name, as torch and Tensor methods or ``torch.nn.functional``) CUDA's autocast computes in
float32 and the CPU's does not all: torch's list "CUDA Ops that can autocast to float32", as the Python functions
that reach them"""

_HALF = (torch.float16, torch.bfloat16)


class CudaAutocastRules(TorchFunctionMode):
    """Inside the CPU's autocast: a function on ``FLOAT32_ON_CUDA`` with a 16-bit floating input gets its floating
    inputs cast to float32 (casts autograd records, as CUDA's autocast's are) and runs with autocast off."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FLOAT32_ON_CUDA and torch.is_autocast_enabled("cpu") and _has_half(args, kwargs):
            args, kwargs = tree_map(_to_float32, (args, kwargs))
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _has_half(args, kwargs) -> bool:
    found = []
    tree_map(lambda x: found.append(isinstance(x, torch.Tensor) and x.dtype in _HALF), (args, kwargs))
    return any(found)


def _to_float32(value):
    if isinstance(value, torch.Tensor) and value.dtype in _HALF:
        return value.float()
    return value
