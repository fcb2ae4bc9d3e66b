# Put this directory on PYTHONPATH with MEMFIT_TEST_DEFECT set to plant a defect in a distributed run, so a test can
# show that its comparison with one process fails on it:
#   rank1_loss_twice: rank 1's loss is weighted twice in backward (its samples count double in the step's gradient)
#   no_gradient_sync: the ranks never reduce their gradients (DDP's all-reduce and FSDP's reduce-scatter skipped)
#   rank1_out_of_memory: rank 1's third backward raises PyTorch's out-of-memory error, where an allocation would fail
# Lightning is patched when it is first imported, not here: this file runs in every Python process the run starts.
import importlib.abc
import importlib.machinery
import os
import sys

DEFECT = os.environ.get("MEMFIT_TEST_DEFECT")


def _plant(module) -> None:
    fabric_class = module.Fabric
    if DEFECT == "rank1_loss_twice":
        backward = fabric_class.backward

        def backward_twice_on_rank1(self, tensor, *args, **kwargs):
            return backward(self, tensor * 2 if self.global_rank == 1 else tensor, *args, **kwargs)

        fabric_class.backward = backward_twice_on_rank1
    elif DEFECT == "no_gradient_sync":
        setup_module = fabric_class.setup_module

        def setup_without_sync(self, module, *args, **kwargs):
            wrapped = setup_module(self, module, *args, **kwargs)
            for inner in wrapped.modules():
                if hasattr(inner, "set_requires_gradient_sync"):  # FSDP2: no reduce-scatter
                    inner.set_requires_gradient_sync(False, recurse=False)
                if hasattr(inner, "require_backward_grad_sync"):  # DDP: no all-reduce
                    inner.require_backward_grad_sync = False
            return wrapped

        fabric_class.setup_module = setup_without_sync
    elif DEFECT == "rank1_out_of_memory":
        backward = fabric_class.backward
        calls = []

        def backward_failing_on_rank1(self, tensor, *args, **kwargs):
            if self.global_rank == 1:
                calls.append(tensor)
                if len(calls) == 3:
                    import torch

                    raise torch.OutOfMemoryError("simulated allocation failure in backward on rank 1")
            return backward(self, tensor, *args, **kwargs)

        fabric_class.backward = backward_failing_on_rank1
    else:
        raise SystemExit(f"MEMFIT_TEST_DEFECT={DEFECT!r} is not one this file plants")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "lightning.fabric.fabric":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                _plant(module)

        spec.loader = _Loader()
        return spec


if DEFECT:
    sys.meta_path.insert(0, _Finder())
