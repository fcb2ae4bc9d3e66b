"""bitsandbytes layers that quantize weights as they are loaded, on CPU or CUDA.

Lightning's bitsandbytes layers quantize only on their way to CUDA. Ours quantize on the device given at
construction, inside a ``load_state_dict`` pre-hook: each weight is read from the (memory-mapped) checkpoint,
quantized, and dropped before the next layer's weight is touched, so the full-precision base never sits whole in
memory. The layer classes are bitsandbytes' own, so Lightning's ``BitsandbytesPrecision`` recognises them and leaves
them as they are.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from memfit.memory import release_freed_heap
from memfit.training.torchao_nf4 import is_nf4

_ABSENT = object()


def import_bitsandbytes():
    """``bitsandbytes``, imported without its download of a kernel from the Hugging Face Hub.

    On CPUs with AVX512-BF16, bitsandbytes (0.49 and later) tries at import to fetch a 4-bit matmul kernel from the
    Hub through the ``kernels`` package, and where it cannot (``kernels`` not installed, or no network) logs "Failed
    to load CPU gemm_4bit_forward from kernels-community ... pip install kernels". Memfit runs with no network and
    trains with the kernels bitsandbytes ships (those its tests and measurements cover), so the fetch is not tried
    and its warning not printed. Every import of bitsandbytes, Lightning's plugin's included, must come after this.
    Imported late in any case: it prints a banner and probes devices.
    """
    if "bitsandbytes" in sys.modules:
        return _with_fast_cpu_backward(sys.modules["bitsandbytes"])
    before = sys.modules.get("kernels", _ABSENT)
    sys.modules["kernels"] = None  # `from kernels import get_kernel` now raises ImportError, without a lookup
    hub_warning = logging.getLogger("bitsandbytes.backends.cpu.ops")
    drop = lambda record: "kernels-community" not in record.getMessage()  # noqa: E731
    hub_warning.addFilter(drop)
    try:
        import bitsandbytes
    finally:
        hub_warning.removeFilter(drop)
        if before is _ABSENT:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = before
    return _with_fast_cpu_backward(bitsandbytes)


def _with_fast_cpu_backward(bitsandbytes):
    """bitsandbytes with its 4-bit layers' backward on a CPU in 16-bit taking torch's fast matmul.

    ``MatMul4Bit.backward`` computes the input's gradient as ``torch.matmul(grad, W)`` with the dequantized weight
    W (out x in) as it comes. On a CPU without native bfloat16 (no AVX512-BF16, as the CI machine), torch multiplies a
    bfloat16 matrix in that layout on a slow path: 19.5 ms for a (312 x 384) @ (384 x 128) product where the same
    product with the weight transposed into the layout of ``nn.functional.linear`` takes 2.7 ms (fp32: 0.4 ms). That
    one product was 31% of the README's QLoRA run on such a CPU (10.4 of 34 s); with the copy, the run trains 1.7x the
    tokens a second (``benchmarks/bnb_cpu_backward.py``). The copy is one more dequantized weight alive for the
    product, which the estimate of a CPU run counts (``memfit.prediction.estimate.with_4bit_weights``). The gradient is
    the same product in another summation order (equal to bfloat16 rounding). CUDA, float32 and every other case run
    bitsandbytes' own backward unchanged."""
    matmul_4bit = bitsandbytes.autograd._functions.MatMul4Bit
    if getattr(matmul_4bit, "_memfit_own_backward", None) is None:
        own = matmul_4bit.backward
        functional = bitsandbytes.functional

        def backward(ctx, grad_output):
            cpu_half = grad_output.device.type == "cpu" and grad_output.dtype in (torch.bfloat16, torch.float16)
            if not cpu_half or ctx.is_empty:
                return own(ctx, grad_output)
            needs_input, _, _, needs_bias, _ = ctx.needs_input_grad
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias) if needs_bias else None
            grad_input = None
            if needs_input:
                weight = functional.dequantize_4bit(ctx.tensors[1], ctx.state).to(grad_output.dtype)  # (out, in)
                grad_input = nn.functional.linear(grad_output, weight.t().contiguous())  # (..., out) -> (..., in)
            return grad_input, None, None, grad_bias, None

        matmul_4bit._memfit_own_backward = own
        matmul_4bit.backward = staticmethod(backward)
    return bitsandbytes


