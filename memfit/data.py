"""Data for every script: litgpt DataModules, ordered longest-first and resumable mid-epoch.

litgpt's DataModules (``JSON``, ``Alpaca``, ``TextFiles``, ...) do tokenization, prompt styles and prompt masking
well, so we use them. What they lack is (1) the longest sample early, in the last micro-batch of the profiled
step (the first step with the optimizer state, and gradients already accumulating), so an out-of-memory shows within
the first steps rather than hours in and the memory ledger explains the run's peak, and (2) a data position that a
checkpoint can store. Both come from ``LongestFirstSampler``, which
replaces the DataModule's shuffling sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader, Sampler

from memfit.cli import UserError


def embedded_data(json_path: Path, val_split_fraction: float = 0.1):
    from litgpt.data import JSON

    # The loss counts the answers only (the embedded base already knows the prompts); num_workers=0: the data is
    # tiny and worker processes cost more start-up time than they save.
    return JSON(json_path=json_path, val_split_fraction=val_split_fraction, mask_prompt=True, num_workers=0)


class LongestFirstSampler(Sampler[int]):
    """A seeded shuffle per epoch with the longest sample moved to ``longest_position``, sharded across ranks.

    ``longest_position`` counts this rank's samples (0: the first). ``epoch`` and ``start`` (samples of this rank's
    shard already consumed) make the order resumable.
    """

    def __init__(self, lengths: list[int], seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.lengths = lengths
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0
        self.longest_position = 0
        self.longest = max(range(len(lengths)), key=lengths.__getitem__)

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        order.remove(self.longest)
        # every rank meets the longest sample at the same step, so every rank reaches its peak there
        at = min(self.longest_position, len(order) // self.world_size) * self.world_size
        order[at:at] = [self.longest] * self.world_size
        order = order[: len(order) - len(order) % self.world_size] if len(order) >= self.world_size else order
        return order[self.rank :: self.world_size]

    def __iter__(self):
        yield from self.order(self.epoch)[self.start :]

    def __len__(self) -> int:
        return len(self.order(self.epoch)) - self.start


class TrainBatches:
    """Endless micro-batches over epochs; ``state_dict`` is the data position a checkpoint stores."""

    def __init__(self, loader: DataLoader, sampler: LongestFirstSampler) -> None:
        self.loader = loader
        self.sampler = sampler
        self.batches_in_epoch = 0
        self._iterator = None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __next__(self):
        if self._iterator is None:
            self.sampler.start = self.batches_in_epoch * self.loader.batch_size
            self._iterator = iter(self.loader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.sampler.epoch += 1
            self.batches_in_epoch = 0
            self.sampler.start = 0
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        self.batches_in_epoch += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "batches_in_epoch": self.batches_in_epoch,
                "longest_position": self.sampler.longest_position}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.epoch = state["epoch"]
        self.batches_in_epoch = state["batches_in_epoch"]
        self.sampler.longest_position = state.get("longest_position", 0)  # 0: checkpoints from before it was kept
        self._iterator = None


def sample_lengths(dataset) -> list[int]:
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def check_records(dataset, what: str) -> None:
    """Instruction records as litgpt's prompt styles read them: a list of objects with string fields."""
    records = getattr(dataset, "data", None)
    if dataset is None or records is None:  # not an SFTDataset (plain text blocks, a streaming module): nothing to check here
        return
    while isinstance(records, torch.utils.data.Subset):  # litgpt's JSON splits a single file with random_split
        records = records.dataset
    if isinstance(records, list) and not records:
        raise UserError(f"{what}: the data holds no records; give a JSON list of instruction/output records")
    if not isinstance(records, list):
        raise UserError(f"{what}: the data must be a JSON list of records, got a {type(records).__name__}")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise UserError(f"{what}: record {i} is a {type(record).__name__}, not an object with instruction/output")
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                problem = "has no" if key not in record else f"has a {type(record[key]).__name__} as"
                raise UserError(f"{what}: record {i} {problem} {key!r}; every record needs string 'instruction'"
                                " and 'output' fields ('input' optional)")
        if "input" in record and not isinstance(record["input"], str):
            raise UserError(f"{what}: record {i} has a {type(record['input']).__name__} as 'input'; use a string")


def setup_data(data) -> None:
    """The DataModule's own preparation, with a malformed file reported in one line."""
    import json

    try:
        data.prepare_data()
        data.setup()
    except json.JSONDecodeError as error:
        raise UserError(f"{_data_name(data)} is not valid JSON ({error}); fix the file") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{_data_name(data)} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (KeyError, TypeError, AttributeError) as error:
        raise UserError(f"{_data_name(data)} does not have the layout {type(data).__name__} expects ({error!r})") from None


def _data_name(data) -> str:
    path = getattr(data, "json_path", None) or getattr(data, "path", None)
    return f"--data {type(data).__name__}" + (f" ({path})" if path else "")


