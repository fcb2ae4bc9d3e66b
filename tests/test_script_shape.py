"""The five scripts keep lit-GPT's script-per-task shape, and their shared flags do not drift apart.

Code is repeated between the scripts on purpose; what must not differ is caught here (the contract --estimate relies
on, the flags every script shares) and by the behavioural tests that run against every script.
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


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_reads_top_to_bottom(script):
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    story = ["setup", "main", "fit", "train_step", "validate", "loss_fn", "target_tokens"]
    assert [name for name in functions if name in story] == story  # in reading order
    assert source.rstrip().endswith('if __name__ == "__main__":\n    CLI(setup)')
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


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_run_is_passed_by_name(script):
    """setup() hands the run to main() and main() to fit() by name: a run of same-typed positional arguments (the
    bools of a run, its paths) could be swapped without an error. main() and fit() take only keywords after fabric,
    and no call passes more than a handful of arguments by position (``optional`` passes its function's own on)."""
    tree = ast.parse((ROOT / script).read_text())
    for function in (node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in ("main", "fit")):
        assert [a.arg for a in function.args.args] == ["fabric"], function.name
        assert len(function.args.kwonlyargs) > 10, function.name
    long_calls = [
        (node.lineno, ast.unparse(node.func))
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and len(node.args) > 5 and ast.unparse(node.func) != "optional"
    ]
    assert long_calls == []


def test_shared_flags_are_the_same_in_every_script():
    signatures = {s: inspect.signature(load_script(s).setup).parameters for s in SCRIPTS}
    reference = {name: p for name, p in signatures["finetune/lora.py"].items() if name not in OWN}
    for script, parameters in signatures.items():
        shared = {name: p for name, p in parameters.items() if name not in OWN}
        assert shared.keys() == reference.keys(), script
        for name, parameter in shared.items():
            assert str(parameter.annotation) == str(reference[name].annotation), (script, name)
            assert parameter.default == reference[name].default, (script, name)


def test_train_step_is_the_same_contract_everywhere():
    """--estimate calls each script's train_step with these arguments (memfit.fake_step.ScriptStep)."""
    expected = ["fabric", "model", "optimizer", "micro_batches", "shares", "max_norm", "phases", "step"]
    for script in SCRIPTS:
        assert list(inspect.signature(load_script(script).train_step).parameters) == expected, script
