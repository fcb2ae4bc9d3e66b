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

    from memfit.cli import make_parser
    from memfit.optim import resolve_optimizer

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
