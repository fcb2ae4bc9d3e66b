"""The embedded default: a tiny Llama-architecture checkpoint and an instruction dataset, generated locally.

With no ``--checkpoint_dir`` a script must still train something real without the network. Rather than a special
code path, the project writes a genuine litgpt checkpoint dir (``model_config.yaml``, ``tokenizer.json``,
``tokenizer_config.json``, ``lit_model.pth``) and an Alpaca-format JSON file, so the default run goes through exactly
the loader, tokenizer and data pipeline a downloaded model does.

The dataset is made of rule-based tasks (reverse, sort, opposite, add, repeat) whose answers follow from the input.
Like a real base model, the generated one has read text of the domain but not the task: it is pre-trained briefly
(a few seconds, once, then cached) on the prompts alone — never on the answers — so that fine-tuning has a clear
job: its loss starts high on the answers and falls visibly within a one-minute run.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from tqdm import tqdm

from memfit.errors import UserError
from memfit.files import carries_mark, mark_as_written_by_memfit

if TYPE_CHECKING:  # litgpt is imported where it is used (the CLI's refusals run without it)
    pass

# Bump when anything generated here changes, so stale caches are not reused.
EMBEDDED_VERSION = 4
EMBEDDED_MODEL_NAME = "memfit-tiny-llama"

# A Llama-2-shaped model (RMSNorm, SwiGLU MLP, RoPE, grouped-query attention), about 1.6M parameters.
TINY_LLAMA = dict(
    name=EMBEDDED_MODEL_NAME,
    block_size=512,
    vocab_size=1024,
    padded_vocab_size=1024,
    n_layer=4,
    n_head=4,
    n_query_groups=2,
    n_embd=128,
    intermediate_size=384,
    rotary_percentage=1.0,
    parallel_residual=False,
    bias=False,
    norm_class_name="RMSNorm",
    norm_eps=1e-5,
    mlp_class_name="LLaMAMLP",
)

_WORDS = (
    "apple river stone cloud maple tiger candle harbor violet engine pepper meadow silver rocket lantern "
    "garden falcon copper willow thunder ocean pebble marble cactus saddle quartz velvet orchid"
).split()
_OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "big": "small",
    "fast": "slow",
    "light": "dark",
    "open": "closed",
    "early": "late",
    "happy": "sad",
    "full": "empty",
    "hard": "soft",
    "high": "low",
    "young": "old",
    "wet": "dry",
    "loud": "quiet",
    "rich": "poor",
    "strong": "weak",
}
_NUMBER_WORDS = "zero one two three four five six seven eight nine".split()


def _task(rng: random.Random) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        words = rng.sample(_WORDS, rng.randint(2, 9))
        return {
            "instruction": "Reverse the order of the words.",
            "input": " ".join(words),
            "output": " ".join(reversed(words)),
        }
    if kind == 1:
        numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 12))]
        return {
            "instruction": "Sort the numbers in ascending order.",
            "input": " ".join(map(str, numbers)),
            "output": " ".join(map(str, sorted(numbers))),
        }
    if kind == 2:
        word, opposite = rng.choice(sorted(_OPPOSITES.items()))
        if rng.random() < 0.5:
            word, opposite = opposite, word
        return {"instruction": "Give the opposite of the word.", "input": word, "output": opposite}
    if kind == 3:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return {
            "instruction": "Add the two numbers and answer in words.",
            "input": f"{a} + {b}",
            "output": _number_in_words(a + b),
        }
    word, times = rng.choice(_WORDS), rng.randint(2, 6)
    return {
        "instruction": f"Repeat the word {_NUMBER_WORDS[times]} times.",
        "input": word,
        "output": " ".join([word] * times),
    }


def _number_in_words(n: int) -> str:
    teens = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen".split()
    return _NUMBER_WORDS[n] if n < 10 else teens[n - 10]


def make_instruction_dataset(n: int = 2000, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_task(rng) for _ in range(n)]


def _train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:  # noqa: F821  (imported inside)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def default_cache_dir() -> Path:
    root = os.environ.get("MEMFIT_CACHE") or Path.home() / ".cache" / "memfit"
    return Path(root) / f"embedded-v{EMBEDDED_VERSION}"


def _write(target: Path) -> None:
    from litgpt import GPT, Config
    from litgpt.prompts import Alpaca

    records = make_instruction_dataset()
    (target / "instructions.json").write_text(json.dumps(records, indent=1))
    prompt_style = Alpaca()
    texts = [prompt_style.apply(r["instruction"], input=r["input"]) + r["output"] for r in records]
    # The same tasks as running text, for pretraining, in the prompt template the embedded model has read: continued
    # pretraining from its weights (--initial_checkpoint_dir) starts far below a random model on any CPU (a loss of
    # about 0.9-1.0 against ln 1024 = 6.93). Without the template the weights were worth almost nothing there (6.80-
    # 6.90 against 6.96, depending on which kernels built the model).
    (target / "corpus.txt").write_text("\n\n".join(texts))

    checkpoint_dir = target / "checkpoint"
    checkpoint_dir.mkdir()
    tokenizer = _train_tokenizer(texts, TINY_LLAMA["vocab_size"])
    tokenizer.save(str(checkpoint_dir / "tokenizer.json"))
    (checkpoint_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (checkpoint_dir / "model_config.yaml").write_text(yaml.safe_dump(TINY_LLAMA))

    torch.manual_seed(0)
    model = GPT(Config(**TINY_LLAMA))
    model.apply(model._init_weights)
    prompts = [tokenizer.encode(prompt_style.apply(r["instruction"], input=r["input"])).ids for r in records]
    _pretrain_on_prompts(model, prompts, eos_id=tokenizer.token_to_id("</s>"))
    torch.save(model.state_dict(), checkpoint_dir / "lit_model.pth")


def _pretrain_on_prompts(model, prompts: list[list[int]], eos_id: int, steps: int = 150, batch_size: int = 16) -> None:
    """A short full-precision language-model pass over prompts (no answers), deterministic given the seed."""
    from litgpt.utils import chunked_cross_entropy

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    # 10 s on an idle 2-core machine, minutes on a busy one: never a silent wait
    for _ in tqdm(
        range(steps), desc="building the embedded default (first use only)", unit="step", mininterval=0.5, leave=False
    ):
        picks = torch.randint(len(prompts), (batch_size,), generator=generator).tolist()
        rows = [prompts[i] + [eos_id] for i in picks]
        width = max(map(len, rows))
        batch = torch.full((batch_size, width), -100, dtype=torch.long)
        for row, ids in zip(batch, rows):
            row[: len(ids)] = torch.tensor(ids)
        inputs = batch[:, :-1].clamp(min=0)  # (B, T); padding reads token 0 but is never a target
        loss = chunked_cross_entropy(model(inputs), batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def embedded_data_of(checkpoint_dir: Path) -> Path | None:
    """The instruction data beside ``checkpoint_dir`` if it is the embedded default's checkpoint (a run's
    ``hyperparameters.yaml`` records it by path, for litgpt's tools), else None."""
    checkpoint_dir = Path(checkpoint_dir)
    data = checkpoint_dir.parent / "instructions.json"
    if checkpoint_dir.name == "checkpoint" and checkpoint_dir.parent.name.startswith("embedded-v") and data.is_file():
        return data
    return None


