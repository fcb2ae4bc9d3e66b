"""What each role of a training step holds now: the storages of the parameters (trainable, frozen, quantized),
gradients and optimizer state by address, and the tensors autograd saves for backward (activations). The ledger
attributes the allocations alive at a peak with these maps; the estimate and the out-of-memory explanation size the
roles with them."""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from memfit.training.bitsandbytes_layers import is_quantized_parameter
from memfit.training.strategy import BUCKET_COPIES
from memfit.training.torchao_nf4 import inner_tensors, is_nf4

ROLES = ("params_trainable", "params_frozen", "params_quantized", "gradients", "optimizer_state", "activations")


def _quant_state_tensors(param) -> list[torch.Tensor]:
    state = getattr(param, "quant_state", None)
    if state is None:
        return []
    tensors = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return tensors


def _int8_copies(module: torch.nn.Module) -> list[torch.Tensor]:
    """The int8 copy of a float16 weight and its scales that bitsandbytes' ``Linear8bitLt`` keeps on its
    ``MatmulLtState`` from one forward to the next (``bnb.int8-training``); none where the copy is the weight itself."""
    state = getattr(module, "state", None)
    if type(state).__name__ != "MatmulLtState" or not isinstance(getattr(state, "CB", None), torch.Tensor):
        return []
    if state.CB.data_ptr() == module.weight.data_ptr():
        return []
    return [t for t in (state.CB, state.SCB) if isinstance(t, torch.Tensor)]


def local(tensor):
    """This rank's shard of a ``DTensor`` (FSDP's parameters, gradients and optimizer state), where its memory is;
    any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def bucket_copies(model: torch.nn.Module) -> list[torch.Tensor]:
    """``model``'s DDP bucket copies (``memfit.training.strategy.BUCKET_COPIES``, noted by ``note_bucket_copies``);
    ``model`` is Fabric's module or the estimate's own."""
    holder = getattr(model, "_forward_module", model)
    return list(getattr(holder, BUCKET_COPIES, {}).values())


def _tensors_by_role(model: torch.nn.Module, optimizer) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    # Under FSDP a module's parameters are its shards (DTensors), except while it is gathered: then they are the
    # gathered copies (the root stays gathered from its forward to its backward), new memory beside the shards.
    sharded = any(isinstance(p, DTensor) for p in params)
    gathered = [p for p in params if sharded and not isinstance(p, DTensor)]
    params = [p for p in params if not sharded or isinstance(p, DTensor)]
    quantized = [p for p in params if is_quantized_parameter(local(p))]
    state = getattr(optimizer, "state", {}) or {}
    by_role = {
        "params_quantized": quantized
        + [t for p in quantized for t in _quant_state_tensors(p)]
        + [t for m in model.modules() for t in _int8_copies(m)],
        "params_trainable": [p for p in params if p.requires_grad],
        "params_frozen": [p for p in params if not p.requires_grad and not is_quantized_parameter(local(p))]
        + list(model.buffers()),
        "gradients": [p.grad for p in params if p.grad is not None]
        + _unsharded_gradients(model)
        + bucket_copies(model),
        "optimizer_state": [
            t for per_param in state.values() for t in per_param.values() if isinstance(t, torch.Tensor)
        ],
        GATHERED: gathered,
    }
    # an NF4 weight is a wrapper: its memory is in its inner tensors
    return {
        role: [inner for t in tensors for inner in (inner_tensors(local(t)) if is_nf4(local(t)) else [local(t)])]
        for role, tensors in by_role.items()
    }


def _unsharded_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP keeps unsharded between micro-batches (``no_backward_sync``): they are on its unsharded
    parameters, which ``model.parameters()`` does not return (it returns the shards, whose ``.grad`` is None until the
    reduce-scatter). torch has no public accessor for them, so FSDP's parameter group is read (``_get_fsdp_state``,
    ``_fsdp_param_group``, ``fsdp_params``, ``_unsharded_param``, ``unsharded_accumulated_grad``: the same in torch
    2.11, the GPU image's, as in 2.13, read from both wheels' sources)."""
    gradients = []
    for module in model.modules():
        for fsdp_param in _fsdp_params(module):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for grad in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)):
                if grad is not None:
                    gradients.append(grad)
    return gradients


def _fsdp_params(module: torch.nn.Module) -> list:
    """The parameters of the FSDP unit ``module`` is (its own group, not its children's), as FSDP holds them; none
    for a module that is no unit."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    group = getattr(state, "_fsdp_param_group", None)
    return list(getattr(group, "fsdp_params", ()))


def unsharded_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The gathered parameters of the FSDP units in ``module`` (the objects forward uses and autograd saves, whose
    memory FSDP frees and allocates again around each use), beside the shards ``module.parameters()`` returns."""
    found = (getattr(p, "_unsharded_param", None) for m in module.modules() for p in _fsdp_params(m))
    return [p for p in found if isinstance(p, torch.Tensor)]