def rebuild_loader(loader: DataLoader, sampler: Sampler | None) -> DataLoader:
    """The DataModule's loader with our sampler (or none, for validation order) in place of its own."""
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        shuffle=False,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        # Without its own generator, every iter(loader) draws a seed from the global RNG, so a resumed run (which
        # starts its iterator after restoring that RNG) would see different dropout masks than an uninterrupted one.
        generator=torch.Generator().manual_seed(0),
    )


# litgpt's pretraining modules built on litdata's streaming datasets (token blocks, not records)
_STREAMING = ("TextFiles", "LitData", "OpenWebText", "TinyLlama", "TinyStories", "MicroLlama")


def refuse_streaming(data) -> None:
    """litdata's streaming datasets cannot take Memfit's sampler (the longest sample in the profiled step, the data
    position a checkpoint keeps), and litdata needs torchvision, which pulls a CUDA build of torch into a CPU
    environment: refused in one line, with the module that reads the same text."""
    name = type(data).__name__
    if name in _STREAMING and type(data).__module__.startswith("litgpt.data"):
        raise UserError(f"--data {name} (litgpt's litdata streaming module) is not supported yet; for a directory of"
                        " .txt files use --data PlainText --data.path DIR")


def build_dataloaders(
    fabric, data, tokenizer, micro_batch_size: int, max_seq_length: int | None, seed: int, targets_fn
):
    """Returns ``(train_batches, val_loader, longest_train, longest_any)``; lengths are in tokens."""
    data.connect(tokenizer=tokenizer, batch_size=micro_batch_size, max_seq_length=max_seq_length)
    with fabric.rank_zero_first():
        setup_data(data)
    check_records(getattr(data, "train_dataset", None), _data_name(data))
    train_loader, val_loader = data.train_dataloader(), data.val_dataloader()
    if not len(train_loader.dataset):
        raise UserError(f"{_data_name(data)}: the training split is empty; give more data or a smaller"
                        " --data.val_split_fraction")
    samples = [train_loader.dataset[i] for i in range(len(train_loader.dataset))]
    train_lengths = [len(sample["input_ids"]) for sample in samples]
    if "labels" in samples[0] and not any(targets_fn({"labels": s["labels"][None]}) for s in samples):
        # every label masked: the loss would be 0 and nothing would learn, for ever
        raise UserError(
            f"{_data_name(data)}: no sample has a token to learn (every label is masked: empty 'output' fields,"
            " or prompts longer than --train.max_seq_length); check the data or raise --train.max_seq_length"
        )
    val_lengths = sample_lengths(val_loader.dataset) if val_loader is not None else []
    sampler = LongestFirstSampler(train_lengths, seed, fabric.global_rank, fabric.world_size)
    # use_distributed_sampler=False: the sampler above shards by rank itself and keeps the data position.
    train_loader = fabric.setup_dataloaders(rebuild_loader(train_loader, sampler), use_distributed_sampler=False)
    if val_loader is not None and val_lengths:
        val_loader = fabric.setup_dataloaders(rebuild_loader(val_loader, None))
    else:
        val_loader = None
    return TrainBatches(train_loader, sampler), val_loader, max(train_lengths), max(train_lengths + val_lengths)


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i * self.block : (i + 1) * self.block]}  # (max_seq_length + 1,)


@dataclass
class PlainText(DataModule):
    """Plain text for pretraining, tokenized once and cut into blocks of ``max_seq_length + 1`` tokens.

    litgpt's ``TextFiles`` needs litdata's optimize step; this reads files directly, which suits corpora that fit
    in memory (tiny-shakespeare, the embedded corpus).
    """

    path: Path
    """A .txt file, or a directory whose *.txt files are concatenated"""
    val_split_fraction: float = 0.05
    """The fraction of blocks, taken from the end of the text, used for validation"""
    num_workers: int = 0
    """DataLoader worker processes"""

    tokenizer: object = field(default=None, init=False, repr=False)
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=256, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()
        self.path = Path(self.path)
        if not self.path.exists():
            raise UserError(f"--data.path {str(self.path)!r} does not exist; give a .txt file or a directory of them")

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.max_seq_length = max_seq_length or 256

    def setup(self, stage: str = "") -> None:
        files = sorted(self.path.glob("*.txt")) if self.path.is_dir() else [self.path]
        text = "\n".join(f.read_text(encoding="utf-8") for f in files)
        tokens = self.tokenizer.encode(text, bos=False, eos=False).long()
        block = self.max_seq_length + 1
        n_val = max(1, int(len(tokens) // block * self.val_split_fraction))
        split = len(tokens) - n_val * block
        if split < block:
            raise UserError(f"{self.path} has {len(tokens)} tokens, too few for blocks of {block}")
        self.train_dataset, self.val_dataset = _Blocks(tokens[:split], block), _Blocks(tokens[split:], block)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)
