"""Experiment: GPU time of a plain engine's batch-1 decode graph (CUDA events around back-to-back
replays, one row attending over 300 tokens) for named shapes -- with different llmaccel trees on
PYTHONPATH, to tell a slower graph from slower host work (exp_decode_e2e.py times end to end).

    PYTHONPATH=old_tree python benchmarks/exp_graph_replay.py --models qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_step_cost import _time_graph  # noqa: E402

import llmaccel  # noqa: E402
from llmaccel import LLM  # noqa: E402


def one_row_replay_ms(runner, context: int = 300) -> float:
    """The best of 3 timings (200 replays each) of `runner`'s 1-row decode graph."""
    return min(_time_graph(runner, 1, context, 1, 1, 200)[0] for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-0.5b")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    for name in args.models.split(","):
        llm = LLM(name, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False)
        ms = one_row_replay_ms(llm.engine.runner)
        print(f"RESULT {args.label} {name} replay {ms:.4f} ms "
              f"({llmaccel.__file__})", flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
