"""Which CUDA-graph row counts an engine captures (engine/sizing.py); no GPU needed."""

import torch

from llmaccel.engine.config import EngineConfig
from llmaccel.engine.sizing import PREFILL_GRAPH_ROWS, capture_sizes

CUDA = torch.device("cuda")


def test_graphs_cover_small_prefill_steps_beyond_decode_rows():
    cfg = EngineConfig(model="m", max_num_seqs=8)
    sizes = capture_sizes(cfg, CUDA, max_num_batched_tokens=8192)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == PREFILL_GRAPH_ROWS
    # the step token budget caps them: no step has more rows
    assert capture_sizes(cfg, CUDA, max_num_batched_tokens=100)[-1] == 100
    # decode steps of many sequences need more
    assert capture_sizes(EngineConfig(model="m", max_num_seqs=1024), CUDA)[-1] == 1024
    # explicit sizes are kept as given (up to what a step can hold)
    cfg = EngineConfig(model="m", max_num_seqs=8, cudagraph_capture_sizes=(1, 2, 4, 8))
    assert capture_sizes(cfg, CUDA, max_num_batched_tokens=8192) == [1, 2, 4, 8]
    # ... beyond the decode steps' rows too (prefill steps replay them), not past the budget
    cfg = EngineConfig(model="m", max_num_seqs=8, cudagraph_capture_sizes=(8, 1024, 9000))
    assert capture_sizes(cfg, CUDA, max_num_batched_tokens=8192) == [8, 1024]
    assert capture_sizes(cfg, torch.device("cpu")) is None
    assert capture_sizes(EngineConfig(model="m", enforce_eager=True), CUDA) is None
