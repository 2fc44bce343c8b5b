"""Which kernels a decode step of R rows spends its GPU time in (torch profiler, eager forward
plus logits), for a few R: the diagnostic behind the step-cost curve's jumps. Not a benchmark
of record.

    python benchmarks/profile_rows.py --shape qwen2.5-1.5b --rows 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from llmaccel import LLM
from llmaccel.models.attention import AttentionMetadata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(args.shape, load_format="dummy", dtype="bfloat16", max_model_len=1024,
              skip_tokenizer_init=True, enforce_eager=True, num_gpu_blocks=256)
    model = llm.engine.model
    for rows in (int(r) for r in args.rows.split(",")):
        meta = AttentionMetadata.build([1] * rows, [64] * rows, "cuda",
                                       list(range(64 * 16, 64 * 16 + rows)),
                                       [[i % 200 + 1 for i in range(4)]] * rows)
        ids = torch.randint(0, 1000, (rows,), device="cuda")
        pos = torch.full((rows,), 63, device="cuda")
        with torch.inference_mode():
            for _ in range(3):
                model.compute_logits(model(ids, pos, meta))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    model.compute_logits(model(ids, pos, meta))
                torch.cuda.synchronize()
        by_name: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                by_name[ev.name[:90]] += ev.device_time / 5 / 1000
        total = sum(by_name.values())
        print(f"\n== {args.shape} rows={rows}: {total:.3f} ms GPU per step")
        for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {ms:8.3f} ms  {name}")


if __name__ == "__main__":
    main()
