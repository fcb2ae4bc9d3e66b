"""memfit.observatory.block_lifetimes: the one replay of a step's allocations and frees, read by the ledger (what was
alive at a peak) and by the pictures (what each allocation was when it was made). The traces here are written by hand in
the profiler's shape, each a case the rule must decide."""

import random

from memfit.observatory.block_lifetimes import Roles, alive_at, lifetimes
from memfit.observatory.ledger import Ledger
from memfit.observatory.timeline import stack_by_role

KIB = 1024


def _event(ts, size, address, total=0, thread=1):
    return (ts, total, size, address, thread)


def _ledger(**maps) -> Ledger:
    ledger = Ledger(device="cpu", measures="test")
    ledger.addresses = {phase: [taken] for phase, taken in maps.items()}
    return ledger


def _roles_alive_at(ledger, memory, ends, t, gathering=()):
    roles = Roles(ledger, ends, memory, gathering)
    return {block.address: role for block, role in alive_at(lifetimes(memory, roles.before_step), t, roles)}


def test_an_activation_freed_in_backward_keeps_its_role_at_backwards_peak():
    """Forward's map names what autograd saved; backward's does not (its saved addresses are other blocks' by then).
    At backward's peak an activation not yet freed is found by the map at the first phase end after it was made."""
    ledger = _ledger(forward={0xA: ("activations", 4 * KIB)}, backward={0xC: ("gradients", 2 * KIB)})
    memory = [
        _event(1, 4 * KIB, 0xA),  # forward saves it
        _event(12, 2 * KIB, 0xC),  # backward's gradient
        _event(15, -4 * KIB, 0xA),  # freed once backward used it
    ]
    ends = [(10, "forward"), (20, "backward")]
    assert _roles_alive_at(ledger, memory, ends, 13) == {0xA: "activations", 0xC: "gradients"}
    assert _roles_alive_at(ledger, memory, ends, 16) == {0xC: "gradients"}


def test_a_block_freed_before_its_phase_ends_is_not_the_role_its_address_has_there():
    """The address maps are taken at phase ends: a scratch block freed before backward ended, whose address then
    held a gradient, was the scratch, not the gradient; the gradient made later at that address is the gradient."""
    ledger = _ledger(backward={0xB: ("gradients", 8 * KIB)})
    memory = [_event(11, 3 * KIB, 0xB), _event(13, -3 * KIB, 0xB), _event(14, 8 * KIB, 0xB)]
    ends = [(10, "forward"), (20, "backward")]
    assert _roles_alive_at(ledger, memory, ends, 12) == {0xB: "unattributed"}
    assert _roles_alive_at(ledger, memory, ends, 19) == {0xB: "gradients"}


def test_a_block_from_an_earlier_micro_batch_takes_the_role_it_had_then():
    """FSDP's unsharded gradients of the first micro-batch are a role at its backward's end and freed (reduced) in the
    second's backward, before that phase ends: at the second backward's peak they are still gradients."""
    ledger = Ledger(device="cpu", measures="test")
    ledger.addresses = {"backward": [{0xD: ("gradients", 6 * KIB)}, {}], "forward": [{}, {}]}
    memory = [_event(12, 6 * KIB, 0xD), _event(35, 1 * KIB, 0xE), _event(38, -6 * KIB, 0xD)]
    ends = [(10, "forward"), (20, "backward"), (30, "forward"), (40, "backward")]
    assert _roles_alive_at(ledger, memory, ends, 36) == {0xD: "gradients", 0xE: "unattributed"}


def test_blocks_alive_before_the_step_count_until_freed_or_their_address_is_taken():
    ledger = _ledger(forward={})
    ledger.baseline_addresses = {0xF: ("params_frozen", 16 * KIB), 0xA0: ("optimizer_state", 4 * KIB)}
    memory = [_event(2, -4 * KIB, 0xA0), _event(5, 1 * KIB, 0xF)]  # the second: a free the trace did not see
    ends = [(10, "forward")]
    assert _roles_alive_at(ledger, memory, ends, 1) == {0xF: "params_frozen", 0xA0: "optimizer_state"}
    assert _roles_alive_at(ledger, memory, ends, 3) == {0xF: "params_frozen"}
    assert _roles_alive_at(ledger, memory, ends, 6) == {0xF: "unattributed"}


