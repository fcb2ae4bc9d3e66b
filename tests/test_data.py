"""memfit.training.data's sampler: where the data stands survives a resume, every rank together sees each sample once an
epoch with the longest samples in the profiled step, and --sample_order litgpt is litgpt's own order."""

import json

import pytest


@pytest.mark.parametrize("resumed_micro_batch", [4, 2])
def test_the_data_position_is_kept_in_samples_across_epochs(resumed_micro_batch):
    """A checkpoint keeps where the data stands in samples: resumed with the same micro-batch, or with a smaller one
    (the same global batch, as after running out of memory), the samples continue as in an uninterrupted run, also
    past an epoch whose last micro-batch is short (10 samples in micro-batches of 4)."""
    from torch.utils.data import DataLoader

    from memfit.training.data import LongestFirstSampler, TrainBatches

    lengths = [3, 9, 4, 5, 2, 7, 6, 1, 8, 5]

    def batches(micro_batch: int) -> TrainBatches:
        sampler = LongestFirstSampler(lengths, seed=7)
        sampler.longest_position = 5
        return TrainBatches(DataLoader(list(range(len(lengths))), batch_size=micro_batch, sampler=sampler), sampler)

    straight = batches(4)
    flat = [int(i) for _ in range(12) for i in next(straight)]  # four epochs of 4 + 4 + 2
    first = batches(4)
    consumed = [int(i) for _ in range(4) for i in next(first)]  # into the second epoch
    state = first.state_dict()
    resumed = batches(resumed_micro_batch)
    resumed.load_state_dict(state)
    rest = [int(i) for _ in range(8 * 4 // resumed_micro_batch) for i in next(resumed)]
    assert len(consumed + rest) >= len(flat) and (consumed + rest)[: len(flat)] == flat
    assert consumed == flat[:14] and sorted(flat[:10]) == list(range(10))  # an epoch is every sample once


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_together_sees_each_sample_once_an_epoch(world_size):
    """The longest samples fill the profiled step (every rank's last micro-batch holds one), and still the ranks'
    orders together are one permutation of the data each epoch (the longest sample is not trained once per rank),
    the same global order for any number of ranks."""
    from memfit.training.data import LongestFirstSampler

    lengths = [3, 9, 4, 5, 2, 7, 6, 1, 8, 5, 4, 2, 9, 3, 6, 7]
    global_batch, position = 8, 11  # the profiled step is the second: samples 8-15 of the global order

    def orders(world: int) -> list[list[int]]:
        ranks = []
        for rank in range(world):
            sampler = LongestFirstSampler(lengths, seed=3, rank=rank, world_size=world)
            sampler.longest_position, sampler.step_samples = position // world, global_batch
            ranks.append(sampler.order(0))
        return ranks

    ranks = orders(world_size)
    merged = [i for step in zip(*ranks) for i in step]  # rank r holds every world_size-th sample from r
    assert sorted(merged) == list(range(len(lengths)))
    assert merged == [i for step in zip(*orders(1)) for i in step]
    profiled = merged[global_batch : 2 * global_batch]
    assert sorted(lengths[i] for i in profiled) == sorted(sorted(lengths, reverse=True)[:global_batch])
    per_rank_last = [rank[2 * global_batch // world_size - 1] for rank in ranks]
    assert sorted(lengths[i] for i in per_rank_last) == sorted(sorted(lengths, reverse=True)[:world_size])


def test_sample_order_litgpt_is_the_order_litgpts_dataloader_draws(tmp_path):
    """``--sample_order litgpt``: the sampler's order over two epochs is the one litgpt's own fine-tuning DataLoader
    (litgpt.data.JSON.train_dataloader, seeded by --data.seed) gives, index for index; the default order is not."""
    from litgpt.data import JSON

    from memfit.training.data import LongestFirstSampler

    json_path = tmp_path / "records.json"
    json_path.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}]))
    data = JSON(json_path=json_path, val_split_fraction=0.1, seed=7)
    n = 37
    data.train_dataset = list(range(n))  # the sample indices themselves, so the loader yields its order
    data.batch_size, data.max_seq_length = 4, 64
    loader = data.train_dataloader()
    loader.collate_fn = list
    litgpt_order = [[i for batch in loader for i in batch] for _ in range(2)]  # each epoch a fresh iterator

    sampler = LongestFirstSampler([1] * n, seed=1337)
    sampler.litgpt_seed = data.seed
    assert [sampler.order(0), sampler.order(1)] == litgpt_order
    assert litgpt_order[0] != litgpt_order[1]
    sampler.litgpt_seed = None
    assert sampler.order(0) != litgpt_order[0]


def test_a_corpus_that_is_one_long_line_is_tokenized_in_pieces_cut_where_a_token_ends(tmp_path, embedded, monkeypatch):
    """A PlainText corpus of one 89 MB line made the tokenizer abort the process (exit 134): text past
    ``TOKENIZED_AT_ONCE`` characters is tokenized in pieces, cut at a line end or else a space. Here with the limit
    lowered, on the embedded tokenizer: the pieces give back the text, and nearly the tokens of the whole."""
    from litgpt.tokenizer import Tokenizer

    import memfit.training.data as data

    words = (embedded[1].with_name("corpus.txt").read_text().split() * 3)[:6000]
    one_line = " ".join(words)
    pieces = list(data.text_pieces(one_line, 1000))
    assert "".join(pieces) == one_line and max(map(len, pieces)) <= 1000 and len(pieces) > 20
    assert all(piece.endswith(" ") for piece in pieces[:-1])  # cut after a space, never inside a word
    lines = "\n".join(words[i : i + 40] and " ".join(words[i : i + 40]) for i in range(0, len(words), 40))
    assert all(piece.endswith("\n") for piece in list(data.text_pieces(lines, 1000))[:-1])

    tokenizer = Tokenizer(embedded[0])
    whole = len(tokenizer.encode(one_line, bos=False, eos=False))
    (tmp_path / "corpus.txt").write_text(one_line)
    monkeypatch.setattr(data, "TOKENIZED_AT_ONCE", 1000)
    text = data.PlainText(path=tmp_path / "corpus.txt")
    text.connect(tokenizer, max_seq_length=32)
    text.setup()
    blocks = len(text.train_dataset) + len(text.val_dataset)
    assert abs(blocks * 33 - whole) <= 33 + len(pieces), (blocks, whole)
