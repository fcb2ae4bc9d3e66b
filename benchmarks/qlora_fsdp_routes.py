"""Which 4-bit base can torch's second FSDP (``fully_shard``) shard? A reproduction on 2 CPU processes (gloo).

    python benchmarks/qlora_fsdp_routes.py

For each route, litgpt's LoRA GPT (the embedded tiny Llama's shape, random weights, seeded) has every frozen base
linear weight quantized to NF4, each block then the root is sharded over 2 processes, and 3 LoRA steps run on the
same batches as one process with the same quantized model. Printed per route: whether it trains, the largest
difference in loss against the one-process run, and rank 0's bytes of quantized weights against the unsharded
model's (1/2 expected).

- ``bitsandbytes``: ``bnb.nn.Params4bit`` (quant_storage bfloat16, as torchtune's and axolotl's bitsandbytes QLoRA
  configure it): the shard is a plain ``DTensor`` of the packed bytes; the quantization state (absmax, code, shape)
  stays with the original parameter, not with the gathered copy.
- ``torchao``: ``torchao``'s ``NF4Tensor``, which implements FSDP's ``fsdp_pre_all_gather``/``fsdp_post_all_gather``
  (the packed data and its scalers are gathered together): the route torchtune shards.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3


def build(route: str):
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    torch.manual_seed(0)
    # torchao's NF4Tensor shards its scalers too: each weight's elements a multiple of 64 x 256 x world size
    config = Config(
        block_size=64,
        vocab_size=1024,
        padded_vocab_size=1024,
        n_layer=2,
        n_head=4,
        n_query_groups=4,
        n_embd=256,
        intermediate_size=512,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        parallel_residual=False,
        rotary_percentage=1.0,
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        lora_query=True,
        lora_value=True,
    )
    model = GPT(config)
    mark_only_lora_as_trainable(model)
    for parent in list(model.transformer.h.modules()):
        for name, module in list(parent.named_children()):
            if type(module) is not torch.nn.Linear or module.weight.requires_grad:
                continue
            weight = module.weight.data
            if route == "torchao":
                from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

                module.weight = torch.nn.Parameter(
                    to_nf4(weight, block_size=64, scaler_block_size=256), requires_grad=False
                )
            else:
                import bitsandbytes as bnb

                layer = bnb.nn.Linear4bit(
                    module.in_features,
                    module.out_features,
                    bias=False,
                    compute_dtype=torch.float32,
                    quant_type="nf4",
                    quant_storage=torch.bfloat16,
                )
                layer.weight = bnb.nn.Params4bit(
                    weight, requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16
                )._quantize("cpu")
                setattr(parent, name, layer)
    return model


def quantized_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        if p.requires_grad:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        inner = getattr(local, "quantized_data", None)
        if inner is not None:
            total += sum(
                t.untyped_storage().nbytes() for t in (inner, local.quantized_scalers, local.quantization_factor)
            )
        elif local.dtype != torch.float32:
            total += local.untyped_storage().nbytes()
    return total


def train(model, rank: int, world: int) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        batch = torch.randint(0, 1024, (4, 33), generator=torch.Generator().manual_seed(step))
        rows = batch[rank::world]
        logits = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reduced = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reduced)
        losses.append(reduced.item() / world)
    return losses


def worker(rank: int, route: str, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = build(route)
        whole = quantized_bytes(model)
        mesh = init_device_mesh("cpu", (2,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        losses = train(model, rank, 2)
        results[rank] = {"losses": losses, "bytes": quantized_bytes(model), "whole": whole}
    except Exception as error:  # the reproduction: what fails, and where
        results[rank] = {
            "error": f"{type(error).__name__}: {error}",
            "where": traceback.format_exc().strip().splitlines()[-3:],
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    routes = sys.argv[1:] or ["bitsandbytes", "torchao"]
    for port, route in enumerate(routes, start=29611):
        try:
            one = train(build(route), 0, 1)
        except Exception as error:
            print(f"{route}: one process fails: {type(error).__name__}: {error}")
            continue
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(worker, args=(route, port, results), nprocs=2, join=True)
            rank0 = dict(results[0])
        if "error" in rank0:
            print(f"{route}: fails under fully_shard on 2 processes: {rank0['error']}")
            for line in rank0["where"]:
                print(f"    {line}")
            continue
        difference = max(abs(a - b) for a, b in zip(one, rank0["losses"]))
        print(
            f"{route}: trains on 2 processes; losses {[f'{x:.4f}' for x in rank0['losses']]} (one process"
            f" {[f'{x:.4f}' for x in one]}, largest difference {difference:.2e}); rank 0 holds"
            f" {rank0['bytes']:,} of the {rank0['whole']:,} quantized bytes ({rank0['bytes'] / rank0['whole']:.2f})"
        )


if __name__ == "__main__":
    main()
