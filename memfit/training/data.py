"""Data for every script: litgpt DataModules, ordered longest-first and resumable mid-epoch.

litgpt's DataModules (``JSON``, ``Alpaca``, ``TextFiles``, ...) do tokenization, prompt styles and prompt masking
well, so we use them. What they lack is (1) the longest sample early, in the last micro-batch of the profiled
step (the first step with the optimizer state, and gradients already accumulating), so an out-of-memory shows within
the first steps rather than hours in and the memory ledger explains the run's peak, and (2) a data position that a
checkpoint can store. Both come from ``LongestFirstSampler``, which
replaces the DataModule's shuffling sampler.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader, Sampler

from memfit.args import ProfileArgs
from memfit.errors import UserError
from memfit.training.out_dir import missing_dirs, remove_if_empty

# litdata asks PyPI for a newer version of itself (up to 30 s) in every process that opens a dataset or optimizes
# one, the DataLoader's spawned workers included; runs are offline. It reads the switch once, when first imported.
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")


def give_access_token(data, access_token: str | None) -> None:
    """litgpt's --access_token, for data that downloads gated files: the module's own ``access_token`` (LIMA) and
    ``HF_TOKEN`` for the Hugging Face libraries the modules download with. A module that downloads nothing would
    ignore it, so it is refused there."""
    if access_token is None:
        return
    if data is None or not hasattr(data, "access_token"):
        name = type(data).__name__ if data is not None else "the embedded data"
        raise UserError(
            f"--access_token is for data modules that download gated data (e.g. --data LIMA); {name}"
            " takes none, and Memfit downloads no checkpoints: drop it"
        )
    if data.access_token is None:
        data.access_token = access_token
    os.environ["HF_TOKEN"] = access_token


def check_sample_order(sample_order: str, data) -> None:
    """``--sample_order litgpt`` draws litgpt's permutation from the data module's ``seed`` (``--data.seed``)."""
    if sample_order == "litgpt" and data is not None and not isinstance(getattr(data, "seed", None), int):
        raise UserError(
            f"--sample_order litgpt draws litgpt's order from --data.seed, which {_data_name(data)} does not have:"
            " use a data module with a seed (JSON, Alpaca, ...) or --sample_order longest_early"
        )


def embedded_data(json_path: Path, val_split_fraction: float = 0.1):
    from litgpt.data import JSON

    # The loss counts the answers only (the embedded base already knows the prompts); num_workers=0: the data is
    # tiny and worker processes cost more start-up time than they save.
    return JSON(json_path=json_path, val_split_fraction=val_split_fraction, mask_prompt=True, num_workers=0)


class LongestFirstSampler(Sampler[int]):
    """A seeded shuffle per epoch, sharded across ranks, with the longest samples moved into one optimizer step.

    The order is one permutation of the samples for the whole world, the same for any number of ranks (rank r takes
    every world_size-th sample from r), so a run on N processes sees the same global batches as one process, and each
    sample once an epoch. The ``step_samples`` longest samples (the global batch; default 1, the longest alone) fill
    the step that holds ``longest_position`` (a position in this rank's samples), in rising length, so that the last
    micro-batch of every rank holds the longest: the profiled step is the run's peak. ``epoch`` and ``start``
    (samples of this rank's shard already consumed) make the order resumable.

    ``litgpt_seed`` (``--sample_order litgpt``): litgpt's own order instead, to reproduce a litgpt run: the permutation
    its fine-tuning DataLoader draws from ``--data.seed`` (``shuffle=True`` with a seeded generator, from which each
    epoch's iterator first draws its workers' base seed, then the sampler its permutation), nothing moved.
    """

    def __init__(self, lengths: list[int], seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.lengths = lengths
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0
        self.longest_position = 0
        self.step_samples = 1
        self.longest = max(range(len(lengths)), key=lengths.__getitem__)
        self.litgpt_seed: int | None = None

    def order(self, epoch: int) -> list[int]:
        if self.litgpt_seed is not None:
            order = self._litgpt_order(epoch)
        else:
            order = self._longest_early_order(epoch)
        order = order[: len(order) - len(order) % self.world_size] if len(order) >= self.world_size else order
        return order[self.rank :: self.world_size]

    def _litgpt_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.litgpt_seed)
        for _ in range(epoch + 1):  # the generator lives through litgpt's run: each epoch draws after the last
            torch.empty((), dtype=torch.int64).random_(generator=generator)  # the DataLoader iterator's base seed
            order = torch.randperm(len(self.lengths), generator=generator).tolist()
            # RandomSampler, run to its end, draws one more permutation for the remainder it slices to nothing
            torch.randperm(len(self.lengths), generator=generator)
        return order

    def _longest_early_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        count = min(self.step_samples, len(order))
        longest = sorted(
            sorted(range(len(order)), key=lambda i: (-self.lengths[i], i))[:count], key=lambda i: (self.lengths[i], i)
        )
        chosen = set(longest)
        order = [i for i in order if i not in chosen]
        # the global index of this rank's position, rounded down to the start of its step
        at = self.longest_position * self.world_size // count * count
        at = min(at, len(order) // count * count)
        order[at:at] = longest
        return order

    def __iter__(self):
        yield from self.order(self.epoch)[self.start :]

    def __len__(self) -> int:
        return max(0, len(self.order(self.epoch)) - self.start)


class TrainBatches:
    """Endless micro-batches over epochs; ``state_dict`` is the data position a checkpoint stores, in samples, so a
    run resumed with another micro-batch size or another number of processes (the same global batch) continues at
    the same sample."""

    def __init__(
        self,
        loader: DataLoader,
        sampler: LongestFirstSampler,
        fingerprint: str | None = None,
        data_name: str = "the data",
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        self.samples_in_epoch = 0
        self._iterator = None
        self.fingerprint = fingerprint
        """The training samples' identity (``fingerprint``), kept in checkpoints: a resume checks it"""
        self.data_name = data_name
        self.accept_changed_data = False
        """``--resume_with_changed_data``: a resume onto other samples goes on, with a warning"""

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def where_longest(self, samples_per_step: int) -> str:
        """Where the longest samples are, for the run's first line (``samples_per_step``: this rank's)."""
        if self.sampler.litgpt_seed is not None:
            return "in litgpt's order"
        return f"at step {self.sampler.longest_position // samples_per_step + 1}"

    def place_longest(self, max_steps: int, accumulation: int, micro_batch_size: int, global_batch_size: int) -> None:
        """Puts the run's longest samples (a global batch of them) in one early optimizer step, the longest in every
        rank's last micro-batch, where gradients have accumulated: the step the default profiler window records (the
        first with optimizer state), so an out-of-memory comes in the first minutes and the step the ledger explains
        is the run's peak. Chosen from the number of steps alone: the --profile.* flags never change the training. A
        resumed run then restores the position its checkpoint holds."""
        step = ProfileArgs.default_recorded_step(max_steps)  # from 1
        self.sampler.longest_position = (step * accumulation - 1) * micro_batch_size
        self.sampler.step_samples = global_batch_size

    def __next__(self):
        if self._iterator is None:
            self.sampler.start = self.samples_in_epoch
            self._iterator = iter(self.loader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.sampler.epoch += 1
            self.samples_in_epoch = 0
            self.sampler.start = 0
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        self.samples_in_epoch += self.loader.batch_size  # past the epoch's end after its short last batch: the next
        return batch  # iterator then starts the next epoch

    def state_dict(self) -> dict:
        return {
            "epoch": self.sampler.epoch,
            "samples_in_epoch": self.samples_in_epoch,
            "longest_position": self.sampler.longest_position,
            "step_samples": self.sampler.step_samples,
            "world_size": self.sampler.world_size,
            "fingerprint": self.fingerprint,
            "samples": len(self.sampler.lengths),
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("fingerprint")
        if saved is not None and self.fingerprint is not None and saved != self.fingerprint:
            what = (
                f"{self.data_name} is not the training data of the checkpoint being resumed ({len(self.sampler.lengths)}"
                f" samples, fingerprint {self.fingerprint[:12]}; the checkpoint's: {state.get('samples')} samples,"
                f" {saved[:12]})"
            )
            if not self.accept_changed_data:
                raise UserError(
                    f"--resume: {what}; resume on the same data, or add --resume_with_changed_data true to"
                    " go on with this data from the same position"
                )
            print(
                f"warning: {what}; --resume_with_changed_data: training goes on with this data from the same position"
            )
        self.sampler.epoch = state["epoch"]
        # checkpoints from before the position was kept in samples counted micro-batches of the same size
        samples = state.get("samples_in_epoch", state.get("batches_in_epoch", 0) * self.loader.batch_size)
        # Positions are this rank's; the order is one permutation for the whole world (LongestFirstSampler), so on
        # another number of processes the same global position is the saved one times the saved world size over ours.
        saved_world = state.get("world_size", self.sampler.world_size)
        self.samples_in_epoch = samples * saved_world // self.sampler.world_size
        self.sampler.longest_position = state.get("longest_position", 0) * saved_world // self.sampler.world_size
        self.sampler.step_samples = state.get("step_samples", 1)
        self._iterator = None


def sample_lengths(dataset) -> list[int]:
    dataset = readable(dataset, "the data")
    if isinstance(dataset, TokenBlocks):
        return [dataset.block] * len(dataset)
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


RECORD_CHARACTERS = 4_000_000
"""Characters of an instruction record kept at least (about a million tokens, several times the longest context in
litgpt's hub): litgpt's datasets tokenize a whole record before cutting the sample to the sequence length, and a
200 MB ``output`` took 21.6 GB of memory before the kernel killed the run."""
CHARACTERS_PER_TOKEN = 64
"""More characters than a tokenizer's tokens average over a sample: a record cut past this many per token of the
sequence length still gives the sample the same tokens"""


def check_records(dataset, what: str, max_seq_length: int | None = None, warn=print) -> None:
    """Instruction records as litgpt's prompt styles read them: a list of objects with string fields. A record past
    ``RECORD_CHARACTERS`` (or ``CHARACTERS_PER_TOKEN`` a token of ``max_seq_length``, if more) is cut to that many
    characters before anything tokenizes it, and ``warn`` says so once."""
    records = getattr(dataset, "data", None)
    if (
        dataset is None or records is None
    ):  # not an SFTDataset (plain text blocks, a streaming module): nothing to check here
        return
    while isinstance(records, torch.utils.data.Subset):  # litgpt's JSON splits a single file with random_split
        records = records.dataset
    if isinstance(records, list) and not records:
        raise UserError(f"{what}: the data holds no records; give a JSON list of instruction/output records")
    if not isinstance(records, list):
        raise UserError(f"{what}: the data must be a JSON list of records, got a {type(records).__name__}")
    limit = max(RECORD_CHARACTERS, CHARACTERS_PER_TOKEN * (max_seq_length or 0))
    cut = {}  # record -> its length before the cut
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise UserError(f"{what}: record {i} is a {type(record).__name__}, not an object with instruction/output")
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                problem = "has no" if key not in record else f"has a {type(record[key]).__name__} as"
                raise UserError(
                    f"{what}: record {i} {problem} {key!r}; every record needs string 'instruction'"
                    " and 'output' fields ('input' optional)"
                )
        if "input" in record and not isinstance(record["input"], str):
            raise UserError(f"{what}: record {i} has a {type(record['input']).__name__} as 'input'; use a string")
        for key in ("instruction", "input", "output"):
            try:
                (record.get(key) or "").encode("utf-8")
            except UnicodeEncodeError as error:  # a lone surrogate (JSON's "\ud800"): no tokenizer takes it
                raise UserError(
                    f"{what}: record {i}'s {key!r} holds {error.object[error.start : error.end]!r} at character"
                    f" {error.start}, half of a UTF-16 pair that is no character; fix the record"
                ) from None
        characters = sum(len(record.get(key) or "") for key in ("instruction", "input", "output"))
        if characters > limit:
            cut[i] = characters
            _cut_record(record, limit)
    if cut:
        longest = max(cut, key=cut.get)
        warn(
            f"warning: {what}: {len(cut)} record(s) past {limit:,} characters (the longest, record {longest}, has"
            f" {cut[longest]:,}) are cut to {limit:,} before tokenizing: a sample keeps only --train.max_seq_length"
            " tokens, which come from the start, so it is the same; tokenizing the whole record could take more"
            " memory than the machine has"
        )


def _cut_record(record: dict, limit: int) -> None:
    """Cuts the record's text to ``limit`` characters from its end: the prompt (instruction, then input) comes first
    in a sample, so the output is cut first."""
    keep = limit
    for key in ("instruction", "input", "output"):
        text = record.get(key)
        if text is not None:
            record[key] = text[:keep]
            keep -= len(record[key])


def setup_data(data) -> None:
    ctrl_c = signal.getsignal(signal.SIGINT)
    # the local directories a module downloads into: what it creates there is removed again if the download fails
    targets = [getattr(data, name, None) for name in ("download_dir", "data_path")]
    created = [
        d
        for target in targets
        if isinstance(target, (str, Path)) and "://" not in str(target)
        for d in missing_dirs(Path(target))
    ]
    seed = getattr(data, "seed", None)
    if isinstance(seed, int) and not 0 <= seed < 2**63:  # torch's generators say only "Overflow when unpacking long"
        raise UserError(f"--data.seed {seed} is not a seed torch takes; give a whole number from 0 to 2**63 - 1")
    fraction = getattr(data, "val_split_fraction", None)
    if fraction is not None and not 0 <= fraction < 1:  # torch's random_split would say only "Fraction at index 0"
        raise UserError(f"--data.val_split_fraction {fraction} must be in [0, 1)")
    try:
        data.prepare_data()
        data.setup()
    except json.JSONDecodeError as error:
        bad_line = _first_bad_json_line(data)
        if bad_line is not None:  # litgpt parses each line of a .jsonl alone: the error's own line is always 1
            raise UserError(bad_line) from None
        raise UserError(f"{_data_name(data)} is not valid JSON ({error}); fix the file") from None
    except RecursionError:
        raise UserError(
            f"{_data_name(data)} nests its JSON deeper than Python's parser goes; give a list of flat records"
        ) from None
    except FileNotFoundError as error:  # litgpt's JSON: a directory without train.json and val.json, a FIFO
        remove_if_empty(created)
        raise UserError(f"{_data_name(data)}: {' '.join(str(error).split())}") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{_data_name(data)} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (KeyError, TypeError, AttributeError) as error:
        raise UserError(
            f"{_data_name(data)} does not have the layout {type(data).__name__} expects ({error!r})"
        ) from None
    except ValueError as error:
        # litgpt's modules check their settings here and say what is wrong (e.g. JSON's "Unsupported file format:
        # .txt. Expected `.json` or `.jsonl`."): the reason, in one line
        remove_if_empty(created)
        raise UserError(f"{_data_name(data)}: {' '.join(str(error).split())}") from None
    except ModuleNotFoundError as error:
        # litgpt's modules import what they download with inside prepare_data (Alpaca2k, the data of most of its
        # config hub, needs Hugging Face `datasets`, which neither litgpt nor Memfit requires)
        remove_if_empty(created)
        raise UserError(
            f"--data {type(data).__name__} prepares its data with the package {error.name!r}, which is not"
            f" installed: pip install {error.name}"
        ) from None
    except Exception as error:
        if not _is_network_error(error):
            raise
        remove_if_empty(created)
        raise UserError(
            f"--data {type(data).__name__} downloads its data and could not ({_network_reason(error)});"
            f" {_offline_way(data)}"
        ) from None
    finally:
        # litdata's optimize (TextFiles' preparation) installs a Ctrl-C handler that ends the process with status 0
        # and leaves it installed: training would then stop on Ctrl-C without saying where to resume
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, ctrl_c)


def _first_bad_json_line(data) -> str | None:
    """Where a JSON Lines file of litgpt's ``JSON`` data (``--data.json_path``, a .jsonl or a directory holding
    train.jsonl and val.jsonl) first fails to parse, as one line naming the file and its line; None for other data."""
    path = getattr(data, "json_path", None)
    if path is None:
        return None
    path = Path(path)
    files = [path] if path.suffix == ".jsonl" else [path / "train.jsonl", path / "val.jsonl"] if path.is_dir() else []
    for file in files:
        if not file.is_file():
            continue
        with open(file, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                try:
                    json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as error:
                    return (
                        f"{file} is not valid JSON Lines: line {number}, column {error.colno}: {error.msg};"
                        " each line must be one JSON record: fix that line"
                    )
    return None


def _is_network_error(error: BaseException) -> bool:
    """A download that could not reach its server: requests', urllib's and the socket's own failures, as litgpt's
    modules (requests) and Hugging Face's libraries raise them."""
    import socket
    import urllib.error

    kinds = [ConnectionError, TimeoutError, socket.gaierror, urllib.error.URLError]
    try:
        import requests

        kinds += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    except ImportError:
        pass
    return isinstance(error, tuple(kinds))


def _offline_way(data) -> str:
    """What to do on a machine without internet, in the module's own terms: where it looks for the files (litgpt's
    instruction modules: ``download_dir``; its pretraining ones: ``data_path``), and a local module of the same kind."""
    where = next((f"--data.{name} DIR" for name in ("download_dir", "data_path") if hasattr(data, name)), None)
    local = (
        "--data JSON --data.json_path FILE"
        if hasattr(data, "prompt_style")
        else "--data TextFiles --data.train_data_path DIR (or PlainText --data.path FILE)"
    )
    return (
        f"on a machine without internet, fetch its files elsewhere and give {where}, or use {local}"
        if where
        else f"on a machine without internet, use {local}"
    )


def _network_reason(error: BaseException) -> str:
    request = getattr(error, "request", None)
    url = getattr(request, "url", None)
    reason = str(getattr(error, "reason", "") or type(error).__name__)
    return f"{url}: {type(error).__name__}" if url else reason[:120]


def _data_name(data) -> str:
    path = getattr(data, "json_path", None) or getattr(data, "path", None)
    return f"--data {type(data).__name__}" + (f" ({path})" if path else "")


def rebuild_loader(loader: DataLoader, dataset, sampler: Sampler | None) -> DataLoader:
    """The DataModule's loader over ``dataset`` with our sampler (or none, for validation order) in place of its own."""
    return DataLoader(
        dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        shuffle=False,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        # Without its own generator, every iter(loader) draws a seed from the global RNG, so a resumed run (which
        # starts its iterator after restoring that RNG) would see different dropout masks than an uninterrupted one.
        generator=torch.Generator().manual_seed(0),
    )


# litgpt's pretraining modules built on litdata's streaming datasets (fixed-size token blocks, not records)
_STREAMING = ("TextFiles", "LitData", "OpenWebText", "TinyLlama", "TinyStories", "MicroLlama")
# litdata's own requirements name torchvision, whose PyPI wheel replaces a CPU torch with a CUDA build; litdata reads
# token blocks without importing it, so on a CPU-only torch it is installed without its dependencies.
LITDATA_INSTALL = (
    "pip install 'memfit[litdata]' (with a CPU-only torch: pip install --no-deps litdata==0.2.59"
    " && pip install boto3 obstore tifffile)"
)


def check_streaming(data) -> None:
    """litgpt's litdata modules need litdata, and TextFiles asserts on its directories deep in its optimize step:
    both are checked here, before anything is built or written, each in one line."""
    name = type(data).__name__
    if name not in _STREAMING or not type(data).__module__.startswith("litgpt.data"):
        return
    try:
        import litdata  # noqa: F401
    except ImportError:
        raise UserError(
            f"--data {name} reads litdata's streaming format, and litdata is not installed: {LITDATA_INSTALL}"
        ) from None
    # TinyLlama and MicroLlama name the dirs they read (required_paths); litgpt's check raises a FileNotFoundError
    # from prepare_data, a traceback here
    local = [path for path in getattr(data, "required_paths", []) if "://" not in path]
    missing = [path for path in local if not (Path(path) / "index.json").is_file()]
    if missing:
        what = (
            "holds no index.json (not litdata's optimized format)"
            if Path(missing[0]).is_dir()
            else "is not a directory"
        )
        raise UserError(
            f"--data {name} reads litdata-optimized dirs under --data.data_path {str(data.data_path)!r},"
            f" and {missing[0]!r} {what}: prepare them as litgpt's pretraining tutorial does, or set"
            " --data.data_path"
        )
    if name == "TextFiles":
        train_files = sorted(Path(data.train_data_path).glob("*.txt"))
        if not train_files:
            raise UserError(
                f"--data.train_data_path {str(data.train_data_path)!r} holds no .txt files; give a directory of them"
            )
        if data.val_data_path is None and len(train_files) < 2:
            raise UserError(
                f"--data.train_data_path {str(data.train_data_path)!r} holds one .txt file; TextFiles keeps"
                " the first file for validation, so give two or more, or --data.val_data_path DIR"
            )
        if data.val_data_path is not None and not sorted(Path(data.val_data_path).glob("*.txt")):
            raise UserError(
                f"--data.val_data_path {str(data.val_data_path)!r} holds no .txt files; give a directory of them"
            )


class TokenBlocks(torch.utils.data.Dataset):
    """litdata's ``StreamingDataset`` of fixed-size token blocks, read by index.

    litdata streams in its own order, which neither puts the longest sample in the profiled step nor gives a position
    a checkpoint can keep; its dataset also serves ``dataset[i]`` from the optimized chunks, so Memfit's sampler
    orders it like any map-style dataset. Every block has the same length: no need to read them to know it.
    """

    def __init__(self, streaming) -> None:
        self.input_dir = streaming.input_dir
        self.length = len(streaming)
        self.block = len(streaming[0]) if self.length else 0  # max_seq_length + 1
        self._reader = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if self._reader is None:
            from litdata import StreamingDataset, TokensLoader

            self._reader = StreamingDataset(input_dir=self.input_dir, item_loader=TokensLoader(block_size=self.block))
        return {"input_ids": self._reader[i].long()}  # (block,); litdata stores int32, the loss wants int64

    def __getstate__(self) -> dict:
        # litdata sets multiprocessing to spawn, so DataLoader workers get a pickled copy, and an open reader holds
        # memoryviews, which do not pickle: each process opens its own
        return {**vars(self), "_reader": None}


def readable(dataset, what: str):
    """The dataset as ``dataset[i] -> {"input_ids": ...}``: records as they are, litdata's token blocks wrapped."""
    module = type(dataset).__module__
    if not module.startswith("litdata"):
        return dataset
    from litdata import StreamingDataset

    if isinstance(dataset, StreamingDataset) and type(dataset.item_loader).__name__ == "TokensLoader":
        return TokenBlocks(dataset)
    raise UserError(
        f"{what} gives a {type(dataset).__name__}, which cannot be read by index (Memfit orders samples"
        " itself to put the longest in the profiled step and keep the position in checkpoints); use a"
        " module with one dataset of token blocks, e.g. --data TextFiles or --data LitData"
    )


SampleOrder = Literal["longest_early", "litgpt"]


class RunData(NamedTuple):
    """A run's data as its loop reads it (``finetuning_data``, ``pretraining_data``); lengths are in tokens."""

    batches: TrainBatches
    """The training micro-batches, where the data stands a checkpoint keeps"""
    val_loader: DataLoader | None
    longest_train: int
    """The longest training sample"""
    longest: int
    """The longest sample, validation's included (the rope cache is built for it)"""
    steps_per_epoch: int
    max_steps: int
    """The run's optimizer steps: ``--train.max_steps``, ``--train.epochs`` or ``--train.max_tokens``, whichever ends
    first (as litgpt, the tokens' horizon assumes full-length samples; fit() also stops at max_tokens)"""


def finetuning_data(fabric, run, tokenizer, targets_fn) -> RunData:
    """The run's data (``run.data``, a ``memfit.settings.run.Run``'s) tokenized and batched, its horizon in optimizer
    steps, and the longest samples placed in an early step, the one profiled by default: an out-of-memory comes in
    minutes. ``targets_fn(batch)``: the tokens of a batch its loss counts."""
    # litgpt's fine-tuning horizon: a global batch of the longest training sample each step
    return _run_data(
        fabric, run, tokenizer, targets_fn, lambda longest_train: run.train.global_batch_size * longest_train
    )


def pretraining_data(fabric, run, tokenizer, targets_fn) -> RunData:
    """``finetuning_data`` for pretraining's blocks of text, with litgpt's pretraining horizon."""

    def tokens_per_step(longest_train: int) -> int:
        # full-length blocks, max_seq_length tokens trained each (a block holds one more, the last target)
        return run.train.micro_batch_size * (longest_train - 1) * run.accumulation * fabric.world_size

    return _run_data(fabric, run, tokenizer, targets_fn, tokens_per_step)


def _run_data(fabric, run, tokenizer, targets_fn, tokens_per_step: Callable[[int], int]) -> RunData:
    batches, val_loader, longest_train, longest = build_dataloaders(
        fabric,
        data=run.data,
        tokenizer=tokenizer,
        micro_batch_size=run.train.micro_batch_size,
        max_seq_length=run.max_seq_length,
        seed=run.seed,
        targets_fn=targets_fn,
        sample_order=run.sample_order,
    )
    batches.accept_changed_data = run.resume_with_changed_data  # checked when the checkpoint's state loads
    steps_per_epoch = max(1, len(batches.loader) // run.accumulation)
    max_steps = min(run.train.max_steps or math.inf, (run.train.epochs or math.inf) * steps_per_epoch)
    if run.train.max_tokens:
        max_steps = min(max_steps, max(1, run.train.max_tokens // tokens_per_step(longest_train)))
    max_steps = int(max_steps)
    batches.place_longest(max_steps, run.accumulation, run.train.micro_batch_size, run.train.global_batch_size)
    return RunData(batches, val_loader, longest_train, longest, steps_per_epoch, max_steps)


def build_dataloaders(
    fabric,
    data,
    tokenizer,
    micro_batch_size: int,
    max_seq_length: int | None,
    seed: int,
    targets_fn,
    sample_order: SampleOrder = "longest_early",
):
    """Returns ``(train_batches, val_loader, longest_train, longest_any)``; lengths are in tokens."""
    data.connect(tokenizer=tokenizer, batch_size=micro_batch_size, max_seq_length=max_seq_length)
    with fabric.rank_zero_first():
        setup_data(data)
    check_records(getattr(data, "train_dataset", None), _data_name(data), max_seq_length, fabric.print)
    check_records(
        getattr(data, "test_dataset", None) or getattr(data, "val_dataset", None),
        f"{_data_name(data)}, validation split",
        max_seq_length,
        fabric.print,
    )
    train_loader, val_loader = data.train_dataloader(), data.val_dataloader()
    train_set = readable(train_loader.dataset, _data_name(data))
    val_set = readable(val_loader.dataset, _data_name(data)) if val_loader is not None else None
    if not len(train_set):
        raise UserError(
            f"{_data_name(data)}: the training split is empty; give more data or a smaller --data.val_split_fraction"
        )
    if len(train_set) < fabric.world_size:  # a process with no sample would wait for the others' collectives forever
        raise UserError(
            f"{_data_name(data)}: {len(train_set)} training sample(s) for {fabric.world_size} processes, and each needs"
            " one; give more data or fewer --devices"
        )
    if isinstance(train_set, TokenBlocks):
        train_lengths = sample_lengths(train_set)
    else:
        samples = [train_set[i] for i in range(len(train_set))]
        train_lengths = [len(sample["input_ids"]) for sample in samples]
        if "labels" in samples[0] and not any(targets_fn({"labels": s["labels"][None]}) for s in samples):
            # every label masked: the loss would be 0 and nothing would learn, for ever
            raise UserError(
                f"{_data_name(data)}: no sample has a token to learn (every label is masked: empty 'output' fields,"
                " or prompts longer than --train.max_seq_length); check the data or raise --train.max_seq_length"
            )
    val_lengths = sample_lengths(val_set) if val_set is not None else []
    sampler = LongestFirstSampler(train_lengths, seed, fabric.global_rank, fabric.world_size)
    if sample_order == "litgpt":
        sampler.litgpt_seed = data.seed  # checked in setup(): the module has one
    fingerprint = block_fingerprint(train_set) if isinstance(train_set, TokenBlocks) else sample_fingerprint(samples)
    # use_distributed_sampler=False: the sampler above shards by rank itself and keeps the data position.
    train_loader = fabric.setup_dataloaders(
        rebuild_loader(train_loader, train_set, sampler), use_distributed_sampler=False
    )
    if val_loader is not None and val_lengths:
        val_loader = fabric.setup_dataloaders(rebuild_loader(val_loader, val_set, None))
    else:
        val_loader = None
    return (
        TrainBatches(train_loader, sampler, fingerprint, _data_name(data)),
        val_loader,
        max(train_lengths),
        max(train_lengths + val_lengths),
    )


def sample_fingerprint(samples: list[dict]) -> str:
    """The training samples as tokenized (their tokens and labels, in order): a change of the data file, its split,
    the tokenizer or the prompt template changes it."""
    digest = hashlib.sha256()
    for sample in samples:
        for key in ("input_ids", "labels"):
            if key in sample:
                tokens = torch.as_tensor(sample[key])
                digest.update(str(tuple(tokens.shape)).encode())
                digest.update(tokens.numpy().tobytes())
    return digest.hexdigest()


def block_fingerprint(blocks: TokenBlocks) -> str:
    """litdata's optimized token blocks, by their index (chunk names and sizes) and count: reading every block to hash
    it would cost a pass over the corpus."""
    digest = hashlib.sha256(f"{len(blocks)} x {blocks.block}".encode())
    index = Path(str(blocks.input_dir.path if hasattr(blocks.input_dir, "path") else blocks.input_dir)) / "index.json"
    if index.is_file():
        digest.update(index.read_bytes())
    return digest.hexdigest()


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i * self.block : (i + 1) * self.block]}  # (max_seq_length + 1,)


TOKENIZED_AT_ONCE = 16 * 2**20
"""The most characters handed to the tokenizer in one call: a corpus that is one 89 MB line made the Rust tokenizer
abort the process (``memory allocation failed``, exit 134), beyond any ``except``. Text up to this size (the
embedded corpus, tiny-shakespeare) is tokenized whole, as before; longer text is cut at a line end, or within an
over-long line at a space, where a token would end anyway (a SentencePiece tokenizer marks each piece's first word
as a word start, as it would after the newline or space that ends the piece before)."""


def text_pieces(text: str, most: int | None = None) -> Iterator[str]:
    most = most or TOKENIZED_AT_ONCE
    start = 0
    while len(text) - start > most:
        end = text.rfind("\n", start, start + most) + 1 or text.rfind(" ", start, start + most) + 1 or start + most
        yield text[start:end]
        start = end
    yield text[start:]


@dataclass
class PlainText(DataModule):
    """Plain text for pretraining, tokenized once and cut into blocks of ``max_seq_length + 1`` tokens.

    litgpt's ``TextFiles`` needs litdata and its optimize step; this reads files directly, which suits corpora that
    fit in memory (tiny-shakespeare, the embedded corpus).
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
        tokens = torch.cat([self.tokenizer.encode(piece, bos=False, eos=False).long() for piece in text_pieces(text)])
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
