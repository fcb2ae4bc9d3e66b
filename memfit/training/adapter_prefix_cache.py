"""A workaround for litgpt's LLaMA-Adapter (v1 and v2) when training.

litgpt 0.5's adapter attention caches the prefix keys and values (``adapter_kv_cache``) on its first forward and
reuses them on every later one. That is right for inference, where the prefix is constant; in training the cached
tensors belong to the first step's autograd graph, so the second backward fails with "Trying to backward through
the graph a second time", and the prefix would never see the updated prompts. We drop the cache before every
training forward.
"""

from __future__ import annotations

import torch


def _drop_prefix_cache(model: torch.nn.Module, _args) -> None:
    if model.training:
        for module in model.modules():
            if getattr(module, "adapter_kv_cache", None) is not None:
                module.adapter_kv_cache = None


def recompute_prefix_when_training(model: torch.nn.Module) -> None:
    model.register_forward_pre_hook(_drop_prefix_cache)
