"""The peer's FSDP, without Memfit: what one rank holds when torch's FSDP2 is driven as torchtitan drives it.

    torchrun --nproc_per_node 2 benchmarks/fsdp_peer.py --checkpoint_dir CKPT --micro_batches 4 --out peer.json

``benchmarks/fsdp_scaling.py`` runs this beside ``finetune/full.py --strategy fsdp`` on the same checkpoint and batch
shapes, so "measured / ideal" can be read against what the field's reference does, not only against the ideal 1/N:
the ideal leaves out what data parallelism does not shard (a micro-batch's activations, the units gathered around
their use, the collectives' buffers), which every FSDP pays.

The sharding is torchtitan's (``torchtitan/distributed/fsdp.py``, ``apply_fsdp``): the embedding a unit, the final
norm with the head a unit kept gathered after forward (it is prefetched for backward at once), each block a unit
resharded after forward, then the root. The loop is a plain one: each micro-batch's loss divided by their number,
``backward`` (FSDP2 reduce-scatters every micro-batch into the sharded gradients, as torchtitan and torchtune
accumulate), the gradient norm clipped to 1.0, fused AdamW, ``zero_grad(set_to_none=True)``; full fine-tuning, or
LoRA as ``finetune/lora.py``'s defaults (litgpt's LoRA layers, rank 8 on the query and the value, only they trained),
in float32 on CPU processes over gloo. The weights are the checkpoint's (``set_model_state_dict`` from the memory-mapped
full state dict, as torchtune fills its shards); the tokens are random, of the lengths given.

Measured as the ledger measures a Memfit run, so that the two differ only by what each run holds: the bytes of the
tensors alive when the last step begins (the weights' local shards and the optimizer state, by distinct storage),
plus the highest running total of the CPU allocator during that step, from ``torch.profiler``'s memory events
(``memfit.trace_events.memory_events``: with the frees of gloo's buffers that the profiler does not see).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # memfit, from a checkout


def alive_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the rank's parameters, gradients and optimizer state."""
    parameters = list(model.parameters())
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]
    tensors += [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in parameters) if g is not None]
    for state in optimizer.state.values():
        tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def highest_running_total(trace: Path) -> int:
    """The CPU allocator's highest running total during the profiled step, counted from the window's start, as the
    ledger counts it (with the frees of gloo's buffers that the profiler does not record put back)."""
    from memfit.trace_events import memory_events, read_trace_events

    memory = memory_events(read_trace_events(trace), device_type=0)
    _, first_total, first_size, *_ = memory[0]
    return max(total for _, total, *_ in memory) - (first_total - first_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", type=Path, required=True)
    parser.add_argument("--method", choices=["full", "lora"], default="full")
    parser.add_argument("--micro_batches", type=int, default=1, help="micro-batches per rank in a step")
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--sequence_length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--activation_checkpointing",
        default="false",
        help="true (each block), false, or a number of blocks spread from the first; wrapped before sharding",
    )
    args = parser.parse_args()

    from litgpt import lora
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # LoRA as lora.py's defaults: rank 8, alpha 16, on the query and the value
    lora_fields = dict(lora_r=8, lora_alpha=16, lora_dropout=0.0, lora_query=True, lora_value=True)
    config = lora.Config.from_file(
        args.checkpoint_dir / "model_config.yaml", **(lora_fields if args.method == "lora" else {})
    )
    with torch.device("meta"):
        model = lora.GPT(config)
    if args.method == "lora":
        lora.mark_only_lora_as_trainable(model)
    blocks = len(model.transformer.h)
    setting = args.activation_checkpointing.lower()
    count = blocks if setting == "true" else 0 if setting == "false" else int(setting)
    if count:  # torchtitan wraps a block in torch's checkpoint wrapper, then shards it
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        # count of the blocks spread evenly from the first: torchtitan's every-Nth-layer option where count divides
        # the depth, and the blocks Memfit's --activation_checkpointing N picks
        for index in sorted({j * blocks // count for j in range(count)}):
            model.transformer.h[index] = checkpoint_wrapper(model.transformer.h[index], preserve_rng_state=False)
    if world_size > 1:
        # torchtitan's units; the root takes what is left (nothing here: embedding and head are untied)
        fully_shard(model.transformer.wte, reshard_after_forward=True)
        fully_shard([model.transformer.ln_f, model.lm_head], reshard_after_forward=False)
        for block in model.transformer.h:
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model)
    model.to_empty(device="cpu")
    full = torch.load(args.checkpoint_dir / "lit_model.pth", mmap=True, weights_only=True)
    # litgpt's LoRA layers hold the checkpoint's linear as ``.linear``: named as the model names them, so the load
    # makes each rank's slices of every weight (litgpt's own renaming happens too late for sharded parameters)
    named = {key: key.replace(".linear.", ".") for key in model.state_dict()}
    full = {key: full[name] for key, name in named.items() if name in full}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=args.method == "full"))
    del full
    if args.method == "lora":  # the new weights: A drawn, B zero, as litgpt initialises them
        for module in model.modules():
            if isinstance(module, lora.LoRALayer) and hasattr(module, "reset_parameters"):
                module.reset_parameters()
    model.max_seq_length = args.sequence_length  # litgpt's rope cache, a buffer the load does not fill
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=True)

    generator = torch.Generator().manual_seed(1000 + rank)
    shape = (args.micro_batch_size, args.sequence_length + 1)

    def step() -> float:
        total = 0.0
        for _ in range(args.micro_batches):
            tokens = torch.randint(config.padded_vocab_size, shape, generator=generator)
            logits = model(tokens[:, :-1])  # (micro_batch_size, sequence_length, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / args.micro_batches
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(trained, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    losses = [step() for _ in range(args.steps - 1)]
    alive = alive_bytes(model, optimizer)
    trace = args.out.with_suffix(f".rank{rank}.trace.json")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        losses.append(step())
    profiler.export_chrome_trace(str(trace))
    peak = alive + highest_running_total(trace)
    trace.unlink()
    if rank == 0:
        report = {"world_size": world_size, "micro_batches_per_rank": args.micro_batches, "losses": losses}
        report.update(alive_at_step_start_bytes=alive, peak_bytes=peak, pid=os.getpid())
        args.out.write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
