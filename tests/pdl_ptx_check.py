"""Compile every decode-graph kernel with USE_PDL=True for sm_90 (no GPU needed: Triton's own
ptxas) and check the PTX keeps the PDL rule of kernels/pdl.py: `griddepcontrol.wait` comes
before any global store (and, except in the GEMV and the RMSNorm, which prefetch their
weights, before any global load), and `griddepcontrol.launch_dependents` comes after the wait.

Run as a script without TRITON_INTERPRET (the interpreter replaces @triton.jit functions);
prints one JSON object per kernel. tests/kernels/test_kernels_fused_decode.py runs it."""

from __future__ import annotations

import inspect
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmaccel.kernels import activation, cache, gemm, greedy, paged_attention, rmsnorm, rotary  # noqa: E402,E501

FLOAT_SCALARS = {"eps", "k_inv_scale", "v_inv_scale", "qk_scale", "v_scale"}
POINTER_TYPES = {"Slots": "*i64", "Positions": "*i64", "BlockTables": "*i32", "SeqLens": "*i32",
                 "CosSin": "*fp32", "PartOut": "*fp32", "PartLse": "*fp32", "Max": "*fp32",
                 "Sum": "*fp32", "Arg": "*i64", "Counters": "*i32", "KvFresh": "*i64",
                 "LastSlots": "*i64"}

LINEAR_SIZES = {"M": "i32", "N": "i32", "K": "i32"}  # scalars, though capitalized
CASES = [
    ("linear-norm", gemm._linear_kernel, dict(
        BITS=16, GROUP=1 << 30, HAS_ZEROS=False, HAS_BIAS=True, BLOCK_M=1, BLOCK_N=4,
        BLOCK_K=1024, USE_DOT=False, IEEE=False, PROLOGUE=1, RESIDUAL=False), True,
     LINEAR_SIZES),
    ("linear-silu-residual", gemm._linear_kernel, dict(
        BITS=16, GROUP=1 << 30, HAS_ZEROS=False, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=4,
        BLOCK_K=1024, USE_DOT=False, IEEE=False, PROLOGUE=2, RESIDUAL=True), True,
     LINEAR_SIZES),
    ("linear-int4-dot", gemm._linear_kernel, dict(
        BITS=4, GROUP=128, HAS_ZEROS=True, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=32,
        BLOCK_K=128, USE_DOT=True, IEEE=False, PROLOGUE=0, RESIDUAL=False), True,
     {**LINEAR_SIZES, "W": "*i32", "Zeros": "*u8"}),
    ("rotary", rotary._rotary_kernel, dict(Q_HEADS_PAD=32, K_HEADS_PAD=8, HALF_PAD=32), False),
    ("rotary_and_cache", rotary._rotary_and_cache_kernel, dict(
        Q_HEADS_PAD=32, K_HEADS_PAD=8, HALF_PAD=32, FP8=False, SOFT_ROUND=False), False),
    ("reshape_and_cache", cache._reshape_and_cache_kernel, dict(
        HEADS_PAD=8, DIM_PAD=64, FP8=False, SOFT_ROUND=False), False),
    ("rms_norm", rmsnorm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=2048), True),
    ("silu_and_mul", activation._silu_and_mul_kernel, dict(BLOCK=1024), False),
    # the decode attention, which reads its step inputs before the wait, with the first
    # tile's K/V of earlier steps read early too (both are prefetches the rule of
    # kernels/pdl.py allows: written two or more launches back), and the tree-verification
    # variant that reads a row's newest key from its own slot (a step input as well)
    *[(f"paged_decode{tag}", paged_attention._paged_decode_kernel, dict(
        GROUP=4, GROUP_PAD=16, HEAD_DIM=64, DIM_PAD=64, BLOCK_SIZE=16, BLOCK_N=32,
        NUM_SPLITS=16, PRECISION="tf32", KV_FP8=False, FUSED_COMBINE=True, SPLITS_PAD=16,
        EARLY_KV=early_kv, LAST_FROM_SLOT=tree), True)
      for tag, early_kv, tree in (("", False, False),
                                  ("-early-kv", True, False),
                                  ("-early-kv-tree", True, True))],
    ("combine_splits", paged_attention._combine_splits_kernel, dict(
        HEAD_DIM=64, DIM_PAD=64, NUM_SPLITS=16, SPLITS_PAD=16), False),
    ("greedy_chunk", greedy._chunk_kernel, dict(CHUNK=4096), False),
    ("greedy_merge", greedy._merge_kernel, dict(CHUNKS_PAD=32), False),
]


def _signature(fn, consts, types):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {}
    for p in params:
        if p in consts:
            sig[p] = "constexpr"
        elif p in types or p in POINTER_TYPES:
            sig[p] = types.get(p) or POINTER_TYPES[p]
        elif p == "Out" and fn is greedy._merge_kernel:
            sig[p] = "*fp64"
        elif p[0].isupper():
            sig[p] = "*bf16"
        else:
            sig[p] = "fp32" if p in FLOAT_SCALARS else "i32"
    return params, sig


# Compile options the launch sites pass: rope rounds every product as the eager layer does,
# which FP fusion breaks (it turns x1 * cos - x2 * sin into one bf16 FMA; kernels/rotary.py).
OPTIONS = {"rotary": {"enable_fp_fusion": False}, "rotary_and_cache": {"enable_fp_fusion": False}}


def check(name, fn, consts, prefetches, types=None):
    consts = {**consts, "USE_PDL": True}
    params, sig = _signature(fn, consts, types or {})
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(params.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": 3, **OPTIONS.get(name, {})})
    lines = kernel.asm["ptx"].splitlines()
    where = {key: [i for i, line in enumerate(lines) if key in line]
             for key in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                         "ld.global", "st.global")}
    wait = where["griddepcontrol.wait"][0] if where["griddepcontrol.wait"] else None
    launch = (where["griddepcontrol.launch_dependents"][0]
              if where["griddepcontrol.launch_dependents"] else None)
    ok = (wait is not None and launch is not None and launch > wait
          and all(i > wait for i in where["st.global"])
          and (prefetches or all(i > wait for i in where["ld.global"])))
    return {"kernel": name, "ok": ok, "wait": wait, "launch_dependents": launch,
            "loads_before_wait": sum(i < wait for i in where["ld.global"]) if wait else None,
            "stores_before_wait": sum(i < wait for i in where["st.global"]) if wait else None,
            "fma": sum(line.strip().startswith("fma.") for line in lines)}


if __name__ == "__main__":
    failed = 0
    for case in CASES:
        try:
            res = check(*case)
        except Exception as e:  # a compile error is a failure to report, not a crash
            res = {"kernel": case[0], "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        failed += not res["ok"]
        print(json.dumps(res), flush=True)
    sys.exit(1 if failed else 0)
