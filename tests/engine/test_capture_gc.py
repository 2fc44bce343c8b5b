"""engine/cuda_graph.gc_paused: Python's cyclic collector runs before CUDA graph captures and
never during them (a collection mid-capture can free a dead engine's CUDA objects, which
invalidates the capture; it failed a head's captures 1 run in 3 on an H200)."""

from __future__ import annotations

import gc

import pytest

from llmaccel.engine.cuda_graph import gc_paused


class _Cycle:
    freed: list[str] = []

    def __init__(self, name: str) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it
        self.name = name

    def __del__(self) -> None:
        _Cycle.freed.append(self.name)


def test_garbage_is_collected_on_entry_and_the_collector_is_off_inside():
    assert gc.isenabled()
    _Cycle.freed.clear()
    _Cycle("before")
    with gc_paused():
        assert _Cycle.freed == ["before"]  # collected before the (would-be) capture
        assert not gc.isenabled()
        _Cycle("during")
        for _ in range(20_000):  # allocations past every threshold: still nothing runs
            [object()]
        assert _Cycle.freed == ["before"]
    assert gc.isenabled()
    gc.collect()
    assert _Cycle.freed == ["before", "during"]


def test_the_collector_comes_back_after_an_error_and_stays_off_if_it_was():
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # the caller's choice is kept
    finally:
        gc.enable()
