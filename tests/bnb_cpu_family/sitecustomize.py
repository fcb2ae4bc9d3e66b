# Put this directory on PYTHONPATH with MEMFIT_TEST_AVX512BF16 set to run bitsandbytes as on the other CPU family:
# 0, as on a CPU without AVX512-BF16; 1, as on one with it. has_avx512bf16() answers so from the moment
# bitsandbytes.functional is imported, before its CPU backend chooses which kernels to register. The suite runs on
# either family as it finds it; `MEMFIT_TEST_AVX512BF16=1 PYTHONPATH=tests/bnb_cpu_family pytest` runs it on the
# other (docs/tests.md).
import importlib.abc
import importlib.machinery
import os
import sys

FORCED = os.environ.get("MEMFIT_TEST_AVX512BF16")


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
                module.has_avx512bf16 = lambda: FORCED == "1"

        spec.loader = _Loader()
        return spec


if FORCED not in ("0", "1"):
    raise SystemExit(f"MEMFIT_TEST_AVX512BF16={FORCED!r}: set it to 0 (no AVX512-BF16) or 1 (AVX512-BF16)")
sys.meta_path.insert(0, _Finder())
