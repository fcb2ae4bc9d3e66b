"""The analytic floor against what bitsandbytes really stores, and against the estimate it must stay under."""

import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # the floor is the benchmarks' yardstick, not part of memfit


def _storage_bytes(model) -> int:
    """What the loaded model's weights occupy: 4-bit layers' packed weights and their quantization state included."""
    import bitsandbytes as bnb

    total = 0
    for parameter in model.parameters():
        total += parameter.numel() * parameter.element_size()
        state = getattr(parameter, "quant_state", None) if isinstance(parameter, bnb.nn.Params4bit) else None
        if state is not None:
            total += state.absmax.numel() * state.absmax.element_size()
            if state.state2 is not None:
                total += state.state2.absmax.numel() * state.state2.absmax.element_size()
    return total


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "bnb.nf4", "bnb.nf4-dq"])
def test_weights_floor_matches_what_a_loaded_model_stores(embedded, quantize):
    from floor import memory_floor
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    from memfit.training.loading import load_model
    from memfit.training.quantizers import QUANTIZERS

    checkpoint_dir, _ = embedded
    config = Config.from_file(checkpoint_dir / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
    with torch.device("meta"):
        meta = GPT(config)
    mark_only_lora_as_trainable(meta)
    floor = memory_floor(
        meta, quantize, torch.bfloat16, tokens_per_micro_batch=4 * 64, n_layer=config.n_layer, n_embd=config.n_embd
    )
    model = load_model(
        GPT,
        config,
        checkpoint_dir / "lit_model.pth",
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        quantize=QUANTIZERS[quantize] if quantize else None,
        new_parameters=("lora_A", "lora_B"),
    )
    stored = _storage_bytes(model)
    assert floor.weights == pytest.approx(stored, rel=0.02), (floor.weights, stored)
    mark_only_lora_as_trainable(model)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert floor.trainable_state == 3 * trainable and floor.activations == config.n_layer * 4 * 64 * config.n_embd * 2


@pytest.mark.slow
def test_the_floor_stays_under_the_estimate_for_qlora_7b(tmp_path):
    """The estimate (the script's own step traced on fake tensors) keeps everything the floor counts and more."""
    from floor import memory_floor
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    from conftest import load_script
    from memfit.args import TrainArgs

    def estimate(checkpointing: bool):
        return (
            load_script("finetune/lora.py")
            .setup(
                model_name="Llama-2-7b-hf",
                precision="bf16-true",
                quantize="bnb.nf4",
                estimate=True,
                activation_checkpointing=checkpointing,
                train=TrainArgs(global_batch_size=4, micro_batch_size=4, max_seq_length=512, max_steps=1),
            )
            .peak
        )

    config = Config.from_name("Llama-2-7b-hf", lora_r=8, lora_query=True, lora_value=True)
    with torch.device("meta"):
        meta = GPT(config)
    mark_only_lora_as_trainable(meta)
    floor = memory_floor(meta, "bnb.nf4", torch.bfloat16, 4 * 512, config.n_layer, config.n_embd)
    assert 3.6e9 < floor.weights < 4.0e9  # 6.5B 4-bit weights at 0.5625 bytes, 0.26B 16-bit (embedding)
    kept, recomputed = estimate(False), estimate(True)
    print(
        f"floor {floor.total / 2**30:.2f} GiB, estimate {kept / 2**30:.2f} GiB,"
        f" checkpointed {recomputed / 2**30:.2f} GiB"
    )
    # every activation kept is far above the floor; recomputing each block comes close to it
    assert floor.total < recomputed < kept and recomputed < 1.5 * floor.total, (floor, recomputed, kept)


def test_the_gpu_benchmark_configurations_parse_and_have_floors(tmp_path):
    """benchmarks/compare_litgpt.py's GPU set, checked where no GPU is needed: Memfit's command for each parses
    against its script's flags, and each floor is computed (on the meta device) and ordered as expected."""
    import sys
    from types import SimpleNamespace

    from jsonargparse import auto_parser

    from conftest import ROOT, load_script

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare_litgpt

    args = SimpleNamespace(accumulation=1, steps=10)
    floors = {}
    for config in compare_litgpt.GPU_CONFIGS:
        method, architecture, precision, quantize, micro, length = config
        command = compare_litgpt.commands(
            "memfit", method, tmp_path / architecture, tmp_path / "data.json", precision, quantize, micro, length, args
        )
        script = command[1][len(str(ROOT)) + 1 :]
        parser = auto_parser(load_script(script).setup, as_positional=False)
        parsed = parser.parse_args(command[2:])
        assert parsed.train.micro_batch_size == micro and parsed.train.max_seq_length == length
        assert parsed.quantize == quantize and parsed.precision == precision
        floors[config] = compare_litgpt.floors(*config, matmul_flops=1e15)
    qlora = {(q, m, n): f["memory_bytes"] for (_, _, _, q, m, n), f in floors.items()}
    assert qlora[("bnb.nf4-dq", 1, 512)] < qlora[("bnb.nf4", 1, 512)] < qlora[("bnb.nf4", 4, 2048)]
    # FLOPs per token against the models' published sizes less the embedding lookup (32000 x n_embd):
    # 6 x 1.10B - 65.5M for the full fine-tune, 4 x (6.74B - 131M) for LoRA on the 7B (its adapters are tiny)
    full = floors[compare_litgpt.GPU_CONFIGS[-1]]
    assert full["flops_per_token"] == pytest.approx(6 * (1.100e9 - 65.5e6), rel=0.02)
    assert floors[compare_litgpt.GPU_CONFIGS[0]]["flops_per_token"] == pytest.approx(4 * (6.738e9 - 131e6), rel=0.02)
    assert full["weights_bytes"] == pytest.approx(2 * 1.100e9, rel=0.02)  # bf16


def test_a_benchmark_process_past_its_time_is_stopped_and_reported(tmp_path):
    """On a lent GPU a device call lasts 10 minutes at most: one configuration that hangs must not take the others'
    time. compare_litgpt's and estimate_accuracy's runs stop a process at their --timeout and report it as failed."""
    import importlib.util
    import sys
    import time

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare_litgpt

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.perf_counter()
    with pytest.raises(compare_litgpt.Failed, match="stopped after 2 s"):
        compare_litgpt.run(sleeper, tmp_path / "compare", cuda=False, timeout=2)
    spec = importlib.util.spec_from_file_location("estimate_accuracy", ROOT / "benchmarks/estimate_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.run(sleeper, tmp_path, timeout=2)
    assert result.returncode == 124 and result.stderr == "stopped after 2 s"
    assert time.perf_counter() - started < 20


def test_a_tools_peak_rss_below_the_benchmarks_own_is_refused_not_reported(tmp_path):
    """A child's ru_maxrss starts at the RSS of the process that started it (Linux keeps the high-water mark across
    exec), so a benchmark driver that had imported lightning reported 522 MB for every tool alike. compare_litgpt's
    run refuses such a figure, and passes one that is the child's own."""
    import resource
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare_litgpt

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # this test process: torch and more, imported
    with pytest.raises(compare_litgpt.Failed, match="peak RSS not measurable"):
        compare_litgpt.run([sys.executable, "-c", "pass"], tmp_path / "small", cuda=False, timeout=60)
    bigger = own + 64 * 2**20
    _, _, peaks = compare_litgpt.run(
        [sys.executable, "-c", f"x = b'1' * {bigger}"], tmp_path / "big", cuda=False, timeout=60
    )
    assert bigger <= peaks["peak_rss_bytes"] <= bigger + 64 * 2**20
