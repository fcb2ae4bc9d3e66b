"""memfit.trace_events on small hand-made traces: what the ledger and the offline page read from a profiler trace."""

from memfit.trace_events import operator_memory


def _op(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _memory(ts: float, total: int, size: int, address: int, tid: int = 1) -> dict:
    args = {"Total Allocated": total, "Bytes": size, "Addr": address, "Device Type": 0}
    return {"name": "[memory]", "ts": ts, "tid": tid, "args": args}


def test_each_allocation_belongs_to_the_innermost_operator_that_is_not_an_allocation_primitive():
    """aten::mm's output, made by the aten::empty inside it (inside aten::linear), is counted for aten::mm; a block freed
    inside another operator lowers that one's size increase; a block outside every operator is named so; a block
    never freed is alive at the end; the largest comes first."""
    events = [
        _op("aten::linear", 0, 100),
        _op("aten::mm", 10, 50),
        _op("aten::empty", 20, 5),
        _op("aten::relu", 200, 100),
        _op("aten::empty", 210, 5),
        _op("aten::relu", 0, 1000, tid=2),  # another thread's operator around the same moments: not the maker
        _memory(22, 4096, 4096, 0xA),  # made in aten::mm (inside aten::linear), through aten::empty
        _memory(212, 4096 + 1024, 1024, 0xB),  # made in aten::relu
        _memory(250, 1024, -4096, 0xA),  # the mm output freed inside aten::relu
        _memory(400, 1024 + 512, 512, 0xC),  # outside every operator
    ]
    operators, allocations = operator_memory(events, device_type=0)
    rows = {row["operator"]: row for row in operators}
    assert rows["aten::mm"] == {
        "operator": "aten::mm",
        "count": 1,
        "allocated": 4096,
        "largest": 4096,
        "increase": 4096,
    }
    assert rows["aten::relu"]["count"] == 1 and rows["aten::relu"]["increase"] == 1024 - 4096
    assert rows["(outside any operator)"]["allocated"] == 512
    assert [row["operator"] for row in operators] == ["aten::mm", "aten::relu", "(outside any operator)"]
    assert allocations[0] == {"operator": "aten::mm", "bytes": 4096, "made_ms": 0.0, "freed_ms": (250 - 22) / 1000}
    assert allocations[-1]["freed_ms"] is None and [a["bytes"] for a in allocations] == [4096, 1024, 512]


def test_a_trace_without_memory_events_has_no_rows():
    assert operator_memory([_op("aten::mm", 0, 1)], device_type=0) == ([], [])