def ensure_embedded(cache_dir: Path | None = None) -> tuple[Path, Path]:
    """Returns ``(checkpoint_dir, json_path)`` of the embedded default, generating it on first use.

    Generation happens in a temporary sibling directory that is renamed into place, so concurrent or interrupted
    runs never see a half-written checkpoint.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not (target / "checkpoint" / "lit_model.pth").is_file():
        with _building_alone(target.parent):
            _build(target)
    return target / "checkpoint", target / "instructions.json"


def _remove_abandoned_builds(target: Path) -> None:
    """The staging directories of builds killed outright (SIGKILL, a power loss): called under ``_building_alone``'s
    lock, so no live build owns one. Only those carrying Memfit's mark go: the cache may be a shared directory."""
    for staging in target.parent.glob(f"{target.name}.*"):
        if carries_mark(staging):
            shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def _building_alone(cache: Path):
    """One process builds; others started with it wait for its copy instead of each spending the minute too (an
    exclusive lock on the cache directory itself: no lock file is left, and a killed builder's lock goes with it)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(cache, os.O_RDONLY)
    except OSError:  # no directory to lock: _build says why in one line
        yield
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _build(target: Path) -> None:
    if not (target / "checkpoint" / "lit_model.pth").is_file():  # another process built it while this one waited
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _remove_abandoned_builds(target)
            staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
            mark_as_written_by_memfit(staging)
        except OSError as error:  # a file in the way, a read-only filesystem, no permission
            in_the_way = next((p for p in (target.parent, *target.parent.parents) if p.is_file()), None)
            why = f"{str(in_the_way)!r} is a file" if in_the_way else error.strerror
            raise UserError(
                f"cannot create the embedded default in {str(target.parent)!r} ({why}); set MEMFIT_CACHE to a"
                " writable directory, or give --checkpoint_dir"
            ) from None
        try:
            _write(staging)
            try:
                staging.rename(target)
            except OSError:  # another process finished first; its copy is identical
                pass
        except OSError as error:  # a full disk or quota
            raise UserError(
                f"cannot write the embedded default in {str(target.parent)!r} ({error.strerror}); set"
                " MEMFIT_CACHE to a directory with room, or give --checkpoint_dir"
            ) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
