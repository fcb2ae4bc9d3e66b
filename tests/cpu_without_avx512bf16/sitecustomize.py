# Put this directory on PYTHONPATH to run bitsandbytes as on a CPU without AVX512-BF16: has_avx512bf16() returns
# False from the moment bitsandbytes.functional is imported, before its CPU backend chooses which kernels to register.
import importlib.abc
import importlib.machinery
import sys


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.functional":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                module.has_avx512bf16 = lambda: False

        spec.loader = _Loader()
        return spec


sys.meta_path.insert(0, _Finder())
