"""The one-kernel copy of a decode step's graph inputs (kernels/stage_inputs.py,
csrc/stage_inputs.cu), which also writes the previous step's tokens to pinned host memory for
async scheduling (CUDAGraphRunner.copy_out_next, llm_engine._copy_to_host).

CPU: the source compiles with NVRTC; bad arguments are refused by name; a pending copy-out is
made once. GPU: the kernel writes exactly what the torch copies write (every
ids dtype, padding, a table prefix, the tokens out), leaves the rest alone, and an engine
decodes the same greedy tokens with it and without it, async scheduling on."""

from __future__ import annotations

import gc

import pytest
import torch
from nvrtc_helpers import use_nvrtc

from llmaccel.kernels import cuda_rtc, stage_inputs
from llmaccel.kernels.stage_inputs import StagedCopy


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_source_compiles_with_nvrtc(arch, monkeypatch):
    use_nvrtc(monkeypatch)
    assert cuda_rtc.compile_cubin(stage_inputs._source(), "stage_inputs", arch, {})


def test_a_pending_copy_out_is_made_once_in_stream_order():
    """Where the next launch has no input kernel to carry it (an eager step, a chain, no
    CUDA C kernels), copy_out_next's copy is made as a copy first, and its event recorded."""
    from llmaccel.engine.cuda_graph import CUDAGraphRunner

    class Event:
        recorded = 0

        def record(self):
            Event.recorded += 1

    runner = CUDAGraphRunner.__new__(CUDAGraphRunner)
    runner._copy_out = None
    src = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    dst = torch.zeros(2, 3, dtype=torch.float64)
    runner.copy_out_next(src, dst, Event())
    assert Event.recorded == 0 and torch.equal(dst, torch.zeros(2, 3, dtype=torch.float64))
    runner.flush_copy_out()
    assert Event.recorded == 1 and torch.equal(dst, src)
    runner.flush_copy_out()  # nothing pending: nothing recorded twice
    assert Event.recorded == 1


def test_launch_arguments_match_the_kernel(monkeypatch):
    """The Python side's launch, with the driver calls faked: one launch, the kernel's 18
    parameters in its order (a CPU check of the plumbing the GPU tests run for real)."""
    launches = []

    class FakeKernel:
        def launch(self, grid, block, args, **kw):
            launches.append((grid, block, [a.value for a in args]))

    monkeypatch.setattr(cuda_rtc, "host_device_pointer", lambda t: 0x1000)
    monkeypatch.setattr(cuda_rtc, "get_kernel", lambda *a, **k: FakeKernel())
    host = (torch.zeros(8, 16, dtype=torch.long), torch.ones(16, dtype=torch.int32),
            torch.zeros(16, 9, dtype=torch.int32))
    dev = tuple(torch.zeros_like(t) for t in host)
    copy = StagedCopy(host, dev)
    ids = torch.arange(3, dtype=torch.float64)
    copy(4, 5, ids)
    (grid, block, args), = launches
    assert len(args) == 18 and block == stage_inputs.THREADS and grid >= 1
    assert args[:3] == [0x1000] * 3
    assert args[6:11] == [16, 4, 9, 5, 8]  # n, bs, w, cols, input rows
    assert args[12:14] == [3, 2]  # three float64 ids
    assert args[14:] == [None, 0, None, 0]  # nothing copied out


def test_not_available_for_unpinned_host_or_cpu():
    host = (torch.zeros(8, 4, dtype=torch.long), torch.ones(4, dtype=torch.int32),
            torch.zeros(4, 3, dtype=torch.int32))
    assert not StagedCopy.available(host, torch.device("cpu"))
    assert not StagedCopy.available(host, torch.device("cuda"))  # not pinned


gpu = pytest.mark.gpu


