"""Where the host time of speculative rounds goes: cProfile over one W5-like generate call
(greedy, EOS ignored) with speculation, after a warm-up. A diagnostic, not a benchmark of
record (cProfile inflates Python time; compare functions, not the wall).

    python benchmarks/profile_spec.py --target t.gguf --draft d.gguf --batch 4 --kind prose
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from spec_bench import _requests

from llmaccel import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None, help="a draft model (else n-gram lookup)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kind", default="prose")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    spec = ({"method": "draft", "model": args.draft} if args.draft else {"method": "ngram"})
    spec["num_speculative_tokens"] = args.k
    llm = LLM(args.target, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False,
              speculative_config=spec)
    prompts = _requests(llm.get_tokenizer(), args.kind, args.batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles, graphs, costs
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
