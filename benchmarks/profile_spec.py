"""Where the host time of speculative rounds goes: cProfile over one W5-like generate call
(greedy, EOS ignored) with speculation, after a warm-up. A diagnostic, not a benchmark of
record (cProfile inflates Python time; compare functions, not the wall). `--gaps` measures instead
where the GPU waits for the host (CUDA events around each forward pass; GPU only).

    python benchmarks/profile_spec.py --target t.gguf --draft d.gguf --batches 4 --kinds prose
    python benchmarks/profile_spec.py --target qwen2.5-0.5b --draft qwen2.5-0.5b --gaps
    python benchmarks/profile_spec.py --target qwen2.5-1.5b --head HEAD --gaps --fixed-k \
        --chain on,off
    python benchmarks/profile_spec.py --target qwen2.5-1.5b --head random --gaps --fixed-k \
        --batches 1 --draft-topk 1,3 --greedy-draft off,on

(A shape name loads random weights with the engine's seed, so a shape drafting for itself
accepts nearly everything: host overhead of full-length rounds without staging real models.)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_bench import _requests

from llmaccel import LLM, SamplingParams


def _phase_wrappers():
    """(class, method, label) of the engine phases a speculative round goes through."""
    from llmaccel.engine.llm_engine import LLMEngine
    from llmaccel.engine.scheduler import Scheduler
    from llmaccel.engine.speculative import SpecDecoder
    from llmaccel.spec.draft_model import DraftModelProposer

    return [(SpecDecoder, "propose", "propose"),
            (SpecDecoder, "overlap", "overlap (next round's drafts)"),
            (DraftModelProposer, "propose", "propose/draft"),
            (Scheduler, "schedule", "schedule"),
            (LLMEngine, "_launch", "launch"),
            (LLMEngine, "_process_outputs", "process_outputs"),
            (LLMEngine, "_complete", "complete"),
            (SpecDecoder, "verify", "complete/verify")]


def gaps(llm, prompts, params) -> None:
    """Where the GPU waits for the host: CUDA events around every forward pass the engine
    launches (target and draft: ModelRunner.execute) give each pass's GPU time and the idle
    time before it (from the end of the previous pass to its start, on the GPU's clock),
    grouped by kind of pass; plus the host's wall time per engine phase (perf_counter). The
    events cost a few microseconds each, unlike a profiler's per-op tracing."""
    import collections
    import functools

    import torch

    from llmaccel.engine.model_runner import DECODE_ROWS_MAX, ModelRunner

    engine = llm.engine
    draft_runner = (engine.spec.draft.runner
                    if engine.spec is not None and engine.spec.draft is not None else None)
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    totals: dict[str, float] = collections.Counter()
    originals = [(ModelRunner, "execute", ModelRunner.execute)]

    def execute(self, step, *a, __fn=ModelRunner.execute, **kw):
        rows = step.num_tokens
        kind = "draft" if self is draft_runner else "target"
        n = len(step.scheduled)
        few = "catch-up" if kind == "draft" else "verify"
        shape = "decode" if rows == n else few if rows <= DECODE_ROWS_MAX * n else "prefill"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = __fn(self, step, *a, **kw)
        end.record()
        marks.append((f"{kind} {shape}", start, end))
        return out

    def execute_chain(self, seqs, counts, first_ids, steps, *a,
                      __fn=ModelRunner.execute_chain, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = __fn(self, seqs, counts, first_ids, steps, *a, **kw)
        end.record()
        marks.append((f"draft chain x{steps}", start, end))
        return out

    def execute_on_device(self, *a, __fn=ModelRunner.execute_on_device, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = __fn(self, *a, **kw)
        end.record()
        marks.append(("draft catch-up (overlapped)", start, end))
        return out

    def execute_prepared(self, *a, __fn=ModelRunner.execute_prepared, **kw):
        # the fused catch-up (HeadProposer.fused_catch_up): its input kernel and graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = __fn(self, *a, **kw)
        end.record()
        marks.append(("draft catch-up (fused)", start, end))
        return out

    originals.append((ModelRunner, "execute_chain", ModelRunner.execute_chain))
    originals.append((ModelRunner, "execute_on_device", ModelRunner.execute_on_device))
    originals.append((ModelRunner, "execute_prepared", ModelRunner.execute_prepared))
    ModelRunner.execute = execute
    ModelRunner.execute_chain = execute_chain
    ModelRunner.execute_on_device = execute_on_device
    ModelRunner.execute_prepared = execute_prepared
    for cls, name, label in _phase_wrappers():
        fn = getattr(cls, name)
        originals.append((cls, name, fn))

        def wrapped(*a, __fn=fn, __label=label, **kw):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **kw)
            finally:
                totals[__label] += time.perf_counter() - t0
        setattr(cls, name, functools.wraps(fn)(wrapped))
    overlapped = 0 if engine.spec is None else engine.spec.num_overlapped
    try:
        before = llm.get_stats().spec_decode
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        after = llm.get_stats().spec_decode
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    busy: dict[str, list[float]] = collections.defaultdict(list)
    idle: dict[str, list[float]] = collections.defaultdict(list)
    for i, (label, s, e) in enumerate(marks):
        busy[label].append(s.elapsed_time(e))
        if i:
            idle[label].append(max(0.0, marks[i - 1][2].elapsed_time(s)))
    total_busy = sum(map(sum, busy.values()))
    total_idle = sum(map(sum, idle.values()))
    span = marks[0][1].elapsed_time(marks[-1][2]) if marks else 0.0
    steps = after["num_steps"] - before["num_steps"]
    off = after["num_off_steps"] - before["num_off_steps"]
    print(f"\ngaps: wall {wall * 1e3:.1f} ms; GPU from first to last pass {span:.1f} ms: "
          f"busy {total_busy:.1f} ms, idle between passes {total_idle:.1f} ms; "
          f"{steps} request-steps with drafts, {off} off, "
          f"{0 if engine.spec is None else engine.spec.num_overlapped - overlapped} engine "
          "rounds overlapped")
    print(f"{'pass':20s} {'count':>6s} {'GPU ms (mean)':>14s} {'idle before (mean)':>19s} "
          f"{'idle total ms':>14s}")
    for label in sorted(busy, key=lambda k: -sum(idle[k])):
        b, w = busy[label], idle[label]
        print(f"{label:20s} {len(b):6d} {sum(b) / len(b):14.3f} "
              f"{(sum(w) / len(w) if w else 0.0):19.3f} {sum(w):14.2f}")
    print("host wall per phase (all calls, inclusive):")
    for name, sec in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {sec * 1e3:8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None, help="a draft model (else n-gram lookup)")
    ap.add_argument("--head", default=None, help="a draft head directory (method 'head')")
    ap.add_argument("--fixed-k", action="store_true",
                    help="draft k tokens every round: adaptive k and the off switch off (what "
                         "a round costs, whatever the acceptance)")
    ap.add_argument("--chain", default="on",
                    help="comma-separated on,off: chained draft steps (LLMACCEL_DRAFT_CHAIN)")
    ap.add_argument("--overlap", default="on",
                    help="comma-separated on,off: overlapped drafting (LLMACCEL_DRAFT_OVERLAP)")
    ap.add_argument("--draft-topk", default="1",
                    help="comma-separated: SpeculativeConfig.draft_topk (tree drafts, head)")
    ap.add_argument("--greedy-draft", default="on",
                    help="comma-separated on,off: chained steps pick tokens with the model's "
                         "greedy_draft (on) or over the whole vocabulary's logits "
                         "(LLMACCEL_GREEDY_DRAFT=0)")
    ap.add_argument("--random-head-vocab", type=int, default=32768,
                    help="--head random: a random head for the target shape (benchmarks/"
                         "random_head.py) with a draft vocabulary of this many ids (0: none)")
    ap.add_argument("--batches", default="4", help="comma-separated batch sizes")
    ap.add_argument("--kinds", default="prose", help="comma-separated: code, prose")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gaps", action="store_true",
                    help="instead of cProfile: GPU time and idle time per forward pass (CUDA "
                         "events) and host time per engine phase")
    args = ap.parse_args()
    if args.head == "random":
        from random_head import make_random_head

        args.head = make_random_head(args.target, "/tmp/llmaccel-random-head",
                                     args.random_head_vocab)
    spec = ({"method": "draft", "model": args.draft} if args.draft else
            {"method": "head", "model": args.head} if args.head else {"method": "ngram"})
    spec["num_speculative_tokens"] = args.k
    if args.fixed_k:
        spec.update(adaptive=False, auto_disable=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = [(chain, pick, topk) for chain in args.chain.split(",")
               for pick in args.greedy_draft.split(",")
               for topk in map(int, args.draft_topk.split(","))]
    for chain, pick, topk in engines:
        os.environ["LLMACCEL_DRAFT_CHAIN"] = "1" if chain == "on" else "0"
        os.environ["LLMACCEL_GREEDY_DRAFT"] = "1" if pick == "on" else "0"
        spec["draft_topk"] = topk
        llm = LLM(args.target, dtype="bfloat16", max_model_len=2048,
                  enable_prefix_caching=False, speculative_config=spec)
        for overlap in args.overlap.split(","):
            os.environ["LLMACCEL_DRAFT_OVERLAP"] = "1" if overlap == "on" else "0"
            for kind in args.kinds.split(","):
                for batch in map(int, args.batches.split(",")):
                    print(f"\n=== {spec['method']}, chain {chain}, greedy_draft {pick}, "
                          f"topk {topk}, overlap {overlap}, {kind} prompts, batch {batch}")
                    profile_one(llm, _prompts(llm, kind, batch), params, args)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _prompts(llm, kind: str, batch: int) -> list:
    if llm.get_tokenizer() is not None:
        return _requests(llm.get_tokenizer(), kind, batch)
    # a shape (random weights, no tokenizer): the same random prompt ids
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.hf_config.vocab_size
    ids = torch.randint(vocab, (200,), generator=gen).tolist()
    return [{"prompt_token_ids": ids} for _ in range(batch)]


def profile_one(llm, prompts, params, args) -> None:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, graphs, costs
    if args.gaps:
        gaps(llm, prompts, params)
        return
    before = llm.get_stats().spec_decode
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - start
    after = llm.get_stats().spec_decode
    steps = after["num_steps"] - before["num_steps"]
    off = after["num_off_steps"] - before["num_off_steps"]
    print(f"wall {wall:.3f} s under cProfile; {steps} request-steps with drafts, {off} off")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
