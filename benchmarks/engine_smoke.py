"""Smoke measurement of the engine as it stands (PyTorch reference attention, no CUDA graphs):
batch-1 decode and a 64-request batch on the llama-3.2-1b shape with dummy weights.

Not a speed claim (no baseline in the run): a starting point that the GPU-kernel work measures
itself against. Writes JSON lines in the BENCHMARKS.md format to $OUT (or ./) and prints a table.

    python benchmarks/engine_smoke.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from llmaccel import LLM, SamplingParams

MODEL = "llama-3.2-1b"


def _commit() -> str:
    """The measured commit: $LLMACCEL_COMMIT (copies without .git), else git's HEAD."""
    if os.environ.get("LLMACCEL_COMMIT"):
        return os.environ["LLMACCEL_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def main(out_dir: str) -> None:
    llm = LLM(MODEL, dtype="bfloat16", max_model_len=2048)
    rng = random.Random(0)
    records = []
    base = {"model": MODEL, "load_format": "dummy", "backend": "llmaccel",
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": _commit(), "command": "python benchmarks/engine_smoke.py"}
    for workload, n, out_len in [("W1-smoke", 1, 64), ("W2-smoke", 64, 128)]:
        prompts = [[rng.randrange(128000) for _ in range(rng.randint(100, 1024) if n > 1 else 128)]
                   for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        llm.generate([[1] * 32], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs)
                         / (time.perf_counter() - start))
        config = {"requests": n, "output_len": out_len, "attention_backend": "torch",
                  "cuda_graphs": False, "repeats": rates}
        records.append({"workload": workload, **base, "config": config,
                        "metric": "tok_s" if n == 1 else "out_tok_s",
                        "value": round(statistics.median(rates), 1)})
    records.append({"workload": "memory", **base, "config": {"max_model_len": 2048},
                    "metric": "peak_mem_gib",
                    "value": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
    path = os.path.join(out_dir, f"engine-smoke-{MODEL}.jsonl")
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"{'workload':<10} {'metric':<14} {'value':>10}")
    for r in records:
        print(f"{r['workload']:<10} {r['metric']:<14} {r['value']:>10}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
