"""GPU tests' shared steps for a chain of kernels replayed in a CUDA graph with PDL on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def pdl_on() -> Iterator[None]:
    """Programmatic dependent launch on for the block (where the GPU has it), then as before."""
    from llmaccel.kernels import pdl

    used = pdl.configure(torch.device("cuda"), True)
    try:
        yield
    finally:
        pdl.configure(torch.device("cuda"), used)


def replay_in_graph(fn: Callable[[], torch.Tensor], replays: int = 3) -> torch.Tensor:
    """fn() once on a side stream (kernels compile outside the capture), then captured in a
    CUDA graph and replayed `replays` times: the captured call's output after the replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return out