def _buffers(n=16, w=9, rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    host = (torch.randint(-5, 10**6, (rows, n), generator=g).pin_memory(),
            torch.randint(1, 4000, (n,), generator=g, dtype=torch.int32).pin_memory(),
            torch.randint(0, 500, (n, w), generator=g, dtype=torch.int32).pin_memory())
    dev = (torch.full((rows, n), -7, dtype=torch.long, device="cuda"),
           torch.full((n,), -7, dtype=torch.int32, device="cuda"),
           torch.full((n, w), -7, dtype=torch.int32, device="cuda"))
    return host, dev


@gpu
@pytest.mark.parametrize("ids_dtype", [None, torch.int64, torch.float64, torch.int32])
@pytest.mark.parametrize("bs,cols,n_ids", [(1, 1, 1), (5, 4, 3), (16, 9, 16)])
def test_gpu_equals_the_torch_copies(ids_dtype, bs, cols, n_ids):
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    host, dev = _buffers(seed=bs + cols)
    copy = StagedCopy(host, dev)
    ids = None if ids_dtype is None else torch.arange(
        100, 100 + 7 * n_ids, 7, device="cuda").to(ids_dtype)
    src = torch.randn(2, bs + 3, device="cuda", dtype=torch.float64)[:, :bs]  # a graph's view
    dst = torch.zeros(2, bs, dtype=torch.float64).pin_memory()
    assert copy.copies_out(src, dst)
    copy(bs, cols, ids, (src, dst))
    torch.cuda.synchronize()
    assert torch.equal(dst, src.cpu())
    want_in = torch.full_like(dev[0], -7)
    want_in[:, :bs] = host[0][:, :bs].cuda()
    if ids is not None:
        want_in[0, :n_ids] = ids.long()
    want_seq = torch.full_like(dev[1], -7)
    want_seq[:bs] = host[1][:bs].cuda()
    want_tab = torch.full_like(dev[2], -7)
    want_tab[:bs, :cols] = host[2][:bs, :cols].cuda()
    assert torch.equal(dev[0], want_in)
    assert torch.equal(dev[1], want_seq)
    assert torch.equal(dev[2], want_tab)


@gpu
def test_gpu_refuses_bad_arguments():
    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    host, dev = _buffers()
    copy = StagedCopy(host, dev)
    with pytest.raises(ValueError, match="bs=17"):
        copy(17, 1)
    with pytest.raises(ValueError, match="ids must be"):
        copy(2, 1, torch.zeros(3, device="cuda", dtype=torch.long))  # more ids than rows
    with pytest.raises(ValueError, match="ids must be"):
        copy(4, 1, torch.zeros(2, device="cuda", dtype=torch.float16))
    src = torch.zeros(2, 4, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match="copy_out"):
        copy(4, 1, None, (src, torch.zeros(2, 4, dtype=torch.float64)))  # not pinned


@gpu
def test_gpu_engine_same_tokens_with_and_without_the_kernel(monkeypatch):
    from llmaccel import LLM, SamplingParams

    if not cuda_rtc.available():
        pytest.skip("no CUDA C kernels here")
    tokens = {}
    real_available = stage_inputs.StagedCopy.available
    for on in (True, False):
        # off: the torch copies the runner makes where the kernel cannot run
        monkeypatch.setattr(stage_inputs.StagedCopy, "available", staticmethod(
            real_available if on else lambda host, device: False))
        llm = LLM("llama-3.2-1b", load_format="dummy", dtype="bfloat16", max_model_len=512,
                  skip_tokenizer_init=True, enable_prefix_caching=False,
                  gpu_memory_utilization=0.3,
                  cudagraph_capture_sizes=[1, 2, 4])
        graphs = llm.engine.runner.graphs
        assert all((st.staged is not None) == on for st in graphs._staging)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        prompts = [{"prompt_token_ids": [(11 * i + 3 * j) % 900 + 10 for j in range(30 + i)]}
                   for i in range(3)]
        one = [list(llm.generate(p, params)[0].outputs[0].token_ids) for p in prompts]
        batch = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        assert llm.engine.stats.num_async_steps > 0
        tokens[on] = (one, batch)
        del llm, graphs
        gc.collect()  # engines of later tests size their KV cache from free memory
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]
