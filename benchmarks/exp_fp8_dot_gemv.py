"""Experiment (not used by the engine): a batch-1 FP8 GEMV on tensor cores. The activation row,
quantized per token as kernels/gemv_fp8.py does, is column 0 of a [BLOCK_K, 16] e4m3 operand
(the other columns zero) and each weight tile goes through tl.dot, so the e4m3 -> fp32
conversions that bound the FMA kernel run in the tensor cores. No prologues, no split over K.

    PYTHONPATH=. python benchmarks/exp_fp8_dot_gemv.py

Prints, per llama-3.2-3b shape, the best tile found in 40 s against the FMA GEMV (tuned tile
and default), inside CUDA graphs with weights cycled past L2 (tune_gemm.py's timer). Results:
benchmarks/results/2026-11-23-fp8-dot-gemv-experiment-h100.txt."""
# ruff: noqa: B023, BLE001 (a one-off experiment: each lambda is timed at once, inside its
# loop iteration; a failing tile is reported and skipped)
import importlib.util
import itertools
import time

import torch
import triton
import triton.language as tl

from llmaccel.kernels import pdl
from llmaccel.kernels.gemv_fp8 import _act, _quantize, fp8_gemv, fp8_gemv_ref
from llmaccel.kernels.pdl import pdl_launch_dependents, pdl_wait
from llmaccel.quant.fp8 import MIN_ACT_SCALE


