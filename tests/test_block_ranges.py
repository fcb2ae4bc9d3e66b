"""memfit.observatory.block_ranges: each transformer block's forward and backward as a range of a real profiler
trace, so the ledger can name the block an allocation was made in (a compiled block's kernels name none)."""

import pytest
import torch

from memfit.observatory.block_ranges import mark_block_ranges
from memfit.trace_events import BLOCK_RANGE, block_at, by_thread, memory_events, read_trace_events


@pytest.mark.parametrize("embedding_trained", [True, False])
def test_each_blocks_forward_and_backward_is_a_range_that_holds_what_it_made(tmp_path, embedding_trained):
    """A 3-block litgpt model, one forward and backward under torch.profiler: every block has one forward range and
    one backward range, the forwards in order and the backwards in reverse, none overlapping another block's, the first block's backward
    closed too where its input needs no gradient (a frozen embedding: closed when backward ends); the blocks make
    bytes in each, the same in each block's forward (the blocks are alike), and the embedding, head and loss outside
    them."""
    from litgpt import GPT, Config

    config = Config(n_layer=3, n_head=2, n_embd=64, block_size=32, vocab_size=64, padded_vocab_size=64)
    model = GPT(config)
    model.transformer.wte.weight.requires_grad_(embedding_trained)
    assert mark_block_ranges(model) == 3 and mark_block_ranges(model) == 0  # once per model
    x = torch.randint(0, 64, (2, 32))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        model(x).sum().backward()
    trace = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(trace))
    events = read_trace_events(trace)

    ranges = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(BLOCK_RANGE)),
        key=lambda e: e["ts"],
    )
    names = [e["name"][len(BLOCK_RANGE) :] for e in ranges]
    assert names == [f"transformer.h.{i}" for i in range(3)] + [f"transformer.h.{i} backward" for i in (2, 1, 0)]
    for earlier, later in zip(ranges, ranges[1:]):
        assert earlier["ts"] + earlier["dur"] <= later["ts"], (earlier["name"], later["name"])
    backward = next(e for e in events if e.get("name") == "autograd::engine::evaluate_function: SumBackward0")
    assert all(r["ts"] + r["dur"] <= backward["ts"] for r in ranges[:3])  # forwards before backward began
    assert all(r["ts"] >= backward["ts"] for r in ranges[3:])

    ops = by_thread(e for e in events if e.get("cat") == "user_annotation")
    made: dict[str, int] = {}
    for ts, _total, size, _address, thread in memory_events(events, 0):
        if size > 0:
            name = block_at(ts, thread, ops)
            made[name] = made.get(name, 0) + size
    forwards = [made.get(f"transformer.h.{i}", 0) for i in range(3)]
    backwards = [made.get(f"transformer.h.{i} backward", 0) for i in range(3)]
    assert forwards[0] > 0 and forwards.count(forwards[0]) == 3, forwards
    assert min(backwards) > 0, backwards
    assert made.get("", 0) > 0  # the embedding, the head and the loss are outside every block
