"""Diagnostic: where a W1 prefill's time goes (llama-3.2-3b shape, dummy weights, 128-token
prompt, one new token) under the torch profiler: the GPU span of each prefill, the summed busy
time, and the kernels by total time.

    python benchmarks/profile_prefill.py [--quantization gptq-int4-g128] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step_gaps import build_llm  # noqa: E402  (this folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    from llmaccel import SamplingParams

    llm = build_llm(args.shape, args.quantization)
    prompt = {"prompt_token_ids": [(7 * j) % 900 + 10 for j in range(128)]}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(2):
        llm.generate(prompt, params)  # warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.runs):
            llm.generate(prompt, params)
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    span = evs[-1].time_range.end - evs[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in evs)
    by = defaultdict(lambda: [0.0, 0])
    for e in evs:
        by[e.name[:80]][0] += e.time_range.end - e.time_range.start
        by[e.name[:80]][1] += 1
    print(f"{args.quantization or 'bf16'}: {args.runs} prefills, GPU span {span / args.runs:.0f} "
          f"us each (incl. gaps between runs), busy {busy / args.runs:.0f} us each, "
          f"{len(evs) // args.runs} GPU ops each")
    print("| kernel | us per prefill | calls per prefill | us per call |")
    print("|---|---|---|---|")
    for name, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {name} | {t / args.runs:.1f} | {n / args.runs:.0f} | {t / n:.2f} |")


if __name__ == "__main__":
    main()