@triton.jit
def _k(X, W, WScale, Y, N, K, stride_wn, min_scale,
       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
       NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    rk0 = tl.arange(0, BLOCK_K)
    wp = W + rows[:, None] * stride_wn + rk0[None, :]
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    amax = tl.zeros((BLOCK_R // 16, 16), tl.float32)
    for k0 in range(0, K, BLOCK_R):
        a = _act(X, X, k0, K, 0.0, 0, False, BLOCK_R)
        amax = tl.maximum(amax, tl.abs(a.to(tl.float32)))
    absmax = tl.max(tl.max(amax, axis=1), axis=0)
    scale = tl.maximum(tl.div_rn(absmax, tl.full((), 448.0, tl.float32)), min_scale)
    rcp = tl.div_rn(tl.full((), 1.0, tl.float32), scale)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    col0 = tl.arange(0, 16)[None, :] == 0
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(wp + k0)
        a = tl.load(X + k0 + rk0).to(tl.float32)
        aq = _quantize(a, scale, rcp)
        b = tl.where(col0, aq[:, None], 0.0).to(tl.float8e4nv)
        acc = tl.dot(w, b, acc)
    y = tl.sum(acc, axis=1) * scale * tl.load(WScale + rows)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=rn < N)

@triton.jit
def _ks(X, W, WScale, Y, Acc, Cnt, N, K, stride_wn, min_scale,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
        NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """Split over K: each program sums K / SPLIT columns into an fp32 buffer with atomics; the
    last program of a row tile to arrive (a counter) scales, stores and clears the buffer."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    k_len = K // SPLIT
    rk0 = pid_k * k_len + tl.arange(0, BLOCK_K)
    wp = W + rows[:, None] * stride_wn + rk0[None, :]
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    amax = tl.zeros((BLOCK_R // 16, 16), tl.float32)
    for k0 in range(0, K, BLOCK_R):
        a = _act(X, X, k0, K, 0.0, 0, False, BLOCK_R)
        amax = tl.maximum(amax, tl.abs(a.to(tl.float32)))
    absmax = tl.max(tl.max(amax, axis=1), axis=0)
    scale = tl.maximum(tl.div_rn(absmax, tl.full((), 448.0, tl.float32)), min_scale)
    rcp = tl.div_rn(tl.full((), 1.0, tl.float32), scale)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    col0 = tl.arange(0, 16)[None, :] == 0
    for k0 in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(wp + k0)
        a = tl.load(X + k0 + rk0).to(tl.float32)
        b = tl.where(col0, _quantize(a, scale, rcp)[:, None], 0.0).to(tl.float8e4nv)
        acc = tl.dot(w, b, acc)
    part = tl.sum(acc, axis=1)
    mask = rn < N
    tl.atomic_add(Acc + rn, part, mask=mask, sem="relaxed")
    done = tl.atomic_add(Cnt + pid_n, 1, sem="acq_rel")
    if done == SPLIT - 1:
        tot = tl.load(Acc + rn, mask=mask, other=0.0, cache_modifier=".cg")
        y = tot * scale * tl.load(WScale + rows)
        tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Acc + rn, tl.zeros((BLOCK_N,), tl.float32), mask=mask)
        tl.store(Cnt + pid_n, 0)


_BUF = {}


def run_split(x, w, s, bn, bk, nw, ns, split):
    n, k = w.shape
    key = (n, x.device)
    if key not in _BUF:
        _BUF[key] = (torch.zeros(n, device=x.device), torch.zeros(n, dtype=torch.int32,
                                                                   device=x.device))
    acc, cnt = _BUF[key]
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _ks[(triton.cdiv(n, bn), split)](x, w, s, y, acc, cnt, n, k, w.stride(0), MIN_ACT_SCALE,
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=triton.next_power_of_2(k), SPLIT=split, NUM_STAGES=ns,
        USE_PDL=pdl.enabled(), num_warps=nw, num_stages=ns, **pdl.launch_kwargs())
    return y


def run(x, w, s, bn, bk, nw, ns):
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _k[(triton.cdiv(n, bn),)](x, w, s, y, n, k, w.stride(0), MIN_ACT_SCALE, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_R=triton.next_power_of_2(k), NUM_STAGES=ns, USE_PDL=pdl.enabled(), num_warps=nw,
        num_stages=ns, **pdl.launch_kwargs())
    return y

spec = importlib.util.spec_from_file_location("tg", "benchmarks/tune_gemm.py")
tg = importlib.util.module_from_spec(spec); spec.loader.exec_module(tg)
dev = torch.device("cuda")
pdl.configure(dev, requested=True)
rows = []
for n, k in [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]:
    copies = max(2, min(96, (256 << 20) // (n * k)))
    ws = [(torch.empty(n, k, device=dev).uniform_(-448, 448).to(torch.float8_e4m3fn),
           torch.rand(n, 1, device=dev) * 1e-3) for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = fp8_gemv_ref(x, *ws[0]).float()
    best = (1e9, None)
    t0 = time.time()
    for bn, bk, nw, ns in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)):
        if time.time() - t0 > 25:
            break
        try:
            got = run(x, *ws[0], bn, bk, nw, ns).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print("bad", bn, bk, nw, ns, err); continue
            us = tg.time_graph(lambda i: run(x, *ws[i], bn, bk, nw, ns), copies, max(24, copies))
        except Exception as e:
            print("fail", bn, bk, nw, ns, type(e).__name__, str(e)[:100]); continue
        if us < best[0]:
            best = (us, (bn, bk, nw, ns), err)
    best_s = (1e9, None, None)
    t0 = time.time()
    for bn, bk, nw, ns, split in itertools.product((32, 64), (128, 256), (4,), (3, 4),
                                                   (2, 3, 4, 6, 8)):
        if time.time() - t0 > 60 or (k // split) % bk:
            continue
        try:
            got = run_split(x, *ws[0], bn, bk, nw, ns, split).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print("bad split", bn, bk, nw, ns, split, err); continue
            us = tg.time_graph(lambda i: run_split(x, *ws[i], bn, bk, nw, ns, split), copies,
                               max(24, copies))
        except Exception as e:
            print("fail split", bn, bk, nw, ns, split, type(e).__name__, str(e)[:100]); continue
        if us < best_s[0]:
            best_s = (us, (bn, bk, nw, ns, split), err)
    cur = tg.time_graph(lambda i: fp8_gemv(x, *ws[i]), copies, max(24, copies))
    from llmaccel.kernels.gemm_tuning import gemv_fp8_config
    cfg = gemv_fp8_config(n, k, dev)
    cur_t = tg.time_graph(lambda i: fp8_gemv(x, *ws[i], config=cfg), copies, max(24, copies)) if cfg else cur
    gb = n * k / best[0] / 1e3
    rows.append(f"{n}x{k}: dot {best[0]:.2f} us ({gb:.0f} GB/s) tile {best[1]} err {best[2]:.1e} | "
                f"split-K dot {best_s[0]:.2f} us ({n * k / best_s[0] / 1e3:.0f} GB/s) tile {best_s[1]} "
                f"err {best_s[2]} | fma-gemv tuned {cur_t:.2f} us default {cur:.2f}")
    print(rows[-1], flush=True)
    ws = None  # free the copies before the next shape
    torch.cuda.empty_cache()
print("\n".join(rows))
