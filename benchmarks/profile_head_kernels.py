"""Where a draft head's GPU time goes, kernel by kernel (GPU only): the head's captured graphs
(its decode graph at the catch-up's row count, its chained graph of k - 1 steps) and the
target's verify graph, each replayed back to back under torch.profiler, kernels grouped by
name with their time per replay. A diagnostic for the round's cost (issue 7): what a round
spends beyond the target's verify, and which kernels of the head's one layer and LM head
are far from the memory roofline.

    python benchmarks/profile_head_kernels.py --target qwen2.5-1.5b --head random --k 4
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from llmaccel import LLM, SamplingParams  # noqa: E402
from llmaccel.engine.cuda_graph import replay_ms  # noqa: E402


def kernel_table(graph: torch.cuda.CUDAGraph, iters: int) -> list[tuple[str, int, float]]:
    """(kernel name, launches per replay, GPU us per replay) of `graph`, by total time."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    count: dict[str, int] = collections.Counter()
    total: dict[str, float] = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            count[ev.name] += 1
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") \
                else ev.cuda_time_total
    rows = [(name, count[name] // iters, total[name] / iters) for name in total]
    return sorted(rows, key=lambda r: -r[2])


def show(label: str, graph, iters: int, out: dict) -> None:
    ms = replay_ms(graph, iters)
    table = kernel_table(graph, iters)
    busy = sum(r[2] for r in table)
    print(f"\n== {label}: {ms * 1e3:.1f} us per replay (events), kernels {busy:.1f} us, "
          f"{sum(r[1] for r in table)} launches")
    print(f"{'us':>8s} {'n':>4s}  kernel")
    for name, n, us in table[:25]:
        print(f"{us:8.1f} {n:4d}  {name[:110]}")
    out[label] = {"replay_us": ms * 1e3, "kernels": [list(r) for r in table]}


def timeline(llm, ids: list[int], rounds: int, gap_us: float = 2.0) -> list:
    """The GPU's kernels of a traced generate call, split into rounds at the target's LM head
    (each round's longest kernel), each round as runs of kernels with under `gap_us` between
    them: (start offset us, busy us, kernels, first kernel, last kernel, idle after us)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        torch.cuda.synchronize()
    ks = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    longest = max(ks, key=lambda k: k[1] - k[0])[2]
    heads = [i for i, k in enumerate(ks) if k[2] == longest]
    result = []
    for r in range(min(rounds, len(heads) - 2)):
        a, b = heads[len(heads) // 2 + r], heads[len(heads) // 2 + r + 1]
        seg = ks[a:b + 1]
        t0, runs, cur = seg[0][0], [], [seg[0]]
        for k in seg[1:]:
            if k[0] - cur[-1][1] > gap_us:
                runs.append(cur)
                cur = []
            cur.append(k)
        runs.append(cur)
        print(f"\n-- round {r}: {seg[-1][0] - t0:.1f} us from LM head to LM head")
        rows = []
        for i, run in enumerate(runs):
            busy = sum(k[1] - k[0] for k in run)
            after = runs[i + 1][0][0] - run[-1][1] if i + 1 < len(runs) else 0.0
            rows.append((run[0][0] - t0, busy, len(run), run[0][2][:40], run[-1][2][:40],
                         after))
            print(f"{run[0][0] - t0:8.1f} {busy:7.1f} {len(run):4d}  {run[0][2][:40]:40s} .. "
                  f"{run[-1][2][:40]:40s} idle {after:6.1f}")
        result.append(rows)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-1.5b")
    ap.add_argument("--head", default="random")
    ap.add_argument("--random-head-vocab", type=int, default=32768)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeline", type=int, default=0,
                    help="also trace a generate call and print this many rounds' GPU "
                         "timelines (runs of kernels split at gaps)")
    args = ap.parse_args()
    if args.head == "random":
        from random_head import make_random_head

        args.head = make_random_head(args.target, "/tmp/llmaccel-random-head",
                                     args.random_head_vocab)
    spec = {"method": "head", "model": args.head, "num_speculative_tokens": args.k,
            "adaptive": False, "auto_disable": False}
    llm = LLM(args.target, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False,
              speculative_config=spec)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.hf_config.vocab_size
    ids = torch.randint(vocab, (300,), generator=gen).tolist()
    llm.generate([{"prompt_token_ids": ids}],
                 SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    head_graphs = engine.spec.draft.runner.graphs
    target_graphs = engine.runner.graphs
    rows = args.k + 1
    out: dict = {"device": torch.cuda.get_device_name(), "k": args.k}
    bs = min(s for s in head_graphs.sizes if s >= rows)
    show(f"head decode graph, {bs} rows (the overlapped catch-up: k + 1)",
         head_graphs.graphs[bs], args.iters, out)
    show("head decode graph, 1 row", head_graphs.graphs[min(head_graphs.sizes)], args.iters, out)
    steps = args.k - 1
    key = (min(head_graphs.chain_sizes), steps)
    if key in head_graphs.chain_graphs:
        show(f"head chained graph, {steps} steps, 1 row", head_graphs.chain_graphs[key],
             args.iters, out)
    tb = min(s for s in target_graphs.sizes if s >= rows)
    show(f"target graph, {tb} rows (verify)", target_graphs.graphs[tb], args.iters, out)
    show("target graph, 1 row (plain decode)", target_graphs.graphs[min(target_graphs.sizes)],
         args.iters, out)
    if args.timeline:
        out["timeline"] = timeline(llm, ids, args.timeline)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
