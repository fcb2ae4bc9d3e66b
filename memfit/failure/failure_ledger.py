"""What was alive at an out-of-memory, read at the failure itself: the run's roles by address, the activations the
failed step's autograd graphs still save, the other tensors Python still holds, and (on CUDA) every live block of
the allocator, written to ``<run dir>/oom/`` so that the explanation names what filled the device, not only its
totals.

Read while the failed step's frames are still alive (before ``memfit.failure.oom.release_failed_step``): the error's
traceback holds its tensors, and the graphs built up to the failure hold what they saved for backward.
"""

from __future__ import annotations

import gc
import json
import pickle
import re
import sys
import traceback
import types
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

from memfit.observatory.allocator_snapshot import active_blocks
from memfit.observatory.roles import local, role_addresses, unsharded_parameters
from memfit.units import fmt_bytes

LARGEST = 10
"""How many of the largest tensors outside the roles the ledger lists"""


def _failing_request(error: BaseException) -> int | None:
    """The bytes the failed allocation asked for, from the allocator's message (CUDA's "Tried to allocate 2.00 GiB",
    the CPU allocator's "you tried to allocate 8589934592 bytes")."""
    text = str(error)
    if found := re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", text):
        number, unit = found.groups()
        return int(float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit])
    if found := re.search(r"allocate (\d+) bytes", text):
        return int(found.group(1))
    return None


_LIBRARIES_BELOW_THE_MODEL = ("torch", "lightning", "bitsandbytes", "torchao")
"""Packages whose frames are the failed operation's machinery, not the line of the model or script that asked"""


def _where_it_failed(error: BaseException) -> dict | None:
    """The line that asked for the failed allocation: the innermost frame of the error's traceback outside torch
    and the libraries around it (a litgpt model's, a Memfit module's or the script's), with the operation it was
    in (the innermost frame of all) beside it."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None

    def outside(frame) -> bool:
        return _short(frame.filename).split("/")[0] not in _LIBRARIES_BELOW_THE_MODEL

    asked = next((frame for frame in reversed(frames) if outside(frame)), frames[-1])
    operation = frames[-1]
    return {
        "source": f"{_short(asked.filename)}:{asked.lineno}",
        "code": (asked.line or "").strip(),
        "operation": f"{_short(operation.filename)}:{operation.lineno} {operation.name}",
    }


def _short(filename: str) -> str:
    """A source file's path from its package's own dir: site-packages' prefix says nothing."""
    parts = Path(filename).parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("site-packages", "dist-packages"):
            return "/".join(parts[i + 1 :])
    return "/".join(parts[-2:])


HOLDER_DEPTH = 6
"""How many containers up from a tensor ``_where_held`` looks for the variable that holds it (a list in a dict in an
object's attribute is three)"""


def _where_held(tensors: list[torch.Tensor], ours: set[int], frames: list) -> list[str | None]:
    """For each of ``tensors``, the Python name that holds it and where that name lives: a local variable of a
    running function (with the line it is at), a variable a function closes over or a module's global (with the line
    the function is defined at), reached through the lists, tuples, dicts and objects between them, as "`kept`[3] (a
    local of train, train.py:52)". A tensor made outside a recorded step has no record of the line that made it (the
    profiler was not running, and nothing cheap enough to run on every step records one on a CPU): the name that
    keeps it alive is what a leak is fixed at. ``ours``: the ids of the containers the ledger itself made;
    ``frames``: the running functions' and the failed step's (a running frame's locals are not among the objects
    Python's collector tracks). One scan of Python's objects per container level (``gc.get_referrers`` with every
    object of the level at once), not one per tensor."""
    modules = {id(vars(module)): name for name, module in list(sys.modules.items()) if module is not None}
    found: list[str | None] = [None] * len(tensors)
    # the objects of this level: {id: (object, [(a tensor's index, the path from the object down to it), ...])}
    level = {}
    for i, tensor in enumerate(tensors):
        level.setdefault(id(tensor), (tensor, []))[1].append((i, ""))
    seen = set(level) | ours
    for _ in range(HOLDER_DEPTH):
        objects = [entry[0] for entry in level.values()]
        seen.update({id(objects), *(id(entry) for entry in level.values())})
        for frame in frames:
            for name, value in frame.f_locals.items():
                for index, below in level.get(id(value), (None, []))[1]:
                    found[index] = found[index] or f"`{name}`{below} {_frame_place(frame)}"
        above: dict[int, tuple[object, list[tuple[int, str]]]] = {}
        for holder in gc.get_referrers(*objects):
            if id(holder) in seen or holder is level or holder is above:
                continue
            if isinstance(holder, types.FrameType) and holder.f_code.co_filename == __file__:
                continue  # this module's own frames, which hold what they are reading
            seen.add(id(holder))
            for held in gc.get_referents(holder):
                paths = [(index, below) for index, below in level.get(id(held), (None, []))[1] if not found[index]]
                named = _name_in(holder, held, modules) if paths else None
                if named is None:
                    continue
                where, step = named
                for index, below in paths:
                    if where is not None:
                        found[index] = f"{step}{below} {where}"
                    else:
                        above.setdefault(id(holder), (holder, []))[1].append((index, f"{step}{below}"))
        level = {key: (obj, [(i, path) for i, path in paths if not found[i]]) for key, (obj, paths) in above.items()}
        level = {key: entry for key, entry in level.items() if entry[1]}
        if not level:
            break
    return found


