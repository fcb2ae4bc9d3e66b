"""litgpt's own config hub (v0.5.13's config_hub/, unchanged, in ../shared/litgpt_config_hub/): every file is taken
by the matching Memfit script and resolves to the settings litgpt's own parser gives the same file, setting by
setting, with the optimizer block resolved as Memfit trains it (its lr and weight decay become the schedule's)."""

from pathlib import Path

import pytest

from conftest import SHARED_HUB, load_script

HUB = SHARED_HUB
FILES = sorted(HUB.rglob("*.yaml")) if HUB.is_dir() else []
# the settings a recipe sets that decide the training: litgpt's names, which Memfit's flags mirror
COMPARED = (
    "precision",
    "quantize",
    "devices",
    "num_nodes",
    "seed",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_query",
    "lora_key",
    "lora_value",
    "lora_projection",
    "lora_mlp",
    "lora_head",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.lr_warmup_steps",
    "train.lr_warmup_fraction",
    "train.epochs",
    "train.max_steps",
    "train.max_tokens",
    "train.max_seq_length",
    "train.min_lr",
    "train.max_norm",
    "train.tie_embeddings",
    "train.save_interval",
    "train.log_interval",
    "eval.interval",
    "eval.max_iters",
    "eval.initial_validation",
    "eval.final_validation",
    "model_name",
    "tokenizer_dir",
    "initial_checkpoint_dir",
)


def _kind(path: Path) -> str:
    return "pretrain" if "pretrain" in path.parts else ("full" if path.name == "full.yaml" else "lora")


def _litgpt_setup(kind: str):
    import litgpt.finetune.full
    import litgpt.finetune.lora
    import litgpt.pretrain

    return {"lora": litgpt.finetune.lora.setup, "full": litgpt.finetune.full.setup, "pretrain": litgpt.pretrain.setup}[
        kind
    ]


def _value(namespace, key: str):
    for part in key.split("."):
        namespace = getattr(namespace, part, None) if not isinstance(namespace, dict) else namespace.get(part)
    return namespace


@pytest.mark.skipif(not FILES, reason=f"{HUB} is absent: litgpt's config hub lives in ../shared beside the repo")
def test_the_hub_holds_every_file_of_litgpt_v0_5_13():
    assert len(FILES) == 46 and sum(_kind(f) == "pretrain" for f in FILES) == 4, [f.name for f in FILES]


@pytest.mark.skipif(not FILES, reason=f"{HUB} is absent: litgpt's config hub lives in ../shared beside the repo")
@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(HUB)) if HUB.is_dir() else f.name for f in FILES])
def test_every_hub_file_means_in_memfit_what_it_means_in_litgpt(path):
    from jsonargparse import auto_parser

    from memfit.settings.cli import make_parser
    from memfit.training.optim import resolve_optimizer

    kind = _kind(path)
    script = {"lora": "finetune/lora.py", "full": "finetune/full.py", "pretrain": "pretrain/pretrain.py"}[kind]
    theirs = auto_parser(_litgpt_setup(kind), as_positional=False, exit_on_error=False).parse_args(
        ["--config", str(path)]
    )
    ours = make_parser(load_script(script).setup).parse_args(["--config", str(path)])  # a key it lacks would raise
    compared = [key for key in COMPARED if _value(theirs, key) is not None or _value(ours, key) is not None]
    differ = {
        key: (_value(theirs, key), _value(ours, key)) for key in compared if _value(theirs, key) != _value(ours, key)
    }
    assert differ == {}, differ
    assert len(compared) >= 15
    # the data module and the model's architecture, as given
    assert _value(ours, "data") == _value(theirs, "data")
    assert _value(ours, "model_config") == _value(theirs, "model_config")
    # the optimizer block: litgpt builds it as written; Memfit takes its lr and weight decay as the schedule's
    optimizer = _value(theirs, "optimizer")
    name, schedule, kwargs = resolve_optimizer(_value(ours, "optimizer"))
    assert isinstance(optimizer, dict) and name.split("-")[0] == optimizer["class_path"].split(".")[-1], (
        name,
        optimizer,
    )
    init = dict(optimizer.get("init_args") or {})
    for key in ("lr", "weight_decay"):
        if key in init:
            assert schedule[key] == init[key], key
    if "betas" in init:
        assert tuple(kwargs["betas"]) == tuple(init["betas"])


# A short real run of a sample of the hub's files (benchmarks/hub_runs.py runs every one and commits the record in
# profiles/cpu/hub_runs.json): only the model and the data swapped for local ones, 2 steps. One file per code path:
# QLoRA on a partial-rotary GptNeoxMLP model (phi-2, bf16-true + nf4), LoRA on Gemma 2 (soft-capping, sliding
# windows) and a full fine-tune on 2 devices (FSDP with checkpointing, as litgpt runs devices: 2). The record has the
# rest, tinyllama.yaml's 128 micro-batches a step with the profiler on among them (134 s: too long for every commit).
RUN_SAMPLE = ("finetune/phi-2/qlora.yaml", "finetune/gemma2-2b/lora.yaml", "finetune/phi-2/full.yaml")


