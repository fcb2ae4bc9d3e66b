# A stand-in for Hugging Face's `kernels` package, put on PYTHONPATH by a test. The real one downloads kernels from
# the Hugging Face Hub, and bitsandbytes calls its get_kernel at import on CPUs with AVX512-BF16; this one writes
# down each call (to the file named by MEMFIT_TEST_KERNEL_CALLS) instead of reaching the network.
import os


def get_kernel(repo_id, version=None):
    with open(os.environ["MEMFIT_TEST_KERNEL_CALLS"], "a") as calls:
        calls.write(f"{repo_id}\n")
    raise RuntimeError("this test has no network")
