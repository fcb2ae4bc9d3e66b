"""Training behaviour on CPU: quantized bases train, accumulation is exact, resume continues exactly."""

import json

import pytest
import torch
import yaml

from conftest import load_script, run_script, run_summary, script_summary, shared_file

lora = load_script("finetune/lora.py")


def test_impossible_combination_stops_before_writing(tmp_path):
    from memfit.errors import UserError

    with pytest.raises(UserError, match="bnb.int8-training needs --precision 16-true"):
        script_summary("finetune/lora.py", tmp_path, quantize="bnb.int8-training", precision="bf16-true")
    assert not tmp_path.joinpath("out").exists() and not tmp_path.joinpath("profiles").exists()


# Accumulation is tested on every script's own train_step: tests/test_train_step.py


@pytest.mark.parametrize("resumed_micro_batch", [4, 2])
def test_the_data_position_is_kept_in_samples_across_epochs(resumed_micro_batch):
    """A checkpoint keeps where the data stands in samples: resumed with the same micro-batch, or with a smaller one
    (the same global batch, as after running out of memory), the samples continue as in an uninterrupted run, also
    past an epoch whose last micro-batch is short (10 samples in micro-batches of 4)."""
    from torch.utils.data import DataLoader

    from memfit.data import LongestFirstSampler, TrainBatches

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
    from memfit.data import LongestFirstSampler

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


def test_sentencepiece_checkpoint_dir(tmp_path):
    """A litgpt checkpoint dir with a SentencePiece tokenizer.model (the real Llama 2 one) and random weights."""
    from litgpt import GPT, Config

    tokenizer = shared_file("llama2_tokenizer.model")
    alpaca = shared_file("alpaca_5000.json")
    checkpoint_dir = tmp_path / "llama-tiny-sp"
    checkpoint_dir.mkdir()
    config = dict(
        name="llama-tiny-sp",
        block_size=256,
        vocab_size=32000,
        padded_vocab_size=32000,
        n_layer=2,
        n_head=4,
        n_query_groups=4,
        n_embd=64,
        intermediate_size=172,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    (checkpoint_dir / "model_config.yaml").write_text(yaml.safe_dump(config))
    (checkpoint_dir / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    torch.manual_seed(0)
    model = GPT(Config(**config))
    model.apply(model._init_weights)
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, checkpoint_dir / "lit_model.pth")
    subset = tmp_path / "alpaca_200.json"
    subset.write_text(json.dumps(json.loads(alpaca.read_text())[:200]))

    result = run_script(
        "finetune/lora.py",
        "--checkpoint_dir",
        str(checkpoint_dir),
        "--quantize",
        "bnb.nf4-dq",
        "--precision",
        "32-true",
        "--data",
        "JSON",
        "--data.json_path",
        str(subset),
        "--data.val_split_fraction",
        "0.1",
        "--train.max_steps",
        "8",
        "--train.micro_batch_size",
        "2",
        "--train.global_batch_size",
        "4",
        "--train.max_seq_length",
        "128",
        "--eval.max_iters",
        "2",
        "--train.lr",
        "3e-3",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = run_summary(tmp_path / "profiles")
    assert summary["run"].startswith("lora-llama-tiny-sp-")
    assert summary["last_loss"] < summary["first_loss"], summary
    assert (tmp_path / "out/finetune/lora/final/tokenizer.model").is_file()


def test_the_profile_flags_do_not_change_the_training(tmp_path):
    """The same seed trains the same weights with the default profiler window, with profiling off and with another
    window: the longest samples go to the default window's step whatever is profiled (before, they moved with the
    window, and to the first step with profiling off)."""
    from conftest import WEIGHTS

    common = ["--train.max_steps", "5", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]
    common += ["--logger_name", "csv", "--eval.interval", "100"]
    windows = {"default": [], "off": ["--profile.enabled", "false"], "later": ["--profile.wait", "3"]}
    weights = {}
    for name, flags in windows.items():
        (tmp_path / name).mkdir()
        result = run_script("finetune/lora.py", *common, *flags, cwd=tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        saved = torch.load(tmp_path / name / "out/finetune/lora/final" / WEIGHTS["lora"], weights_only=True)
        weights[name] = saved.get("model", saved)
    for name in ("off", "later"):
        for key, tensor in weights["default"].items():
            assert torch.equal(tensor, weights[name][key]), (name, key)


def test_sample_order_litgpt_is_the_order_litgpts_dataloader_draws(tmp_path):
    """``--sample_order litgpt``: the sampler's order over two epochs is the one litgpt's own fine-tuning DataLoader
    (litgpt.data.JSON.train_dataloader, seeded by --data.seed) gives, index for index; the default order is not."""
    from litgpt.data import JSON

    from memfit.data import LongestFirstSampler

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