@pytest.mark.slow
@pytest.mark.skipif(not FILES, reason=f"{HUB} is absent: litgpt's config hub lives in ../shared beside the repo")
@pytest.mark.parametrize("relative", RUN_SAMPLE)
def test_a_hub_file_trains_with_only_the_model_and_data_swapped(relative, tmp_path):
    import json
    import math
    import sys

    from conftest import ROOT, run_script, shared_file

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hub_runs
    import yaml

    path = HUB / relative
    data_dir = shared_file("alpaca_5000.json").parent
    args = hub_runs.swapped_args(path, tmp_path, data_dir)
    assert args[:2] == ["--config", str(path)]  # the file itself, unchanged, then only the swaps and the length
    result = run_script(hub_runs.script_for(path), *args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (summary,) = (tmp_path / "profiles").rglob("summary.json")
    summary = json.loads(summary.read_text())
    settings = yaml.safe_load(path.read_text())
    assert summary["steps"] == 2 and summary["world_size"] == settings["devices"]
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    # the run is the file's: its precision, quantization, batch sizes and sequence length
    first_line = next(line for line in result.stdout.splitlines() if " trainable / " in line)  # the run's own line
    assert f"precision {settings['precision']}" in first_line, first_line
    assert (settings.get("quantize") or "") in first_line
    micro = settings["train"]["micro_batch_size"]
    accumulation = settings["train"]["global_batch_size"] // (micro * settings["devices"])
    assert f"x {accumulation} micro-batch(es) of {micro} per step" in first_line, first_line
    assert summary["ledger_peak_bytes"], "the profiler window recorded the step"


@pytest.mark.skipif(not FILES, reason=f"{HUB} is absent: litgpt's config hub lives in ../shared beside the repo")
def test_the_committed_hub_runs_cover_every_file_and_each_trained():
    """benchmarks/hub_runs.py's record: every file of the hub, each trained its 2 steps to finite losses."""
    import json
    import math

    from conftest import ROOT

    record = json.loads((ROOT / "profiles/cpu/hub_runs.json").read_text())
    assert sorted(r["file"] for r in record["results"]) == sorted(str(f.relative_to(HUB)) for f in FILES)
    failed = [(r["file"], r.get("error")) for r in record["results"] if r["returncode"] or r.get("steps") != 2]
    assert failed == []
    assert all(math.isfinite(r["last_loss"]) for r in record["results"])


@pytest.mark.skipif(not FILES, reason=f"{HUB} is absent: litgpt's config hub lives in ../shared beside the repo")
def test_the_swapped_model_keeps_each_hub_architectures_code_paths():
    """The short runs' model (memfit.training.random_checkpoints.same_architecture_small) is the file's architecture
    made small: the fields that choose code paths are kept, the sizes are not."""
    import sys

    import torch
    import yaml
    from litgpt import GPT, Config

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hub_runs

    kept = ("mlp_class_name", "norm_class_name", "rotary_percentage", "parallel_residual", "bias", "shared_attention_norm",
            "attention_logit_softcapping", "final_logit_softcapping", "sliding_window_size", "post_attention_norm",
            "post_mlp_norm", "scale_embeddings", "block_size", "rope_base")  # fmt: skip
    for path in FILES:
        settings = yaml.safe_load(path.read_text())
        small = hub_runs.small_config(settings)
        if settings.get("model_config"):
            full = Config(**{k: v for k, v in settings["model_config"].items() if k != "hf_config"})
        else:
            full = Config.from_name(settings.get("model_name") or Path(settings["checkpoint_dir"]).name)
        assert {k: getattr(small, k) for k in kept} == {k: getattr(full, k) for k in kept}, path
        # multi-head, multi-query or grouped, as the full model
        assert (small.n_query_groups == small.n_head) == (full.n_query_groups == full.n_head), path
        assert (small.n_query_groups == 1) == (full.n_query_groups == 1), path
        if full.sliding_window_indices is not None:
            assert small.sliding_window_indices == full.sliding_window_indices[: small.n_layer], path
        with torch.device("meta"):
            parameters = sum(p.numel() for p in GPT(small).parameters())
        assert parameters < 300_000, (path, parameters)


@pytest.mark.slow
def test_a_hub_file_whose_weights_are_not_here_says_how_to_get_them(tmp_path):
    """A hub file names its checkpoint as `litgpt download` makes it; on a machine without it the run says so and
    gives both ways on (the download, or --estimate from the file alone), not "has no model_config.yaml"."""
    from conftest import run_in_process

    hub_file = HUB / "finetune/llama-2-7b/lora.yaml"
    if not hub_file.is_file():
        pytest.skip(f"{hub_file} is absent (litgpt's config hub in ../shared)")
    result = run_in_process("finetune/lora.py", "--config", str(hub_file), cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "'checkpoints/meta-llama/Llama-2-7b-hf' is not on this machine" in lines[0]
    assert "`litgpt download meta-llama/Llama-2-7b-hf`" in lines[0] and "--estimate true" in lines[0]