def _frame_place(frame) -> str:
    """Where a running function's variables live: the function and the line it is at."""
    code = frame.f_code
    owner = (
        f"a global of {frame.f_globals.get('__name__')}" if code.co_name == "<module>" else f"a local of {code.co_name}"
    )
    return f"({owner}, {_short(code.co_filename)}:{frame.f_lineno})"


def _name_in(holder, held, modules: dict[int, str]) -> tuple[str | None, str] | None:
    """How ``holder`` holds ``held``: ``(where, name)``, where ``where`` ends the search (a running function's local,
    a function's closure, a module's global) or is None for a container to look above (its index or key as
    ``name``); None where it holds it in no way that names it."""
    if isinstance(holder, types.FrameType):
        # a variable a nested function closes over is a cell in the frame: its contents are the frame's local
        value = held.cell_contents if isinstance(held, types.CellType) else held
        name = next((key for key, local in holder.f_locals.items() if local is value), None)
        if name is None:
            return None
        return _frame_place(holder), f"`{name}`"
    if isinstance(holder, types.FunctionType):
        return None  # its closure (named by the cell below it), defaults or globals: reached from them
    if isinstance(holder, tuple) and holder and all(isinstance(cell, types.CellType) for cell in holder):
        function = next((f for f in gc.get_referrers(holder) if isinstance(f, types.FunctionType)), None)
        if function is not None and function.__closure__ is holder:
            name = function.__code__.co_freevars[next(i for i, cell in enumerate(holder) if cell is held)]
            code = function.__code__
            return (
                f"(a variable {function.__qualname__} closes over, {_short(code.co_filename)}:{code.co_firstlineno})",
                f"`{name}`",
            )
    if isinstance(holder, types.CellType):
        return None, ""
    if isinstance(holder, dict):
        key = next((key for key, value in holder.items() if value is held), None)
        if key is None:
            return None
        if id(holder) in modules:
            return f"(a global of {modules[id(holder)]})", f"`{key}`"
        return None, f"[{key!r}]"
    if isinstance(holder, (list, tuple)):
        index = next((i for i, value in enumerate(holder) if value is held), None)
        return (None, f"[{index}]") if index is not None else None
    attributes = getattr(holder, "__dict__", None)
    if attributes is held:
        return None, ""  # an object's attribute dict: named by its key below
    if isinstance(attributes, dict):  # an object's attributes, held inline where Python keeps no dict of them
        key = next((key for key, value in attributes.items() if value is held), None)
        if key is not None:
            return None, f".{key}"
    return None, f"<{type(holder).__name__}>"


def _saved_by_graphs(tensors: list[torch.Tensor]) -> tuple[dict[int, tuple[int, str, torch.Tensor, int]], list]:
    """``{storage address: (bytes, the saving node's name, tensor, the node's id)}`` of what the autograd graphs
    behind ``tensors`` save for backward (their nodes' ``_saved_*`` tensors), each node visited once; and the nodes
    visited, in the order found."""
    saved: dict[int, tuple[int, str, torch.Tensor, int]] = {}
    seen: set[int] = set()
    nodes = []
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        for tensor in _saved_tensors(node):
            if (storage := _storage_of(tensor)) is not None:
                saved.setdefault(storage[0], (storage[1], node.name(), tensor, id(node)))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return saved, nodes