def _address(tensor: torch.Tensor, storage) -> int:
    """Where a storage is: its data pointer; a fake tensor has none, so the storage object's id (as the estimate's
    live-bytes counter keys it)."""
    return id(storage) if is_fake(tensor) else storage.data_ptr()


def sizes_by_role(addresses: dict[int, tuple[str, int]]) -> dict[str, int]:
    """Bytes per role of an address map (``role_addresses``)."""
    sizes = dict.fromkeys(("params_quantized", "params_trainable", "params_frozen", "gradients", "optimizer_state"), 0)
    for role, size in addresses.values():
        sizes[role] = sizes.get(role, 0) + size
    return sizes


def role_sizes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes held by each role now, from the real tensors (each storage counted once)."""
    return sizes_by_role(role_addresses(model, optimizer))


def role_addresses(model: torch.nn.Module, optimizer) -> dict[int, tuple[str, int]]:
    """The address of every storage each role holds now: ``{address: (role, bytes)}`` (see ``_address``)."""
    addresses: dict[int, tuple[str, int]] = {}
    for role, tensors in _tensors_by_role(model, optimizer).items():
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            addresses.setdefault(_address(tensor, storage), (role, storage.nbytes()))
    return addresses


class SavedActivations:
    """Counts the bytes autograd saves for backward (parameters excluded) that are still saved when it exits.

    A storage saved and freed again while it is active (a loss that takes its gradients in forward,
    ``memfit.training.loss``) is not counted; nor is it kept alive to be counted, which would change the memory
    measured."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.bytes = 0
        self.addresses: dict[int, int] = {}
        """``{data_ptr: bytes}`` of what was saved (real tensors only), for the ledger's attribution"""
        self.storage_refs: dict[int, weakref.ref] = {}
        """A weak reference to every storage saved (fake tensors too), by the reference's ``id``: CPython hands out
        one reference per live object, so another ``weakref.ref`` taken of a storage matches it, even once it died"""
        self._seen: dict[int, weakref.finalize] = {}

    def __enter__(self) -> SavedActivations:
        self._params = {
            id(t.untyped_storage())
            for p in self.model.parameters()
            if not p.is_meta
            for t in (inner_tensors(local(p)) if is_nf4(local(p)) else [local(p)])
        }
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if is_nf4(tensor):  # a 4-bit weight torchao's linear keeps for backward (a wrapper: it has no storage)
            return tensor
        storage = tensor.untyped_storage()  # one Python object per live storage, for as long as it lives
        key = id(storage)
        if key not in self._params and key not in self._seen:
            size = storage.nbytes()
            self.bytes += size
            ref = weakref.ref(storage)
            self.storage_refs[id(ref)] = ref
            address = None if tensor.is_meta else _address(tensor, storage)
            if address is not None:
                self.addresses[address] = size
            self._seen[key] = weakref.finalize(storage, self._freed, key, size, id(ref), address)
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _freed(self, key: int, size: int, ref_key: int, address: int | None) -> None:
        del self._seen[key]
        self.bytes -= size
        self.storage_refs.pop(ref_key, None)
        if address is not None:
            self.addresses.pop(address, None)

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for finalizer in self._seen.values():  # what is saved now stays counted while backward frees it
            finalizer.detach()
        self._seen.clear()


UNATTRIBUTED = "unattributed"


GATHERED = "gathered_params"
"""FSDP's gathered copies of sharded weights (the all-gathers' outputs, new memory beside each rank's shard): found by
the ``FSDP::all_gather`` profiler range that made them"""


WORKSPACES = "cublas_workspaces"
"""The bytes of PyTorch's cuBLAS workspaces (CUDA): found by address like a role, measured by freeing them"""


LOSS = "loss"
"""What the loss's head makes (its chunks' logits and log-softmax, their gradients) that no role above holds: found by
the loss's profiler range (``memfit.trace_events.LOSS_RANGE``)"""


def counted(gathered: bool, workspaces: bool, loss: bool = False) -> tuple[str, ...]:
    """What a ledger's phase or a timeline counts bytes under, in the order shown: the roles, FSDP's gathered weights,
    the cuBLAS workspaces and the loss's buffers where the step has any, then what is unattributed."""
    return (
        ROLES
        + ((GATHERED,) if gathered else ())
        + ((WORKSPACES,) if workspaces else ())
        + ((LOSS,) if loss else ())
        + (UNATTRIBUTED,)
    )
