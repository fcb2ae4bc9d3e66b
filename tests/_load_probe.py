"""Run in a fresh process by test_loading: loads a checkpoint one way and reports anonymous-memory growth.

RssAnon (from /proc/self/status) counts private memory; pages of a memory-mapped file are reported as RssFile
and are reclaimable, so they are not counted. A thread samples RssAnon every 2 ms while loading.
"""

import json
import sys
import threading
import time
from pathlib import Path

import torch

from memfit.memory import proc_status


def main(mode: str, checkpoint_dir: Path) -> None:
    from litgpt.lora import GPT, Config

    from memfit.loading import load_model

    config = Config.from_file(checkpoint_dir / "model_config.yaml", lora_r=8, lora_query=True, lora_value=True)
    path = checkpoint_dir / "lit_model.pth"
    import bitsandbytes  # noqa: F401  (import cost is not loading cost)

    baseline = proc_status()["RssAnon"]
    peak = baseline
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc_status()["RssAnon"])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    if mode == "plain":  # the usual way: materialize the model, read the whole file into memory, copy it over
        with torch.device("cpu"):
            torch.set_default_dtype(torch.bfloat16)
            model = GPT(config)
        model.load_state_dict(torch.load(path, weights_only=True), strict=False)
    else:
        quantize = None if mode == "mmap" else "bnb.nf4"
        model = load_model(GPT, config, path, dtype=torch.bfloat16, device=torch.device("cpu"), quantize=quantize,
                           new_parameters=("lora_A", "lora_B"))
    done.set()
    sampler.join()
    peak = max(peak, proc_status()["RssAnon"])
    # the model is usable: one forward pass
    with torch.no_grad():
        model.max_seq_length = 16
        model(torch.randint(0, 100, (1, 16)))
    print(json.dumps({"added_peak": peak - baseline, "file_size": path.stat().st_size}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
