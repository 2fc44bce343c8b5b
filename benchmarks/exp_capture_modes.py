"""Experiment (issue 6): why the same model's batch-1 decode graph runs at different speeds
depending on how and where it was captured. On an H100, a 0.5B model's graph took 0.902 ms
captured on one stream per runner and 0.994 ms with a new stream per graph; the speculative
engine's draft runner took 1.007 ms either way
(benchmarks/results/2026-11-26-draft-decode-capture-stream-h100.md).

For each case this times the 1-row decode graph (CUDA events, one row over `--context`
tokens) and lists the kernels one replay runs, from torch.profiler, so a slower graph shows
which kernels differ (e.g. other cuBLAS GEMMs):

- plain-same: a plain engine, graphs captured on one stream per runner
  (LLMACCEL_CAPTURE_STREAM=runner);
- plain-each: a plain engine, a new stream per graph (LLMACCEL_CAPTURE_STREAM=each);
- plain-chains: a plain engine, then chained-decode graphs (k - 1 = 3 steps, up to 64 rows)
  captured into its pool as a draft's runner does, the 1-row graph timed again;
- spec-draft: the draft runner of a speculative engine (target `--target`), each runner
  with its own capture stream;
- spec-draft-nochain: the same without chained graphs (LLMACCEL_DRAFT_CHAIN=0);
- spec-draft-process: the same, one capture stream for every runner of the process
  (LLMACCEL_CAPTURE_STREAM=process, the default since this experiment);
- plain-target, spec-target, spec-target-process: the target's own 1-row graph, in a plain
  engine and in the speculative engine with either capture mode.

Run each case in its own process (`--cases one --top 0`) to compare replay times: with one
stream per runner, a second engine in the same process measured slower, so cases run one
after another in a process are not comparable
(benchmarks/results/2026-11-26-capture-modes-h100.md).

    python benchmarks/exp_capture_modes.py --model qwen2.5-0.5b --target qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from exp_graph_replay import one_row_replay_ms  # noqa: E402

from llmaccel import LLM  # noqa: E402


def _kernels(graph: torch.cuda.CUDAGraph, replays: int = 10) -> list[tuple[str, int, float]]:
    """(kernel name, launches per replay, us per replay) of one graph, most time first."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    rows = [(name, round(n / replays), us / replays) for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def _report(label: str, runner, context: int, top: int) -> None:
    ms = one_row_replay_ms(runner, context)
    print(f"\n== {label}: 1-row decode graph {ms:.4f} ms per replay")
    if top <= 0:
        return
    for name, n, us in _kernels(runner.graphs.graphs[1])[:top]:
        print(f"  {us:9.1f} us  x{n:<4d} {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--target", default="qwen2.5-1.5b")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--top", type=int, default=15,
                    help="kernels listed per case; 0 lists none and never starts the profiler")
    ap.add_argument("--cases", default="plain-same,plain-each,plain-chains,spec-draft,"
                                       "spec-draft-nochain,spec-draft-process")
    ap.add_argument("--capture-stream", choices=["process", "runner", "each"],
                    help="capture mode for every case (default: each case's own)")
    args = ap.parse_args()
    kw = {"dtype": "bfloat16", "max_model_len": 2048, "enable_prefix_caching": False}
    for case in args.cases.split(","):
        os.environ["LLMACCEL_CAPTURE_STREAM"] = args.capture_stream or (
            "each" if case == "plain-each" else
            "process" if case.endswith("-process") else "runner")
        if case == "plain-target":
            llm = LLM(args.target, **kw)
            runner = llm.engine.runner
        elif case.startswith("plain"):
            llm = LLM(args.model, **kw)
            runner = llm.engine.runner
            if case == "plain-chains":
                _report("plain-chains, before the chains", runner, args.context, args.top)
                runner.graphs.capture_chains(3, 64)
        else:
            os.environ["LLMACCEL_DRAFT_CHAIN"] = "0" if case == "spec-draft-nochain" else "1"
            llm = LLM(args.target, speculative_config={
                "method": "draft", "model": args.model, "num_speculative_tokens": 4}, **kw)
            runner = (llm.engine.runner if case.startswith("spec-target") else
                      llm.engine.spec.draft.runner)
        _report(case, runner, args.context, args.top)
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
