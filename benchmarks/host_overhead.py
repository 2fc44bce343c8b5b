"""The engine's host time per generated token, with the model taken out: what bounds a
large-batch run (self-distillation text at 256 sequences) when the GPU step is short.

The model's forward, its LM head and the greedy pick are replaced by stubs that cost
nothing: the pick returns the next token of a fixed text (so detokenization works on real
text), EOS never comes. What is left is the engine's own work per step: scheduling, the block
manager, the runner's input lists and attention metadata, sampling's bookkeeping, the stop
checks, detokenization and the outputs. Each of those is timed (perf_counter around the
method), and the whole run's wall time is divided by the tokens generated.

    python benchmarks/host_overhead.py --requests 1024 --max-tokens 128 --max-num-seqs 256

Runs on the CPU (the stubs make the device irrelevant); the model is the SmolLM2-135M GGUF
(../shared/models/fetch) with dummy weights, for its tokenizer and config only. Not a GPU
number: on a GPU the same host work overlaps the device's step where it can.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

TEXT = ("def merge_intervals(intervals):\n    \"\"\"Merge overlapping [start, end] intervals."
        "\"\"\"\n    if not intervals:\n        return []\n    merged = [list(intervals[0])]\n"
        "    for start, end in intervals[1:]:\n        if start <= merged[-1][1]:\n"
        "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n"
        "            merged.append([start, end])\n    return merged\n\nThe function sorts "
        "nothing itself: it expects its input sorted by start, and — naïvely — walks it once. ")


def _default_model() -> str:
    out = subprocess.run([str(Path(__file__).resolve().parents[2] / "shared/models/fetch"),
                          "smollm2-135m-instruct"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


class _Timers:
    """perf_counter totals of wrapped methods (nested calls count in both)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t
                self.calls[label] += 1

        setattr(obj, name, timed)


def stub_model(llm, token_stream: list[int], graph_path: bool = False,
               graph_sizes: list[int] | None = None) -> None:
    """The runner's model costs nothing and the greedy pick walks `token_stream`.
    `graph_path`: decode steps go through the CUDA-graph runner's host code (its numpy
    staging, tables, static buffers), run eagerly as on a CPU test, as a GPU engine's do;
    `graph_sizes`: its "captured" row counts (default: a GPU engine's for max_num_seqs)."""
    import llmaccel.engine.cuda_graph as cuda_graph
    import llmaccel.engine.llm_engine as llm_engine

    runner = llm.engine.runner
    model = runner.model
    state = {"i": 0}

    class _Stub(torch.nn.Module):
        def forward(self, ids, positions, meta):
            return torch.zeros(ids.shape[0], 1)

        def compute_logits(self, hidden):
            return hidden

        def __getattr__(self, name):  # anything else the runner asks of the model
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(model, name)

    runner.model = _Stub()

    def greedy(logits, use_kernel=False):
        n = logits.shape[0]
        i = state["i"]
        state["i"] += 1
        tok = token_stream[i % len(token_stream)]
        return torch.tensor([[float(tok)] * n, [-0.5] * n], dtype=torch.float64)

    llm_engine.greedy_with_logprobs = greedy
    cuda_graph.greedy_with_logprobs = greedy
    if graph_path:
        cfg = llm.engine.config
        sizes = graph_sizes or cuda_graph.default_capture_sizes(max(cfg.max_num_seqs, 512))
        width = -(-llm.engine.max_model_len // runner.block_size)
        runner.graphs = cuda_graph.CUDAGraphRunner(runner.model, sizes, width,
                                                   torch.device("cpu"), runner.block_size,
                                                   runner.tree_rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF (fetched)")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=12.0,
                    help="the CPU KV pool (room for every running sequence)")
    ap.add_argument("--stop", default=None, help="a stop string every request carries")
    ap.add_argument("--graph-path", action="store_true",
                    help="decode steps through the CUDA-graph runner's host code (as on a GPU)")
    ap.add_argument("--label", default="")
    ap.add_argument("--profile", default=None, help="cProfile the timed run into this file")
    ap.add_argument("--out", default=None, help="a JSON-lines file to append the record to")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    from llmaccel import LLM, SamplingParams
    from llmaccel.bench.results import append_jsonl, current_commit

    llm = LLM(args.model or _default_model(), load_format="dummy", dtype="float32",
              device="cpu", max_model_len=2048, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False, cpu_kv_cache_gib=args.kv_gib)
    tok = llm.get_tokenizer()
    stream = tok.encode(TEXT, add_special_tokens=False)
    stub_model(llm, stream, args.graph_path)
    timers = _Timers()
    engine = llm.engine
    timers.wrap(engine.scheduler, "schedule", "scheduler.schedule")
    timers.wrap(engine.runner, "execute", "runner.execute (inputs, metadata)")
    timers.wrap(engine, "_complete", "engine._complete (sample, token checks)")
    timers.wrap(engine, "_process_outputs", "engine._process_outputs (text, outputs)")
    timers.wrap(engine.stop_checker, "update_text", "stop_checker.update_text")
    timers.wrap(engine, "step", "engine.step")
    prompt = (stream * (args.prompt_tokens // len(stream) + 1))[:args.prompt_tokens]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            stop=[args.stop] if args.stop else None)
    # a warm-up (first-call costs), then the timed run
    llm.generate([{"prompt_token_ids": prompt}] * 8, params, use_tqdm=False)
    timers.seconds.clear()
    timers.calls.clear()
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": prompt}] * args.requests, params, use_tqdm=False)
    wall = time.perf_counter() - t
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    want = tok.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    steps = timers.calls["engine.step"]
    record = {
        "name": "host-overhead", "label": args.label, "commit": current_commit(),
        "device": "cpu (model stubbed)", "torch": torch.__version__,
        "config": {"requests": args.requests, "prompt_tokens": args.prompt_tokens,
                   "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
                   "stop": args.stop, "graph_path": args.graph_path},
        "metrics": {"wall_s": round(wall, 3), "generated_tokens": generated,
                    "steps": steps,
                    "host_us_per_token": round(wall / generated * 1e6, 2),
                    "host_ms_per_step": round(wall / max(steps, 1) * 1e3, 3),
                    **{f"ms_per_step.{k}": round(v / max(steps, 1) * 1e3, 3)
                       for k, v in timers.seconds.items()}},
        "text_matches_decode": outs[0].outputs[0].text == want,
    }
    print(f"{'phase':44s} {'ms/step':>9s}")
    for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        print(f"{k:44s} {v / max(steps, 1) * 1e3:9.3f}")
    print(f"{generated} tokens in {steps} steps, {wall:.2f} s: "
          f"{record['metrics']['host_us_per_token']} us/token, "
          f"{record['metrics']['host_ms_per_step']} ms/step; text == decode: "
          f"{record['text_matches_decode']}")
    if args.out:
        append_jsonl(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
