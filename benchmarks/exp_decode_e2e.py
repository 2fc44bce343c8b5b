"""Experiment: plain greedy decoding at batch 1, end to end, ms per output token, for named
shapes (random weights) -- run with different llmaccel trees on PYTHONPATH to compare commits
(a draft model's decode step got slower between two W5 runs: issue 6's c).

    PYTHONPATH=old_tree python benchmarks/exp_decode_e2e.py --models qwen2.5-0.5b,qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from exp_draft_step import e2e_ms_per_token  # noqa: E402

import llmaccel  # noqa: E402
from llmaccel import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    for name in args.models.split(","):
        llm = LLM(name, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False)
        ms = e2e_ms_per_token(llm, args.tokens, args.repeats)
        print(f"RESULT {args.label} {name} {ms:.4f} ms/token ({llmaccel.__file__})", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
