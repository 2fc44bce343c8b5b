"""Where a batch-1 decode step spends its time: graph replay alone (GPU) against each host
phase of LLMEngine.step. A diagnostic, not a benchmark of record.

    python benchmarks/profile_decode.py --shape llama-3.2-1b [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmaccel import LLM, SamplingParams
from llmaccel.engine.cuda_graph import replay_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kernels", action="store_true", help="print a per-kernel GPU profile")
    ap.add_argument("--quantization", default=None,
                    help="a llmaccel.quant.presets name (random codes), e.g. rtn-int4-g128, fp8")
    ap.add_argument("--rows", type=int, default=30, help="rows of the --kernels table")
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                    help="wait for each step's tokens before launching the next (the engine's "
                         "default launches each step before the previous one's tokens arrive)")
    args = ap.parse_args()
    extra = {}
    if args.quantization:
        from llmaccel.quant.presets import preset_config
        extra["hf_overrides"] = {"quantization_config": preset_config(args.quantization)}
    llm = LLM(args.shape, load_format="dummy", dtype="bfloat16", max_model_len=2048, **extra,
              skip_tokenizer_init=True, enable_prefix_caching=False,
              cudagraph_capture_sizes=[args.batch],  # the one graph profiled: quick start
              async_scheduling=args.async_scheduling)
    eng = llm.engine
    runner = eng.runner
    # GPU time of one replay, back to back.
    bs = args.batch
    g = runner.graphs.graphs[runner.graphs.sizes[0] if bs == 1 else bs]
    graph_ms = replay_ms(g, 100, warmup=10)
    # Host phases of real steps.
    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "execute", "sample", "rest",
                                                      "step")}
    prompts = [[100 + i + j for j in range(128)] for i in range(bs)]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=args.steps + 2,
                                                  ignore_eos=True))
    eng.step()  # prefill
    orig_schedule, orig_execute = eng.scheduler.schedule, runner.execute
    orig_sample = eng._sample
    marks: dict[str, float] = {}

    def schedule():
        t = time.perf_counter()
        out = orig_schedule()
        marks["schedule"] = time.perf_counter() - t
        return out

    def execute(step, *args):
        t = time.perf_counter()
        out = orig_execute(step, *args)
        marks["execute"] = time.perf_counter() - t
        return out

    def sample(*a, **k):
        t = time.perf_counter()
        out = orig_sample(*a, **k)
        marks["sample"] = time.perf_counter() - t
        return out

    eng.scheduler.schedule, runner.execute, eng._sample = schedule, execute, sample
    for _ in range(args.steps):
        t = time.perf_counter()
        eng.step()
        total = time.perf_counter() - t
        phases["step"].append(total)
        # a phase the step did not enter (async scheduling overlaps some) counts as 0
        for k in ("schedule", "execute", "sample"):
            phases[k].append(marks.pop(k, 0.0))
        phases["rest"].append(total - sum(phases[k][-1] for k in ("schedule", "execute",
                                                                   "sample")))
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        print(avg.table(sort_by="cuda_time_total", row_limit=args.rows,
                        max_name_column_width=90))
        # kernels per replay: how many launches a step is cut into (each costs latency)
        launches = sum(e.count for e in avg if e.device_type.name == "CUDA") / 20
        print(f"kernel launches per step: {launches:.0f}")
    print(f"graph replay (GPU, back to back): {graph_ms * 1e3:.0f} us")
    for k, v in phases.items():
        print(f"{k:>9}: median {statistics.median(v) * 1e6:7.0f} us")
    print(f"=> {1 / statistics.median(phases['step']):.0f} steps/s; replay-only bound "
          f"{1e3 / graph_ms:.0f} steps/s")


if __name__ == "__main__":
    main()
