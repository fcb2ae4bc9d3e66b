"""Every kind of user mistake, for every script: one `error:` line naming the bad value, exit 2, no traceback, and
nothing written to --out_dir or --profile_dir.

The scripts run in-process through the same ``CLI`` entry a user's command goes through (a subprocess per case
would cost minutes); ``test_flags_and_errors.py`` runs the real command line for a sample of them.
"""

import io
import json
import shutil
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch
import yaml

from conftest import SCRIPTS, load_script, run_in_process

FINETUNE = SCRIPTS[:4]


class Evil:
    def __reduce__(self):
        return (print, ("this code ran",))


def _checkpoint(tmp_path: Path, embedded, variant: str) -> Path:
    """A copy of the embedded checkpoint dir, damaged as ``variant`` says."""
    source, _ = embedded
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    weights = target / "lit_model.pth"
    state = torch.load(weights, weights_only=True)
    if variant == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif variant == "empty":
        weights.write_bytes(b"")
    elif variant == "random_bytes":
        weights.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    elif variant == "integer_weights":
        torch.save({k: v.to(torch.int64) for k, v in state.items()}, weights)
    elif variant == "code_pickle":
        torch.save({**state, "transformer.wte.weight": Evil()}, weights)
    elif variant == "missing_weights":
        state.pop("transformer.h.1.attn.proj.weight")
        torch.save(state, weights)
    elif variant == "wrong_shapes":
        config = yaml.safe_load((target / "model_config.yaml").read_text())
        (target / "model_config.yaml").write_text(yaml.safe_dump({**config, "intermediate_size": 256}))
    elif variant == "bad_yaml":
        (target / "model_config.yaml").write_text("n_layer: [4\n")
    elif variant == "no_tokenizer_class":
        settings = json.loads((target / "tokenizer_config.json").read_text())
        settings.pop("tokenizer_class", None)
        (target / "tokenizer_config.json").write_text(json.dumps(settings))
    elif variant == "absurd_depth":
        config = yaml.safe_load((target / "model_config.yaml").read_text())
        (target / "model_config.yaml").write_text(yaml.safe_dump({**config, "n_layer": 100_000_000}))
    elif variant == "deeper_than_its_weights":  # 800 layers of the embedded width: more than its file holds
        config = yaml.safe_load((target / "model_config.yaml").read_text())
        (target / "model_config.yaml").write_text(yaml.safe_dump({**config, "n_layer": 800}))
    elif variant in CONFIG_VALUES:  # a hand-edited model_config.yaml, the value as written in the file
        config_text = (target / "model_config.yaml").read_text()
        key, written = CONFIG_VALUES[variant]
        kept = [line for line in config_text.splitlines() if not line.startswith(f"{key}:")]
        (target / "model_config.yaml").write_text("\n".join([*kept, f"{key}: {written}"]) + "\n")
    elif variant == "safetensors_only":  # Hugging Face's weights, not converted
        from safetensors.torch import save_file

        save_file(state, target / "model.safetensors")
        weights.unlink()
    elif variant == "unknown_key":
        config = yaml.safe_load((target / "model_config.yaml").read_text())
        (target / "model_config.yaml").write_text(yaml.safe_dump({**config, "n_layers": 4}))
    elif variant == "truncated_tokenizer_json":
        tokenizer = target / "tokenizer.json"
        tokenizer.write_bytes(tokenizer.read_bytes()[: tokenizer.stat().st_size // 2])
    elif variant in ("garbage_tokenizer_model", "empty_tokenizer_model"):  # SentencePiece's file, alone
        (target / "tokenizer.json").unlink()
        (target / "tokenizer.model").write_bytes(b"\x00\xffnot a model" if variant.startswith("garbage") else b"")
    elif variant == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            (target / name).unlink(missing_ok=True)
    elif variant == "lora_only":  # a LoRA run's final/, given as the base of another run
        weights.rename(target / "lit_model.pth.lora")
    elif variant == "larger_tokenizer":  # another model's tokenizer: ids past the embedding's rows
        _larger_tokenizer(target)
    elif variant == "hugging_face":  # as `huggingface-cli download` leaves it, before litgpt's conversion
        (target / "model_config.yaml").unlink()
        weights.rename(target / "model.safetensors")
        (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return target


def _larger_tokenizer(directory: Path) -> Path:
    """A tokenizer of 2,000 tokens (the embedded model's vocabulary holds 1,024) in ``directory``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    directory.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        (directory / name).unlink(missing_ok=True)
    Tokenizer(WordLevel({f"t{i}": i for i in range(2000)}, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return directory


def _records(embedded, n=40):
    _, json_path = embedded
    return json.loads(Path(json_path).read_text())[:n]


# model_config.yaml values litgpt's Config takes and then fails on, deep in the build or after training began
CONFIG_VALUES = {
    "exponent_as_text": ("n_layer", "1e8"),  # YAML 1.1 needs a dot: this is the string '1e8'
    "no_heads": ("n_head", "0"),
    "epsilon_as_text": ("norm_eps", "abc"),
    "size_as_list": ("intermediate_size", "[384]"),
    "heads_not_in_groups": ("n_query_groups", "3"),
}


def _data_file(tmp_path: Path, embedded, variant: str) -> Path:
    path = tmp_path / "data.json"
    records = _records(embedded)
    if variant == "not_json":
        path.write_text("{'instruction': 'no quotes'")
    elif variant == "not_a_list":
        path.write_text(json.dumps({"instruction": "a", "output": "b"}))
    elif variant == "empty_list":
        path.write_text("[]")
    elif variant == "no_output":
        path.write_text(json.dumps([{k: v for k, v in r.items() if k != "output"} for r in records]))
    elif variant == "non_string":
        path.write_text(json.dumps([{**r, "output": 7} for r in records]))
    elif variant == "empty_directory":
        path = tmp_path / "data_dir"
        path.mkdir()
        return path
    elif variant == "nested_deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif variant == "lone_surrogate":  # json.dumps writes it as the escape \ud800, which json.loads reads back
        path.write_text(json.dumps([*records[:3], {**records[3], "instruction": "six \ud800"}, *records[4:]]))
    elif variant == "jsonl_bad_line":  # line 4 of JSON Lines cut short
        path = tmp_path / "data.jsonl"
        lines = [json.dumps(r) for r in records]
        lines[3] = lines[3][:20]
        path.write_text("\n".join(lines) + "\n")
    elif variant == "fully_masked":
        path.write_text(json.dumps([{**r, "instruction": "word " * 200} for r in records]))
    else:
        path.write_text(json.dumps(records))
    return path


def _text_file(tmp_path: Path, variant: str) -> Path:
    path = tmp_path / "corpus.txt"
    if variant == "empty_text":
        path.write_text("")
    elif variant == "binary_text":
        path.write_bytes(bytes(range(128, 256)) * 64)
    else:
        path.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return path


FLAG_CASES = [
    (["--train.lr", "0"], "--train.lr 0.0 must be greater than 0"),
    (["--train.lr", "nan"], "--train.lr: Expected a <class 'float'>. Got value: nan"),
    (["--train.lr=-1e-3"], "--train.lr -0.001 must be greater than 0"),
    (["--train.lr", "-1e-3"], "written --flag=VALUE"),
    (["--train.max_steps", "0"], "--train.max_steps 0 must be"),
    (["--train.epochs", "-1"], "--train.epochs -1 must be"),
    (["--train.log_interval", "0"], "--train.log_interval 0 must be"),
    (["--train.save_interval", "0"], "--train.save_interval 0 must be"),
    (["--eval.interval", "0"], "--eval.interval 0 must be"),
    (["--eval.max_iters", "0"], "--eval.max_iters 0 must be"),
    (["--train.min_lr", "-1"], "--train.min_lr -1.0 must be 0 or more"),
    (["--train.max_time", "60"], "--train.max_time is not supported"),
    (["--eval.max_new_tokens", "0"], "--eval.max_new_tokens 0 must be"),
    (["--eval.evaluate_example", "last"], "--eval.evaluate_example 'last' must be first, random, or the index"),
    (
        ["--train.lr_warmup_fraction", "1.5", "--train.lr_warmup_steps", "0"],
        "--train.lr_warmup_fraction 1.5 must be in [0, 1)",
    ),
    (["--train.lr_warmup_fraction", "0.1", "--train.lr_warmup_steps", "5"], "both set the warm-up"),
    (["--profile.active", "0"], "--profile.active 0 must be at least 1"),
    (["--logger_name", "neptune"], "--logger_name 'neptune' is not one of 'tensorboard', 'csv', 'wandb', 'mlflow'"),
    (["--optimizer", "Adam"], "--optimizer 'Adam' is not one of 'AdamW', 'AdamW-foreach'"),
    (["--optimizer", '{"class_path": "torch.optim.Adam"}'], "--optimizer class_path 'torch.optim.Adam' is not one of"),
    (["--devices", "two"], "--devices"),
    (["--seed", "-1"], "--seed -1 must be between 0 and 4294967295"),
    # read as 16 bytes, it was planned for half a minute, then "nothing fits 16 B"
    (["--memory_budget", "16"], "--memory_budget '16' has no unit; write it like 24GiB"),
    # float() reads 400 digits as infinity: "cannot convert float infinity to integer"
    (["--estimate", "true", "--memory_budget", "9" * 400 + "GiB"], "is past any machine (over 1073741824.00 GiB)"),
    # read as a Path, "" is the current directory: final/ was written there
    (["--out_dir", ""], "--out_dir is empty (an unset shell variable?)"),
    (
        ["--estimate", "true", "--train.micro_batch_size", str(10**15), "--train.global_batch_size", str(10**15)],
        "the step's tensors are past what torch can size",
    ),
    # its hooks would step on 16-mixed's scaled gradients (16-mixed runs on GPUs only: an estimate for one)
    (
        [
            "--estimate",
            "true",
            "--accelerator",
            "cuda",
            "--precision",
            "16-mixed",
            "--optimizer_in_backward",
            "true",
            "--train.global_batch_size",
            "4",
            "--train.micro_batch_size",
            "4",
            "--train.max_norm",
            "null",
        ],
        "--optimizer_in_backward steps inside backward, before 16-mixed's gradient scaler unscales",
    ),
    # without a launcher the first node's process would wait for the others forever
    (
        ["--num_nodes", "2"],
        "--num_nodes 2: no launcher (torchrun, SLURM's srun, LSF, MPI) and MASTER_ADDR, MASTER_PORT, NODE_RANK not set",
    ),
    # jsonargparse applies flags in order: the file's 2 steps replaced the 5 given before it
    (
        ["--train.max_steps", "5", "--config", "c.yaml"],
        "--train.max_steps comes before --config, whose file would replace it: put --config first",
    ),
    # a field of a block given inline: the field and its reason (the reason was lost)
    (["--train", "{lr: abc}"], "--train.lr: Expected a <class 'float'>. Got value: abc"),
]
# the flags of one method: (flag, scripts, what the line must say)
METHOD_FLAG_CASES = [
    # jsonargparse puts the reason on the line after "Problem with given class_path ...:", which was cut off
    (["--data", "JSON", "--data.bogus", "1"], FINETUNE, "'litgpt.data.JSON': Validation failed: Key 'bogus' is not"),
    (["--lora_r", "0"], ["finetune/lora.py"], "--lora_r 0 must be a whole number greater than 0"),
    (["--lora_alpha", "0"], ["finetune/lora.py"], "--lora_alpha 0 must be greater than 0"),
    (["--lora_dropout", "1.5"], ["finetune/lora.py"], "--lora_dropout 1.5 must be in [0, 1)"),
    (
        ["--adapter.prompt_length", "0"],
        ["finetune/adapter.py", "finetune/adapter_v2.py"],
        "--adapter.prompt_length 0 must be a whole number greater than 0",
    ),
    (
        ["--adapter.start_layer", "-1"],
        ["finetune/adapter.py", "finetune/adapter_v2.py"],
        "--adapter.start_layer -1 must be 0 or more",
    ),
    # the embedded model has 4 layers; v2 still trains its scales and biases there
    (["--adapter.start_layer", "4"], ["finetune/adapter.py"], "--adapter.start_layer 4 leaves no layer a prompt"),
    # litgpt refuses a file here too; the line says how to give the architecture
    (
        ["--model_config", "model_config.yaml"],
        ["pretrain/pretrain.py"],
        "--model_config 'model_config.yaml': give the fields themselves, not a file: a `model_config:` block in a"
        " --config YAML file, or inline",
    ),
    (
        ["--model_name", "pythia-14m"],
        ["finetune/lora.py", "finetune/adapter.py", "finetune/adapter_v2.py", "finetune/full.py"],
        "--model_name 'pythia-14m' without --checkpoint_dir: fine-tuning needs that model's weights",
    ),
    (
        ["--model_config", "{n_layer: x}"],
        ["pretrain/pretrain.py"],
        "--model_config: n_layer: 'x' is not a whole number; fix the value",
    ),
    # litgpt's Config divides by it: "integer modulo by zero", naming no field
    (
        ["--model_config", "{n_head: 0, n_embd: 64, n_layer: 2}"],
        ["pretrain/pretrain.py"],
        "--model_config: n_head: 0 is not a size (a whole number above 0); fix the value",
    ),
    # an empty assertion: jsonargparse's report of it failed with an IndexError traceback
    (
        ["--model_config", "{n_head: 3, n_embd: 64, n_layer: 2}"],
        ["pretrain/pretrain.py"],
        "--model_config: litgpt's Config refuses these settings (assert self.n_embd % self.n_head == 0); fix the value",
    ),
]

# (case, scripts it applies to, what the line must say)
CASES = [
    *[
        (f"checkpoint:{v}", FINETUNE, says)
        for v, says in [
            ("truncated", "damaged or truncated"),
            ("empty", "damaged or truncated"),
            ("random_bytes", "damaged or truncated"),
            ("integer_weights", "not floating point"),
            ("code_pickle", "not a plain weights file"),
            ("missing_weights", "lacks 1 of the model's weights"),
            ("wrong_shapes", "does not match the architecture 'memfit-tiny-llama' (size mismatch for"),
            # said before the data is read and 800 layers are built
            ("deeper_than_its_weights", "under 1 byte a parameter: they are not the same model"),
        ]
    ],
    *[
        (f"checkpoint:{v}", SCRIPTS, says)
        for v, says in [
            ("bad_yaml", "model_config.yaml"),
            ("unknown_key", "'n_layers'"),
            ("no_tokenizer", "tokenizer"),
            ("hugging_face", "it holds a Hugging Face checkpoint: convert it with `litgpt convert_to_litgpt"),
            # it built layers for minutes, growing, before anything was said
            ("absurd_depth", "n_layer 100,000,000 is past any model"),
            (
                "exponent_as_text",
                "n_layer: '1e8' is not a whole number (YAML reads 1e8 as text, not a number): write 100000000",
            ),
            ("epsilon_as_text", "norm_eps: 'abc' is not a number; fix the value"),
            ("no_tokenizer_class", "its tokenizer_config.json has no 'tokenizer_class'"),
        ]
    ],
    *[
        (f"checkpoint:{v}", ["finetune/lora.py"], says)
        for v, says in [
            ("no_heads", "n_head: 0 is not a size (a whole number above 0)"),
            ("truncated_tokenizer_json", "tokenizer.json cannot be read as a tokenizer (EOF while parsing"),
            ("garbage_tokenizer_model", "tokenizer.model cannot be read as a tokenizer (INTERNAL: could not parse"),
            ("empty_tokenizer_model", "tokenizer.model cannot be read as a tokenizer (INTERNAL: unk is not defined"),
            # not "damaged or truncated": another format is there
            ("safetensors_only", "has no lit_model.pth, only Hugging Face weights (model.safetensors); convert them"),
            ("size_as_list", "intermediate_size: [384] is not a whole number or null"),
            ("heads_not_in_groups", "litgpt's Config refuses these settings (assert self.n_head % self.n_query_groups"),
        ]
    ],
    (
        "checkpoint:lora_only",
        FINETUNE,
        "holds LoRA weights only (lit_model.pth.lora); merge them into its base model first with `litgpt merge_lora",
    ),
    *[
        (f"data:{v}", FINETUNE, says)
        for v, says in [
            ("not_json", "is not valid JSON"),
            (
                "jsonl_bad_line",
                "data.jsonl is not valid JSON Lines: line 4, column 17: Unterminated string starting at;",
            ),
            ("not_a_list", "must be a JSON list"),
            ("empty_list", "holds no records"),
            ("no_output", "has no 'output'"),
            ("non_string", "has a int as 'output'"),
            ("fully_masked", "no sample has"),
            ("empty_directory", "'train.json' and 'val.json'"),
            ("bad_prompt_style", "--data.prompt_style 'chatml' is not one of litgpt's prompt styles (alpaca,"),
            ("split_past_one", "--data.val_split_fraction 1.5 must be in [0, 1)"),
            ("text_not_json", "Unsupported file format: .txt. Expected `.json` or `.jsonl`."),
            ("nested_deep", "nests its JSON deeper than Python's parser goes"),
            ("lone_surrogate", "record 3's 'instruction' holds '\\ud800' at character 4, half of a UTF-16 pair"),
            ("seed_past_64_bits", f"--data.seed {2**70} is not a seed torch takes"),
            (
                "example_past_both",
                "--eval.evaluate_example 99 is past both the validation set (4 samples) and the training set (36)",
            ),
        ]
    ],
    *[
        (f"text:{v}", ["pretrain/pretrain.py"], says)
        for v, says in [
            ("empty_text", "too few for blocks"),
            ("binary_text", "not UTF-8 text"),
        ]
    ],
    *[(f"flag:{i}", SCRIPTS, says) for i, (_, says) in enumerate(FLAG_CASES)],
    *[(f"flag:method{i}", scripts, says) for i, (_, scripts, says) in enumerate(METHOD_FLAG_CASES)],
    # litgpt's fine-tuning scripts refuse it too; pretraining ties the head to the embedding (tests/test_methods.py)
    ("flag:tie", FINETUNE, "--train.tie_embeddings is for pretraining: fine-tuning keeps the base model's head"),
    ("checkpoint:larger_tokenizer", FINETUNE, "its tokenizer has 2,000 tokens but the model's vocabulary holds 1,024"),
    ("tokenizer:larger", ["pretrain/pretrain.py"], "--tokenizer_dir"),
    ("data:bad_val_record", FINETUNE, "validation split: record 3 has no 'output'"),
    ("cache:file", SCRIPTS, "cannot create the embedded default in"),
    # nothing to download or convert: the cached copy is rebuilt once deleted
    ("cache:truncated", FINETUNE, "damaged or truncated; delete"),
    ("dir:out_dir_dangling_link", SCRIPTS, "is a link to"),
    ("dir:out_dir_under_file", SCRIPTS, "is a file"),
    ("dir:profile_dir_under_file", SCRIPTS, "is a file"),
    ("dir:lock_is_a_directory", ["finetune/lora.py"], ".memfit.lock is a directory, not Memfit's lock file; remove it"),
    # ENAMETOOLONG where the directory was first made: the profile dir's after training had started
    (
        "dir:out_dir_name_too_long",
        ["finetune/lora.py"],
        "--out_dir: the name 'oooooooooooooooooooooooooooooooooooooooo'..."
        " is 300 bytes long, past the 255 its file system takes for one name; shorten it",
    ),
    (
        "dir:profile_dir_name_too_long",
        ["pretrain/pretrain.py"],
        "--profile_dir: the name 'pppppppppppppppppppppppppppppppppppppppp'... is 300 bytes long, past the 255",
    ),
]
# The flag cases every script runs in the default tier: one for each place a flag is checked (the CLI's parsing and
# its one line, jsonargparse's choices, the --optimizer registry, memfit.settings.flag_values through resolve_training,
# TrainArgs, memfit.settings.resolve, memfit.settings.budget before the embedded default is built, the run dirs' check),
# so a script's setup() that leaves a check out fails here. The other flag cases run on lora.py, and on every script in
# the extended tier: the same shared checks, reached through the calls these cases already prove each script makes.
ON_EVERY_SCRIPT = {
    "--train.lr 0",
    "--train.lr -1e-3",
    "--logger_name neptune",
    "--optimizer Adam",
    "--train.lr_warmup_fraction 0.1 --train.lr_warmup_steps 5",
    "--seed -1",
    "--memory_budget 16",
    "--out_dir ",
    "--num_nodes 2",
    "--train.max_steps 5 --config c.yaml",
}
ON_LORA_BY_DEFAULT = {f"flag:{i}" for i, (flag, _) in enumerate(FLAG_CASES) if " ".join(flag) not in ON_EVERY_SCRIPT}
assert len(FLAG_CASES) - len(ON_LORA_BY_DEFAULT) == len(ON_EVERY_SCRIPT), "a key of ON_EVERY_SCRIPT names no flag case"
# The checkpoint and data cases every fine-tuning script runs in the default tier: one for each place its own code
# meets them (reading the config, loading the weights into its own model class, its own trainable weights' names, the
# data module it sets up, its masking, its validation example). The rest run on lora.py, and on every fine-tuning
# script in the extended tier: the same checks of memfit.settings.model_source, memfit.training.loading and
# memfit.training.data, reached through the calls these cases prove each script makes. Pretraining runs all of its own.
ON_EVERY_FINETUNING_SCRIPT = {
    "checkpoint:bad_yaml",
    "checkpoint:absurd_depth",
    "checkpoint:truncated",
    "checkpoint:missing_weights",
    "checkpoint:wrong_shapes",
    "checkpoint:lora_only",
    "data:not_json",
    "data:fully_masked",
    "data:example_past_both",
    "data:bad_val_record",
}


def _on_lora_by_default(case: str, script: str) -> bool:
    if script == "finetune/lora.py":
        return False
    if case in ON_LORA_BY_DEFAULT:
        return True
    fine_tuning = script != "pretrain/pretrain.py"
    return fine_tuning and case.startswith(("checkpoint:", "data:")) and case not in ON_EVERY_FINETUNING_SCRIPT


TABLE = [
    pytest.param(
        case,
        script,
        says,
        id=f"{script.split('/')[-1][:-3]}-{case}",
        marks=[pytest.mark.extended] if _on_lora_by_default(case, script) else [],
    )
    for case, scripts, says in CASES
    for script in scripts
]
assert ON_EVERY_FINETUNING_SCRIPT <= {case for case, _, _ in CASES}, "a key of ON_EVERY_FINETUNING_SCRIPT names no case"


def _args(case: str, script: str, tmp_path: Path, embedded) -> list[str]:
    kind, _, variant = case.partition(":")
    short = [
        "--train.max_steps",
        "2",
        "--train.global_batch_size",
        "4",
        "--train.micro_batch_size",
        "4",
        "--eval.max_iters",
        "1",
        "--logger_name",
        "csv",
        "--profile.enabled",
        "false",
    ]
    if kind == "checkpoint":
        ckpt = _checkpoint(tmp_path, embedded, variant)
        if script.startswith("pretrain"):
            data_args = ["--data", "PlainText", "--data.path", str(_text_file(tmp_path, "good"))]
        else:
            data = _data_file(tmp_path, embedded, "good")
            data_args = ["--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0.1"]
        return ["--checkpoint_dir", str(ckpt), *data_args, *short]
    if kind == "data" and variant == "bad_val_record":  # litgpt's JSON reads a directory's train.json and val.json
        ckpt, _ = embedded
        records = _records(embedded)
        (tmp_path / "split").mkdir()
        (tmp_path / "split/train.json").write_text(json.dumps(records[:36]))
        (tmp_path / "split/val.json").write_text(json.dumps(records[36:39] + [{"instruction": "no output"}]))
        return ["--checkpoint_dir", str(ckpt), "--data", "JSON", "--data.json_path", str(tmp_path / "split"), *short]
    if kind == "tokenizer":
        return ["--tokenizer_dir", str(_larger_tokenizer(tmp_path / "tokenizer")), *short]
    if kind == "cache":  # MEMFIT_CACHE (set by the test) under a file: the embedded default cannot be generated
        return short
    if kind == "data":
        ckpt, _ = embedded
        data = _data_file(tmp_path, embedded, variant)
        if variant == "text_not_json":
            data = data.rename(data.with_suffix(".txt"))
        extra = {
            "fully_masked": ["--train.max_seq_length", "64", "--data.mask_prompt", "true"],
            "bad_prompt_style": ["--data.prompt_style", "chatml"],
            "split_past_one": ["--data.val_split_fraction", "1.5"],
            "example_past_both": ["--eval.evaluate_example", "99", "--eval.max_new_tokens", "4"],
            "seed_past_64_bits": ["--data.seed", str(2**70)],
        }.get(variant, [])
        return [
            "--checkpoint_dir",
            str(ckpt),
            "--data",
            "JSON",
            "--data.json_path",
            str(data),
            "--data.val_split_fraction",
            "0.1",
            *short,
            *extra,
        ]
    if kind == "text":
        ckpt, _ = embedded
        return [
            "--checkpoint_dir",
            str(ckpt),
            "--data",
            "PlainText",
            "--data.path",
            str(_text_file(tmp_path, variant)),
            *short,
        ]
    if kind == "dir" and variant == "lock_is_a_directory":
        (tmp_path / "out/.memfit.lock").mkdir(parents=True)
        return ["--out_dir", str(tmp_path / "out"), *short]
    if kind == "dir" and variant.endswith("_name_too_long"):
        flag = "--out_dir" if variant.startswith("out_dir") else "--profile_dir"
        return [flag, str(tmp_path / "runs" / (flag[2] * 300) / "sub"), *short]
    if kind == "dir" and variant == "out_dir_dangling_link":
        (tmp_path / "link").symlink_to(tmp_path / "gone")
        return ["--out_dir", str(tmp_path / "link"), *short]
    if kind == "dir":
        (tmp_path / "a_file").write_text("x")
        flag = "--out_dir" if variant.startswith("out_dir") else "--profile_dir"
        return [flag, str(tmp_path / "a_file" / "sub"), *short]
    raise AssertionError(case)


FLAG_ARGS = (
    {f"flag:{i}": flag for i, (flag, _) in enumerate(FLAG_CASES)}
    | {f"flag:method{i}": flag for i, (flag, _, _) in enumerate(METHOD_FLAG_CASES)}
    | {"flag:tie": ["--train.tie_embeddings", "true"]}
)


# what torchrun, srun, LSF and a by-hand rendezvous set; Fabric's cluster environments detect them
LAUNCHER_VARIABLES = [
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_JOB_NAME",
    "LSB_JOBID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
]


@pytest.mark.slow
@pytest.mark.parametrize("case, script, says", TABLE)
def test_bad_input_gets_one_line_and_writes_nothing(tmp_path, monkeypatch, embedded, case, script, says):
    from memfit.settings.cli import CLI

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    args = FLAG_ARGS[case] if case.startswith("flag:") else _args(case, script, inputs, embedded)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for name in LAUNCHER_VARIABLES:  # the --num_nodes case is refused only outside a launcher
        monkeypatch.delenv(name, raising=False)
    if case == "cache:file":
        (inputs / "a_file").write_text("x")
        monkeypatch.setenv("MEMFIT_CACHE", str(inputs / "a_file" / "cache"))
    if case == "cache:truncated":
        cached = inputs / "cache" / embedded[0].parent.name
        shutil.copytree(embedded[0].parent, cached)
        weights = cached / "checkpoint/lit_model.pth"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        monkeypatch.setenv("MEMFIT_CACHE", str(inputs / "cache"))
    if not case.startswith("dir:"):
        args = [*args, "--out_dir", str(work / "out"), "--profile_dir", str(work / "profiles")]
    stderr = io.StringIO()
    with redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        CLI(load_script(script).setup, args)
    lines = stderr.getvalue().strip().splitlines()
    assert exit_info.value.code == 2, stderr.getvalue()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert "Traceback" not in stderr.getvalue()
    assert list(work.iterdir()) == [], f"{case} left {list(work.rglob('*'))}"


@pytest.mark.parametrize("launcher", ["by hand", "torchrun", "srun"])
def test_several_nodes_under_a_launcher_are_not_refused(monkeypatch, launcher):
    """The refusal of --num_nodes 2 above is only for a process no launcher started: each of these is what Fabric
    takes the rendezvous from (its LightningEnvironment, TorchElasticEnvironment and SLURMEnvironment)."""
    from memfit.errors import UserError
    from memfit.settings.flag_values import check_launcher

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="--num_nodes 2: no launcher"):
        check_launcher(2, 8)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(UserError, match="NODE_RANK not set"):  # a partial rendezvous is still refused
        check_launcher(2, 8)
    variables = {
        "by hand": {"NODE_RANK": "1"},
        "torchrun": {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"},
        "srun": {"SLURM_NTASKS": "16", "SLURM_JOB_NAME": "finetune"},
    }[launcher]
    if launcher != "by hand":
        monkeypatch.delenv("MASTER_ADDR")
        monkeypatch.delenv("MASTER_PORT")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    check_launcher(2, 8)


def test_flags_that_disagree_with_torchruns_processes_are_one_line(monkeypatch):
    """``--num_nodes 2`` under a one-node torchrun made each rank fail on the global batch's share and torchrun add
    its own traceback: the processes torchrun started (its WORLD_SIZE, LOCAL_WORLD_SIZE) and the flags must agree."""
    from memfit.errors import UserError
    from memfit.settings.flag_values import check_launcher

    for name, value in {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError) as refused:
        check_launcher(2, 2)
    assert str(refused.value) == (
        "--num_nodes 2 --devices 2 ask for 4 processes, but torchrun started 2 (1 node(s) of 2); give --num_nodes 1"
        " --devices 2, or start torchrun with --nnodes 2 --nproc_per_node 2"
    )
    check_launcher(1, 2)


@pytest.mark.slow
def test_a_record_past_millions_of_characters_is_cut_before_it_is_tokenized(tmp_path, embedded, monkeypatch):
    """Tokenizing a 200 MB output took 21.6 GB before the kernel killed the run (litgpt tokenizes a whole record
    before cutting the sample to the sequence length): a record past ``RECORD_CHARACTERS`` (4,000,000) is cut to
    that many first, said in one warning line, and the run trains on it. The sample, its first
    --train.max_seq_length tokens, is the one the whole record would have given. The limit is lowered to 20,000 here
    (tokenizing millions of characters twice cost the suite 20 s): the same code, the same cut."""
    from litgpt.data.base import SFTDataset
    from litgpt.tokenizer import Tokenizer

    from memfit.training.data import check_records

    monkeypatch.setattr("memfit.training.data.RECORD_CHARACTERS", 20_000)
    records = _records(embedded)
    records[7] = {**records[7], "instruction": "ab", "input": "", "output": "x y " * 5_001}
    data = tmp_path / "long.json"
    data.write_text(json.dumps(records))
    args = _args("data:good", "finetune/lora.py", tmp_path, embedded)
    args[args.index("--data.json_path") + 1] = str(data)
    # the limit is the larger of RECORD_CHARACTERS and 64 characters a token of the sequence length
    result = run_in_process("finetune/lora.py", *args, "--train.max_seq_length", "64", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [line for line in result.stdout.splitlines() if "past 20,000 characters" in line]
    assert "1 record(s)" in line and "record 7, has 20,006" in line, line

    tokenizer, length = Tokenizer(embedded[0]), 64
    whole = SFTDataset([dict(records[7])], tokenizer, prompt_style="alpaca", max_seq_length=length)
    cut = SFTDataset([dict(records[7])], tokenizer, prompt_style="alpaca", max_seq_length=length)
    check_records(cut, "test", length, warn=lambda line: None)
    assert len(cut.data[0]["output"]) == 20_000 - 2 and len(whole.data[0]["output"]) == 20_004
    assert torch.equal(whole[0]["input_ids"], cut[0]["input_ids"]) and len(cut[0]["input_ids"]) == length


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--config", "{fifo}"], ["--data", "PlainText", "--data.path", "{fifo}"]])
def test_a_path_that_would_block_is_refused_in_one_line(tmp_path, flags):
    """A named pipe blocks whoever reads it until a writer comes: given as --config or as a data path it hung the run
    (inside jsonargparse, inside read_text). It is refused before anything reads it."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = run_in_process("finetune/lora.py", *[flag.format(fifo=fifo) for flag in flags], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert (
        line
        == f"error: {flags[-2]} '{fifo}' is a named pipe (FIFO), not a file or directory: give a regular file or directory"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]