# Elements quantized at a time on CPU (a multiple of every 4-bit blocksize).
CPU_CHUNK = 1 << 20


def quantize_4bit(w: torch.Tensor, blocksize: int, compress_statistics: bool, quant_type: str, quant_storage):
    """``bnb.functional.quantize_4bit`` with the same result, in bounded memory on CPU.

    bitsandbytes' CPU kernel builds float32 and int64 temporaries about four times the size of the whole tensor
    (``bucketize`` alone returns int64), so quantizing a 32k x 4k head would spike by gigabytes. 4-bit blocks are
    contiguous runs of ``blocksize`` elements, so quantizing the flat tensor in aligned chunks gives identical
    bytes; the nested statistics (``-dq``) are then built over the whole absmax vector exactly as bitsandbytes does.
    """
    bnb = import_bitsandbytes()
    if w.device.type != "cpu" or w.numel() <= CPU_CHUNK:
        return bnb.functional.quantize_4bit(
            w,
            blocksize=blocksize,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            quant_storage=quant_storage,
        )
    flat = w.reshape(-1)
    # The results go into buffers allocated up front: small per-chunk outputs kept alive between large freed
    # temporaries would fragment the heap so that it never shrinks back.
    packed = torch.empty(((flat.numel() + 1) // 2, 1), dtype=quant_storage)
    absmax = torch.empty(-(-flat.numel() // blocksize), dtype=torch.float32)
    for start in range(0, flat.numel(), CPU_CHUNK):
        out, scale = torch.ops.bitsandbytes.quantize_4bit.default(
            flat[start : start + CPU_CHUNK], blocksize, quant_type, quant_storage
        )
        packed[start // 2 : start // 2 + out.shape[0]] = out
        absmax[start // blocksize : start // blocksize + scale.numel()] = scale
        del out, scale
    state = dict(
        shape=w.shape,
        dtype=w.dtype,
        blocksize=blocksize,
        quant_type=quant_type,
        code=bnb.functional.get_4bit_type(quant_type, device=w.device),
    )
    if compress_statistics:
        offset = absmax.mean()
        qabsmax, state2 = bnb.functional.quantize_blockwise(absmax - offset, blocksize=256)
        return packed, bnb.functional.QuantState(absmax=qabsmax, offset=offset, state2=state2, **state)
    return packed, bnb.functional.QuantState(absmax=absmax, **state)


def _quantize_4bit(layer, weight: torch.Tensor, device: torch.device) -> None:
    bnb = import_bitsandbytes()
    w = weight.to(device=device, dtype=layer.compute_dtype or torch.float16).contiguous()
    w_4bit, quant_state = quantize_4bit(
        w,
        blocksize=layer.weight.blocksize,
        compress_statistics=layer.weight.compress_statistics,
        quant_type=layer.weight.quant_type,
        quant_storage=layer.weight.quant_storage,
    )
    layer.weight = bnb.nn.Params4bit(
        w_4bit,
        requires_grad=False,
        quant_state=quant_state,
        blocksize=layer.weight.blocksize,
        compress_statistics=layer.weight.compress_statistics,
        quant_type=layer.weight.quant_type,
        quant_storage=layer.weight.quant_storage,
        module=layer,
        bnb_quantized=True,
    )
    if device.type == "cpu":
        release_freed_heap()


def _place_int8(layer, weight: torch.Tensor, device: torch.device) -> None:
    bnb = import_bitsandbytes()
    # int8-training keeps float16 weights and quantizes activations and weights on the fly in the matmul,
    # the same semantics as Lightning's "int8-training" mode.
    layer.weight = bnb.nn.Int8Params(
        weight.to(device=device, dtype=torch.float16), requires_grad=False, has_fp16_weights=True
    )


def _load_weight_hook(layer, device, state_dict, prefix, *_):
    key = prefix + "weight"
    if key not in state_dict:
        return
    weight = state_dict.pop(key)
    if weight.dtype == torch.uint8:
        raise ValueError(f"{key} is already quantized; load a full-precision checkpoint with --quantize")
    (_place_int8 if isinstance(layer, import_bitsandbytes().nn.Linear8bitLt) else _quantize_4bit)(layer, weight, device)
    if layer.bias is not None and (prefix + "bias") in state_dict:
        layer.bias = nn.Parameter(state_dict.pop(prefix + "bias").to(device), requires_grad=False)


def _forget_consumed_keys(layer, incompatible_keys) -> None:
    # The pre-hook consumed weight/bias; torch would otherwise list them as missing.
    for key in list(incompatible_keys.missing_keys):
        if key.rsplit(".", 1)[-1] in ("weight", "bias") and not getattr(layer, key.rsplit(".", 1)[-1]).is_meta:
            incompatible_keys.missing_keys.remove(key)


def _new_layer(linear: nn.Linear, mode: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from functools import partial

    bnb = import_bitsandbytes()
    kwargs = dict(bias=linear.bias is not None, device="meta")
    if mode == "int8-training":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, has_fp16_weights=True, **kwargs)
    else:
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            compute_dtype=dtype,
            quant_type=mode.split("-")[0],
            compress_statistics=mode.endswith("-dq"),
            quant_storage=torch.uint8,
            **kwargs,
        )
    keep_training_layout(layer)
    layer._register_load_state_dict_pre_hook(partial(_load_weight_hook, layer, device))
    layer.register_load_state_dict_post_hook(_forget_consumed_keys)
    return layer


def keep_training_layout(module: nn.Module) -> None:
    """Stops bitsandbytes from repacking 4-bit weights into its CPU inference layout, in ``module`` and below.

    On CPUs with AVX512-BF16, ``Linear4bit.forward`` in eval mode with an input that needs no gradient repacks the
    weight in place for ``gemv_4bit``, and leaves it repacked. Training then takes ``gemv_4bit``, which has no
    autograd: after the first ``validate()`` no gradient reaches any LoRA/adapter matrix behind a quantized layer
    (or the layer crashes when its width is not a multiple of the packing block). Validation must never change
    training, so the layers keep the layout that trains; eval forwards dequantize as training ones do.
    """
    bnb = import_bitsandbytes()
    for layer in module.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            layer.support_avx512bf16_for_cpu = False


def replace_linear_layers(model: nn.Module, mode: str, dtype: torch.dtype, device: torch.device) -> int:
    """Swaps every ``nn.Linear`` (on the meta device) for a bitsandbytes layer that quantizes on load."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, _new_layer(child, mode, dtype, device))
                replaced += 1
    return replaced


def quantize_pending_layers(model: nn.Module, device: torch.device) -> None:
    """Quantizes 4-bit layers that hold real but not yet quantized weights (a model built without our loader)."""
    bnb = import_bitsandbytes()
    keep_training_layout(model)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = module.weight
            if not weight.is_meta and weight.dtype != torch.uint8:
                _quantize_4bit(module, weight.data, device)


def is_bitsandbytes_parameter(param: torch.Tensor) -> bool:
    # Never import bitsandbytes here: if nothing imported it, no parameter is one of its types, and importing it
    # inside the profiled step (the ledger asks this) would fill the trace with its imports.
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(param, (bnb.nn.Params4bit, bnb.nn.Int8Params))


def is_quantized_parameter(param: torch.Tensor) -> bool:
    """Stored quantized: 4-bit packed (bitsandbytes, or torchao's NF4, whose dtype is the one it dequantizes to), or
    int8. int8-training keeps float16 weights (quantized only inside the matmul), so its parameters are not."""
    return (is_bitsandbytes_parameter(param) and param.dtype in (torch.uint8, torch.int8)) or is_nf4(param)
