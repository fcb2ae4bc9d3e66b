"""``--activation_offloading``: the activations autograd saves in forward wait in pinned host memory, and come back
to the device when backward needs them.

The mechanism is torch's own, ``torch.autograd.graph.saved_tensors_hooks``, as in ``torch.autograd.graph.save_on_cpu``,
with two differences. Parameters stay where they are: ``save_on_cpu`` copies every saved tensor, so each weight a
layer saves for its input's gradient (every linear's) crossed PCIe twice a micro-batch and came back as a second
device copy during backward. Tensors under ``MIN_BYTES`` stay too (a transfer costs more than they hold). The copies
are synchronous, not overlapped with compute on a side stream as torchtune's ``OffloadActivations`` does: simpler,
and the estimate prices the transfer as time added to the step (``memfit.prediction.planner``), so the planner never
undercounts it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

import torch

MIN_BYTES = 1024
"""Saved tensors smaller than this stay on the device"""


class OffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Within it, every saved tensor of at least ``MIN_BYTES`` on a device of ``from_devices`` is copied to host
    memory (pinned where CUDA is) and copied back in backward; parameters are saved as they are. ``moved`` counts
    the bytes sent to the host. ``from_devices``: ``("cuda",)`` in a run; a test passes ``("cpu",)`` to take the same
    copies on a CPU."""

    def __init__(self, from_devices: tuple[str, ...] = ("cuda",)) -> None:
        self.moved = 0
        pin = torch.cuda.is_available()

        def pack(tensor: torch.Tensor):
            if (
                isinstance(tensor, torch.nn.Parameter)
                or tensor.device.type not in from_devices
                or tensor.untyped_storage().nbytes() < MIN_BYTES
            ):
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
            host.copy_(tensor)
            self.moved += host.untyped_storage().nbytes()
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def offload_activations(model: torch.nn.Module, from_devices: tuple[str, ...] = ("cuda",)) -> torch.nn.Module:
    """Runs ``model``'s forward (the loss too: ``memfit.training.loss`` computes it inside the head's forward) under
    ``OffloadedActivations``, so a script's step needs no change."""
    forward: Callable = model.forward

    @wraps(forward)
    def offloaded_forward(*args, **kwargs):
        with OffloadedActivations(from_devices):
            return forward(*args, **kwargs)

    model.forward = offloaded_forward
    return model
