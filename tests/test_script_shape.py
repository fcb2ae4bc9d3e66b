"""The five scripts keep lit-GPT's script-per-task shape, and their shared flags do not drift apart.

The training story is repeated between the scripts on purpose (the machinery around it is in memfit/ once); what must
not differ is caught here (the contract --estimate relies on, the flags every script shares, main() and fit() taking
the one resolved run) and by the behavioural tests that run against every script.
"""

import ast
import inspect

import pytest

from conftest import ROOT, SCRIPTS, load_script

# what each script differs in on purpose: its method's flags, where it writes, its defaults sized for its method
# flags one script has and others lack, as in litgpt (pretraining takes no --access_token: its data needs none)
# sample_order is fine-tuning's: litgpt's pretraining order is litdata's stream shuffle, not a DataLoader's permutation
OWN = (
    {"out_dir", "train", "adapter", "model_config", "tokenizer_dir", "initial_checkpoint_dir", "access_token"}
    | {"sample_order"}
    | {f"lora_{n}" for n in ("r", "alpha", "dropout", "query", "key", "value", "projection", "mlp", "head")}
)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_reads_top_to_bottom(script):
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    story = ["setup", "main", "fit", "train_step", "validate", "loss_fn", "target_tokens"]
    assert [name for name in functions if name in story] == story  # in reading order
    # fine-tuning takes litgpt's defaults for a real model (pretraining has no checkpoint to fine-tune)
    # and leaves out of its --help the flags only pretraining honours
    fine_tuning = "CLI(setup, real_model_defaults=LITGPT_DEFAULTS, hidden=PRETRAINING_ONLY)"
    main = "CLI(setup)" if script.startswith("pretrain") else fine_tuning
    assert source.rstrip().endswith(f'if __name__ == "__main__":\n    {main}')
    # every Fabric call of the run is a call in the script (not in a comment or a string): the loop's calls are not
    # hidden in memfit/
    called = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for call in (
        "L.Fabric",
        "fabric.launch",
        "fabric.setup_module",
        "fabric.backward",
        "fabric.no_backward_sync",
        "fabric.clip_gradients",
        "fabric.seed_everything",
        "optimizer.step",
        "optimizer.zero_grad",
    ):
        assert call in called, call


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_main_and_fit_take_the_run(script):
    """setup() resolves every flag into one frozen run (memfit.settings.run.Run) and launches main(fabric, run, script);
    main() hands fit() the run and a few live objects, by name: a run of same-typed positional arguments could be
    swapped without an error. No call passes more than a handful of arguments by position."""
    tree = ast.parse((ROOT / script).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    main, fit = functions["main"], functions["fit"]
    assert [a.arg for a in main.args.args] == ["fabric", "run", "script"] and not main.args.kwonlyargs
    assert [a.arg for a in fit.args.args] == ["fabric", "run"]
    assert len(fit.args.kwonlyargs) <= 8, [a.arg for a in fit.args.kwonlyargs]
    long_calls = [
        (node.lineno, ast.unparse(node.func))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and len(node.args) > 5
    ]
    assert long_calls == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_flag_the_run_reads_is_written_once(script):
    """A flag main() reads reaches it through the run, not through a chain of keyword arguments: the script names
    it in setup()'s signature, its docstring and where it is used, and nowhere as ``name=name``; setup() hands its
    flags, as given, to memfit.settings.recipe, which makes the run from them once (``Run.of``, each by name)."""
    source = (ROOT / script).read_text()
    assert "Run.of(" not in source and "resolve_" in source
    recipe = (ROOT / "memfit/settings/recipe.py").read_text()
    (call,) = [part.split("\n    )\n", 1)[0] for part in recipe.split("    run = Run.of(\n")[1:]]
    for flag in ("overwrite", "seed", "resume_with_changed_data", "memory_budget", "profile", "logger_name", "log"):
        assert f'        {flag}=flags["{flag}"],\n' in call + "\n", flag
        # never passed on by the script to main() or fit()
        assert not [line for line in source.splitlines() if line.strip().startswith(f"{flag}={flag}")], flag
    # each reaches its use as the run's (in the script, or in the machinery main() hands the run to)
    machinery = "".join(path.read_text() for path in sorted((ROOT / "memfit").rglob("*.py")))
    for flag in ("overwrite", "seed", "resume_with_changed_data"):
        assert f"run.{flag}" in source + machinery, flag


def test_shared_flags_are_the_same_in_every_script():
    signatures = {s: inspect.signature(load_script(s).setup).parameters for s in SCRIPTS}
    reference = {name: p for name, p in signatures["finetune/lora.py"].items() if name not in OWN}
    for script, parameters in signatures.items():
        shared = {name: p for name, p in parameters.items() if name not in OWN}
        assert shared.keys() == reference.keys(), script
        for name, parameter in shared.items():
            assert str(parameter.annotation) == str(reference[name].annotation), (script, name)
            assert parameter.default == reference[name].default, (script, name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_its_help_in_one_place(script):
    """Each of setup()'s parameters is described once: by the script's docstring (its own flags) or by
    memfit.settings.flag_help (the flags every recipe shares), never both, and --help shows that text."""
    import re

    from docstring_parser import parse

    from memfit.settings.cli import make_parser
    from memfit.settings.flag_help import SHARED_FLAG_HELP

    setup = load_script(script).setup
    own = {param.arg_name for param in parse(setup.__doc__).params}
    parameters = set(inspect.signature(setup).parameters)
    assert not own & set(SHARED_FLAG_HELP), own & set(SHARED_FLAG_HELP)  # a second, drifting copy
    assert parameters - own - set(SHARED_FLAG_HELP) == set(), "undescribed"
    assert own <= parameters, own - parameters  # a description of a flag the script no longer takes
    shown = " ".join(make_parser(setup).format_help().split())
    for name in parameters & set(SHARED_FLAG_HELP):
        words = SHARED_FLAG_HELP[name].split()[:5]  # a group's title (fsdp, profile) ends in ":" for the last "."
        assert " ".join(words) in shown, (name, words)
    assert re.search(r"--memory_budget\b", shown)


def test_train_step_is_the_same_contract_everywhere():
    """--estimate calls each script's train_step with these arguments (memfit.settings.run.ScriptStep)."""
    expected = ["fabric", "model", "optimizer", "micro_batches", "shares", "settings", "phases", "step"]
    for script in SCRIPTS:
        assert list(inspect.signature(load_script(script).train_step).parameters) == expected, script


def test_every_flag_reaches_the_run_or_is_setups_own():
    """Each flag of setup() is a field of the resolved run (memfit.settings.run.Run.of takes it by name) or one setup()
    uses up itself (the method's own, which go into the config; whether to estimate; where to resume from, resolved to a
    checkpoint; the token, handed to the data; litgpt's model_config, which becomes the config)."""
    import dataclasses

    from memfit.settings.run import Run

    fields = {field.name for field in dataclasses.fields(Run)}
    setups_own = {"estimate", "resume", "access_token", "adapter", "model_config"}
    for script in SCRIPTS:
        for name in inspect.signature(load_script(script).setup).parameters:
            assert name in fields or name in setups_own or name.startswith("lora_"), (script, name)


def test_the_flags_parse_where_the_script_is_not_a_module_of_its_own():
    """``python -m cProfile finetune/lora.py`` runs the script's code in a dict of globals that no module in
    sys.modules holds: its flags' types (strings, ``from __future__ import annotations``) still resolve, in setup()'s
    own globals."""
    from memfit.settings.cli import make_parser

    path = ROOT / "finetune/lora.py"
    scope = {"__name__": "__main__", "__file__": str(path)}  # as cProfile runs it: sys.modules["__main__"] is not it
    source = path.read_text().split('\nif __name__ == "__main__":')[0]  # its definitions, not its command line
    exec(compile(source, str(path), "exec"), scope)
    config = make_parser(scope["setup"]).parse_args(["--quantize", "bnb.nf4", "--precision", "bf16-true"])
    assert (config.quantize, config.precision) == ("bnb.nf4", "bf16-true")