def test_gathered_weights_are_what_an_all_gather_made_on_its_own_thread():
    ledger = _ledger(forward={})
    memory = [_event(2, 8 * KIB, 0x1, thread=7), _event(3, 8 * KIB, 0x2, thread=1), _event(6, 8 * KIB, 0x3, thread=7)]
    gathering = [(1, 4, 7)]  # FSDP::all_gather on thread 7
    found = _roles_alive_at(ledger, memory, [(10, "forward")], 9, gathering)
    assert found == {0x1: "gathered_params", 0x2: "unattributed", 0x3: "unattributed"}


def test_the_picture_and_the_ledger_read_one_replay():
    """Where no address changes role during the step, the picture's level of each role at any moment is what the
    ledger finds alive then: the same lifetimes and the same rule. Random traces of reused addresses."""
    rng = random.Random(0)
    for _ in range(30):
        roles_by_address = {address: rng.choice(["gradients", "activations", None]) for address in range(12)}
        memory, holding, ts = [], {}, 0
        for _ in range(80):
            ts += rng.randint(0, 2)  # several events may share a moment
            address = rng.randrange(12)
            if address in holding:
                memory.append(_event(ts, -holding.pop(address), address))
            else:
                holding[address] = rng.randrange(1, 64) * KIB
                memory.append(_event(ts, holding[address], address))
        ends = [(ts + 1, "forward")]
        # the map at the end names each live block's address with its fixed role
        ledger = _ledger(
            forward={a: (role, size) for a, size in holding.items() if (role := roles_by_address[a]) is not None}
        )
        ledger.baseline_addresses = {100: ("params_frozen", 5 * KIB)}
        timeline = stack_by_role(ledger, memory, [(0, ts + 1, "forward")], per_ms=1)
        for i, moment in enumerate(timeline["ms"]):
            if i + 1 < len(timeline["ms"]) and timeline["ms"][i + 1] == moment:
                continue  # the level after every event of that moment
            found: dict[str, int] = {}
            roles = Roles(ledger, ends, memory)
            for block, role in alive_at(lifetimes(memory, roles.before_step), moment, roles):
                found[role] = found.get(role, 0) + block.size
            drawn = {role: values[i] for role, values in timeline["roles"].items() if values[i]}
            assert drawn == found, (moment, drawn, found)


def test_a_buffer_made_in_forward_that_backward_makes_a_gradient_is_drawn_as_one_from_backward_on():
    """A trained head's loss sums its weight's gradient into a buffer in forward, which backward hands to the weight:
    the ledger finds it a gradient at backward's peak, and the timeline (what the picture and FSDP's estimate read)
    draws it unattributed through forward and a gradient from backward's first event on, not unattributed to the end
    (which FSDP's estimate then failed to shard)."""
    ledger = _ledger(forward={}, backward={0xA: ("gradients", 8 * KIB)})
    memory = [
        _event(1, 8 * KIB, 0xA),  # the buffer, in forward
        _event(5, 2 * KIB, 0xB),  # a chunk's scratch
        _event(6, -2 * KIB, 0xB),
        _event(12, 1 * KIB, 0xC),  # backward's first allocation
        _event(18, -1 * KIB, 0xC),
    ]
    ends = [(10, "forward"), (20, "backward")]
    assert _roles_alive_at(ledger, memory, ends, 15) == {0xA: "gradients", 0xC: "unattributed"}
    timeline = stack_by_role(ledger, memory, [(0, 10, "forward"), (10, 20, "backward")], per_ms=1)
    assert timeline["roles"]["unattributed"] == [8 * KIB, 10 * KIB, 8 * KIB, 1 * KIB, 0]
    assert timeline["roles"]["gradients"] == [0, 0, 0, 8 * KIB, 8 * KIB]