def _storage_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(address, bytes)`` of the memory ``tensor`` views: a DTensor's (FSDP's parameters and their gradients) is
    its local shard's, as the rank holds it; None where there is none to read (a wrapper without storage)."""
    try:
        storage = local(tensor).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    # a storage FSDP has freed (a gathered weight after its use) is resized to nothing: it holds no memory, and
    # every such storage has the same address
    return (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None


def _saved_tensors(node) -> list[torch.Tensor]:
    """The tensors an autograd node saves for its backward (none once backward has run through it)."""
    tensors = []
    # torch's own nodes name each saved tensor ``_saved_<argument>``; a custom autograd.Function's node (Memfit's
    # frozen-head loss) gives what its forward passed to ``save_for_backward`` as ``saved_tensors``
    for name in dir(node):
        if not name.startswith("_saved_") and name != "saved_tensors":
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed already (backward ran through this node)
            continue
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta and tensor.device.type != "meta":
                tensors.append(tensor)
    return tensors


def _where_in_the_model(model) -> tuple[dict[int, str], dict[int, str]]:
    """Each parameter's place, ``block 3``, ``embedding`` or ``head`` (the final norm with the head): by the
    parameter's id (an ``AccumulateGrad`` node's variable) and by its storage's address (a weight saved for
    backward). Empty for a model without litgpt's ``transformer.h``."""
    transformer = getattr(model, "transformer", None)
    if transformer is None or not hasattr(transformer, "h"):
        return {}, {}
    places = [(f"block {i}", block) for i, block in enumerate(transformer.h)]
    places += [("embedding", transformer.wte), ("head", transformer.ln_f)]
    if hasattr(model, "lm_head"):
        places.append(("head", model.lm_head))
    by_id, by_address = {}, {}
    for place, module in places:
        # under FSDP the graph holds the gathered parameters, not the shards
        for parameter in [*module.parameters(), *unsharded_parameters(module)]:
            by_id.setdefault(id(parameter), place)
            if (storage := _storage_of(parameter)) is not None:
                by_address.setdefault(storage[0], place)
    return by_id, by_address


def _places_of_nodes(nodes: list, model) -> dict[int, str]:
    """``{node id: place}``: a node that uses a parameter (a weight it saved, or one it accumulates a gradient
    into) is at that parameter's place; any other at the place of the nearest such node among the operations
    before it (toward the inputs: a block's activation function at the block of the linear layer that fed it).
    Autograd nodes carry no module, so the place is read from the graph's shape."""
    by_id, by_address = _where_in_the_model(model)
    if not by_id:
        return {}
    own: dict[int, str] = {}
    for node in nodes:
        for child, _ in node.next_functions:
            if child is not None and hasattr(child, "variable") and id(child.variable) in by_id:
                own[id(node)] = by_id[id(child.variable)]
                break
        else:
            for tensor in _saved_tensors(node):
                place = by_address.get((_storage_of(tensor) or (None,))[0])
                if place is not None:
                    own[id(node)] = place
                    break
    # nearest place toward the inputs, children before parents (an iterative post-order of the DAG)
    nearest: dict[int, tuple[int, str]] = {key: (0, place) for key, place in own.items()}
    for node in _children_first(nodes):
        if id(node) in nearest:
            continue
        found = [nearest[id(child)] for child, _ in node.next_functions if child is not None and id(child) in nearest]
        if found:
            distance, place = min(found)
            nearest[id(node)] = (distance + 1, place)
    return {key: place for key, (_, place) in nearest.items()}


def _children_first(nodes: list) -> list:
    """``nodes`` ordered so that each comes after the nodes its ``next_functions`` lead to."""
    done: set[int] = set()
    order = []
    for start in nodes:
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in done:
                continue
            if expanded:
                done.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            stack.extend((child, False) for child, _ in node.next_functions if child is not None)
    return order


def _separate_graphs(nodes: list) -> dict[int, int]:
    """Each node's forward pass: ``{node id: the id of one node of its graph}``, for the groups of nodes joined by an
    edge, not counting the parameters' ``AccumulateGrad`` leaves that every forward shares (two micro-batches' graphs
    meet only there)."""
    parent = {id(node): id(node) for node in nodes if not hasattr(node, "variable")}

    def root(key: int) -> int:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for node in nodes:
        if id(node) not in parent:
            continue
        for child, _ in node.next_functions:
            if child is not None and id(child) in parent:
                parent[root(id(child))] = root(id(node))
    return {key: root(key) for key in parent}


def _activations_by_forward(nodes: list, saved: dict, micro_batch: int | None) -> list[dict]:
    """The activations of each forward pass whose graph still saves tensors for a backward, the newest first (autograd
    numbers its nodes in the order it makes them): the newest is the step's current micro-batch (``micro_batch``,
    counted from 1, where the run knows it); any older one was kept past its backward. A graph whose backward ran
    saves nothing any more, though a loss still held keeps its nodes."""
    graph_of = _separate_graphs(nodes)
    newest: dict[int, int] = {}
    for node in nodes:
        if id(node) in graph_of:
            graph = graph_of[id(node)]
            newest[graph] = max(newest.get(graph, -1), node._sequence_nr())
    sizes: dict[int, int] = {}
    for size, _, _, node in saved.values():
        if node in graph_of:
            sizes[graph_of[node]] = sizes.get(graph_of[node], 0) + size
    order = sorted(sizes, key=lambda graph: -newest[graph])
    current = f"micro-batch {micro_batch} of the failed step" if micro_batch else "the failed step's"
    return [
        {"forward": current if i == 0 else "an earlier forward, kept past its backward", "bytes": sizes[graph]}
        for i, graph in enumerate(order)
    ]


def _is_tensor(obj) -> bool:
    """A tensor with memory of its own: not a weakref.proxy whose object is gone (asking its class raises), nor one of
    the fake tensors torch.compile keeps with what it compiled (shapes only: asking for their data raises)."""
    try:
        return isinstance(obj, torch.Tensor) and not is_fake(obj)
    except ReferenceError:
        return False


def alive_at_failure(
    error: BaseException, model, optimizer, device: torch.device, micro_batch: int | None = None
) -> dict:
    """The failure's ledger: each role's bytes, the activations saved by the graphs still alive (by block, and by
    forward pass: ``micro_batch`` is the failed step's current one, from 1), the other tensors Python holds, and the
    largest of those two kinds, each with its shape, dtype and what holds it."""
    roles = role_addresses(model, optimizer) if model is not None else {}
    by_role: dict[str, int] = {}
    for role, size in roles.values():
        by_role[role] = by_role.get(role, 0) + size
    with warnings.catch_warnings():  # isinstance on some of gc's objects (torch's deprecated aliases) warns
        warnings.simplefilter("ignore")
        held = [
            obj for obj in gc.get_objects() if _is_tensor(obj) and obj.device.type == device.type and not obj.is_meta
        ]
    saved, nodes = _saved_by_graphs(held)
    others: dict[int, tuple[int, str, torch.Tensor, None]] = {}
    for tensor in held:
        if (storage := _storage_of(tensor)) is None:
            continue
        address, size = storage
        if address and address not in roles and address not in saved:
            others.setdefault(address, (size, "held by Python (not saved for backward)", tensor, None))
    saved = {address: entry for address, entry in saved.items() if address not in roles}
    by_role["activations"] = sum(size for size, _, _, _ in saved.values())
    by_role["other_tensors"] = sum(size for size, _, _, _ in others.values())
    places = _places_of_nodes(nodes, model) if model is not None else {}
    by_place: dict[str, int] = {}
    for size, _, _, node in saved.values():
        place = places.get(node, "elsewhere")
        by_place[place] = by_place.get(place, 0) + size
    largest = sorted([*saved.values(), *others.values()], key=lambda entry: -entry[0])[:LARGEST]
    # the names that keep the largest of Python's tensors alive: in the failed step's frames, the running ones, or
    # reached from them through containers (a leak's list, an object's attribute, a module's global)
    held_by_python = [tensor for _, holder, tensor, _ in largest if holder.startswith("held by")]
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    frames += [frame for frame, _ in traceback.walk_stack(sys._getframe(1))]
    ours = {id(held), id(largest), *(id(entry) for entry in (*saved.values(), *others.values()))}
    names = dict(zip(map(id, held_by_python), _where_held(held_by_python, ours, frames), strict=True))
    del frames
    ledger = {
        "device": str(device),
        "error": (str(error).splitlines() or [""])[0],
        "failing_request_bytes": _failing_request(error),
        "failing_request_at": _where_it_failed(error),
        "bytes_by_role": by_role,
        # where in the model backward needs the activations: a block's share, or the embedding's or head's
        "activations_by_place": dict(sorted(by_place.items(), key=_place_order)),
        "activations_by_forward": (by_forward := _activations_by_forward(nodes, saved, micro_batch)),
        "forward_graphs_alive": len(by_forward),
        "largest": [
            {
                "bytes": size,
                "held_by": ("saved by " + holder) if not holder.startswith("held by") else holder,
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                **({"place": places[node]} if node in places else {}),
                **({"held_at": names[id(tensor)]} if names.get(id(tensor)) else {}),
            }
            for size, holder, tensor, node in largest
        ],
    }
    if device.type == "cuda":
        segments = torch.cuda.memory_snapshot(device)
        blocks = active_blocks(segments)
        known = set(roles) | set(saved) | set(others)
        ledger["cuda_live_blocks_bytes"] = sum(blocks.values())
        ledger["cuda_blocks_nothing_here_holds_bytes"] = sum(s for a, s in blocks.items() if a not in known)
    return ledger


def _place_order(item: tuple[str, int]) -> tuple:
    """The embedding, the blocks in order, the head, then anything else."""
    place = item[0]
    if place.startswith("block "):
        return (1, int(place.split()[1]))
    return ({"embedding": 0, "head": 2}.get(place, 3), 0)


def write_failure_ledger(run_dir: Path, ledger: dict, device: torch.device, rank: int = 0) -> Path:
    """``<run dir>/oom/ledger.json`` (``ledger-rank<N>.json`` past rank 0), and on CUDA the allocator's snapshot
    beside it, which pytorch.org/memory_viz opens (with each block's Python frames where its history was recorded)."""
    out = Path(run_dir) / "oom"
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"-rank{rank}" if rank else ""
    path = out / f"ledger{suffix}.json"
    path.write_text(json.dumps(ledger, indent=2))
    if device.type == "cuda":
        with open(out / f"memory_snapshot{suffix}.pickle", "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(device), f)
    return path


def holders_line(ledger: dict, count: int = 3) -> str:
    """The largest holders at the failure, for the explanation's lines."""
    roles = sorted(((size, role) for role, size in ledger["bytes_by_role"].items() if size), reverse=True)
    parts = [f"{role} {fmt_bytes(size)}" for size, role in roles[:count]]
    line = "Largest holders at the failure: " + ", ".join(parts)
    if ledger["largest"]:
        top = ledger["largest"][0]
        line += (
            f"; the largest tensor outside the weights, gradients and optimizer state: {fmt_bytes(top['bytes'])}"
            f" {top['dtype']}{top['shape']} {top['held_by']}" + (f", as {top['held_at']}" if top.get("held_at") else "")
        )
    if ledger["failing_request_bytes"]:
        line += f"; the failed request: {fmt_bytes(ledger['failing_request_bytes'])}"
    where = ledger.get("failing_request_at")
    if where:
        inside = "" if where["operation"].startswith(where["source"] + " ") else f" (in {where['operation']})"
        line += f"\nThe failed request came from {where['source']}: {where['code']}{inside}"
    places = sorted(((size, place) for place, size in ledger.get("activations_by_place", {}).items()), reverse=True)
    if places:
        shown = ", ".join(f"{place} {fmt_bytes(size)}" for size, place in places[:count])
        more = f" and {len(places) - count} more" if len(places) > count else ""
        line += f"\nActivations by where backward needs them: {shown}{more}"
    graphs = ledger.get("forward_graphs_alive", 0)
    if graphs > 1:
        forwards = ", ".join(f"{f['forward']} {fmt_bytes(f['bytes'])}" for f in ledger["activations_by_forward"])
        line += (
            f"\n{graphs} forward passes' graphs were alive at once: one waits for its backward, the others were kept"
            f" past theirs (a loss or an output held without .detach()?): {forwards}"
        )
    return line
