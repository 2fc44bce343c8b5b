"""The CUDA-graph runner's code path on the CPU: what tests of chained and overlapped drafting
run (cuda_graph.py runs a graph's step eagerly where nothing was captured)."""

from __future__ import annotations

import torch

from llmaccel.engine.cuda_graph import CUDAGraphRunner
from llmaccel.engine.model_runner import ModelRunner

SIZES = [1, 2, 4, 8, 16, 32, 64]
WIDTH = 64  # block-table entries per row: more than any test sequence needs


def graphs_on_cpu(runner: ModelRunner, chain_steps: int, width: int = WIDTH
                  ) -> CUDAGraphRunner:
    """Give a CPU runner the graph runner's code path (static buffers, padding, chains),
    run eagerly: what a GPU runner replays. `width`: block-table entries per row."""
    graphs = CUDAGraphRunner(runner.model, SIZES, width, torch.device("cpu"), runner.block_size,
                             runner.tree_rows)
    graphs.capture_chains(chain_steps, 64, runner.chain_topk)
    runner.graphs = graphs
    return graphs
