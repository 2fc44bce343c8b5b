"""Experiment (issue 6): why a draft model's steps inside a speculative round cost more GPU time
than its decode steps alone. Times captured graphs with CUDA events, on named shapes (random
weights), batch 1, every row attending over `--context` tokens:

- the draft alone (a plain engine): its decode graph, back to back;
- the speculative engine's draft: its decode graph (1 and 2 rows: the catch-up) and its
  chained graph of k - 1 steps, per step;
- the target: decode (1 row) and verify (k + 1 rows);
- a round as the engine replays it (catch-up, chain, verify), each graph timed in the
  sequence: whether a draft step after the target's verify costs more than back to back;
- end to end: plain greedy decoding of each model alone, ms per output token.

    python benchmarks/exp_draft_step.py --target qwen2.5-1.5b --draft qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_step_cost import _time_graph  # noqa: E402

from llmaccel import LLM, SamplingParams  # noqa: E402
from llmaccel.engine.cuda_graph import replay_ms  # noqa: E402


def _stage_chain(runner, context: int, steps: int) -> torch.cuda.CUDAGraph:
    """One row chaining `steps` steps from position `context`, over its own blocks."""
    graphs = runner.graphs
    bs = runner.block_size
    table = list(range(-(-(context + steps + 1) // bs)))
    graphs.run_chain([context], [steps], [table],
                     torch.tensor([1000.0], dtype=torch.float64, device="cuda"), steps)
    return graphs.chain_graphs[graphs.chain_sizes[0], steps]


def e2e_ms_per_token(llm, tokens: int, repeats: int = 3) -> float:
    """Plain greedy decoding of one 300-token random prompt: the median wall of `repeats`
    runs after a warm-up, ms per output token."""
    ids = torch.randint(1000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    walls = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    return sorted(walls)[len(walls) // 2] * 1e3 / tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-1.5b")
    ap.add_argument("--draft", default="qwen2.5-0.5b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    kw = {"dtype": "bfloat16", "max_model_len": 2048, "enable_prefix_caching": False}
    rows = []
    alone = LLM(args.draft, **kw)
    r = alone.engine.runner
    rows.append(("draft alone: decode graph, 1 row", _time_graph(r, 1, args.context, 1, 1,
                                                                 args.iters)[0]))
    rows.append(("draft alone: e2e ms per token", e2e_ms_per_token(alone, 128)))
    del alone, r
    gc.collect()
    torch.cuda.empty_cache()
    target_alone = LLM(args.target, **kw)
    rows.append(("target alone: e2e ms per token", e2e_ms_per_token(target_alone, 128)))
    del target_alone
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(args.target, speculative_config={
        "method": "draft", "model": args.draft, "num_speculative_tokens": args.k,
        "adaptive": False, "auto_disable": False}, **kw)
    target, draft = llm.engine.runner, llm.engine.spec.draft.runner
    steps = args.k - 1
    d1 = _time_graph(draft, 1, args.context, 1, 1, args.iters)[0]
    d2 = _time_graph(draft, 2, args.context, 1, 2, args.iters)[0]
    chain = _stage_chain(draft, args.context, steps)
    dc = replay_ms(chain, args.iters, warmup=5) / steps
    t1 = _time_graph(target, 1, args.context, 1, 1, args.iters)[0]
    tv, padded = _time_graph(target, args.k + 1, args.context, 1, args.k + 1, args.iters)
    rows += [("spec draft: decode graph, 1 row", d1), ("spec draft: decode graph, 2 rows", d2),
             (f"spec draft: chain x{steps}, per step", dc), ("target: decode, 1 row", t1),
             (f"target: verify, {args.k + 1} rows (graph {padded})", tv)]
    # a round in sequence: catch-up (2 rows), chain, verify, each timed by events
    g_catch = draft.graphs.graphs[2]
    g_verify = target.graphs.graphs[padded]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    sums = [0.0, 0.0, 0.0]
    n = args.iters // 4
    for i in range(n + 3):
        ev[0].record()
        g_catch.replay()
        ev[1].record()
        chain.replay()
        ev[2].record()
        g_verify.replay()
        ev[3].record()
        ev[3].synchronize()
        if i >= 3:
            for j in range(3):
                sums[j] += ev[j].elapsed_time(ev[j + 1])
    rows += [("round in sequence: catch-up (2 rows)", sums[0] / n),
             (f"round in sequence: chain x{steps}, per step", sums[1] / n / steps),
             ("round in sequence: verify", sums[2] / n)]
    print(f"\n{args.draft} drafting for {args.target}, batch 1, context {args.context}, "
          f"k {args.k}, {torch.cuda.get_device_name()}")
    for name, ms in rows:
        print(f"  {name:48s} {ms:8.4f} ms")


if __name__ == "__main__":
    main()
