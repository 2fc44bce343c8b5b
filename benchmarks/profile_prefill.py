"""Where an eager prefill step's time goes: wall per prefill-only generate call (max_tokens 1),
a torch.profiler table of host (CPU) time per op, and a cProfile of the model's forward. A
diagnostic for launch-bound prefill (a 1.5B model's ~100-token prefill took 16 ms on an H100
in 2026-11-23-W5-gaps-draft-h100.txt, where its GEMMs need ~1 ms).

    python benchmarks/profile_prefill.py --model qwen2.5-1.5b --tokens 120 --batches 1,4
    python benchmarks/profile_prefill.py --model llama-3.2-3b --dummy \
        --quantization gptq-int4-g128 --tokens 128 --batches 1    # W1's int4 prefill
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from llmaccel import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step_gaps import build_llm  # noqa: E402  (this folder)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--quantization", default=None, help="a preset (quant/presets.py)")
    ap.add_argument("--dummy", action="store_true", help="random weights of a shape name")
    args = ap.parse_args(argv)
    llm = build_llm(args.model, args.quantization, dummy=args.dummy, dtype=args.dtype)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [{"prompt_token_ids": torch.randint(100, 20000, (args.tokens,),
                                                      generator=gen).tolist()}
                   for _ in range(b)]
        for _ in range(3):
            llm.generate(prompts, params, use_tqdm=False)
        walls = []
        for _ in range(args.repeats):
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
        print(f"\n=== {args.model} prefill {b} x {args.tokens} tokens: "
              f"median {1000 * statistics.median(walls):.2f} ms, "
              f"min {1000 * min(walls):.2f} ms")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        if torch.cuda.is_available():
            print(prof.key_averages().table(sort_by="self_cuda_time_total",
                                            row_limit=args.top // 2))
        pr = cProfile.Profile()
        pr.enable()
        llm.generate(prompts, params, use_tqdm=False)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
