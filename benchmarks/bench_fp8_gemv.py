"""Batch-1 FP8 W8A8 GEMV on this GPU: the dedicated kernel (`kernels/gemv_fp8.py`) against what
`fp8_linear` runs today (`quantize_fp8_per_token` + `torch._scaled_mm` with row-wise scales) and
against cuBLAS on the dense bf16 weight, for every linear shape of the named models (not the LM
head), with E4M3 weights and one fp32 scale per output row.

    python benchmarks/bench_fp8_gemv.py --models llama-3.2-3b,llama-3.2-1b \\
        --out-jsonl fp8gemv.jsonl --out-table llmaccel/kernels/configs/<gpu>.json

Timing as in tune_gemm.py and bench_w4_gemv.py: one figure is a call inside a replayed CUDA
graph of many calls that cycle through enough weight copies to defeat the L2 cache (at least
256 MB of weights). GB/s counts the weight bytes read (codes and scales). The new kernel's tile
is swept under a time budget, without fusions (the prologues add a pass over the L2-resident
row, not weight traffic); each tile is checked against `fp8_gemv_ref` before it is timed. With
--out-table the best tile per shape is merged into the tuning table as "fp8gemv:1:N:K" (read
by `gemm_tuning.gemv_fp8_config`), only where it beat the `_scaled_mm` path.

--quick runs two tiny shapes on the CPU (Triton's interpreter; the `_scaled_mm` column is then
`fp8_linear`'s fp32 reference path) as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from llmaccel.bench.results import current_commit

MIN_CYCLE_BYTES = 256 * 2**20  # weight bytes cycled through per timing: > 5x the H100's L2
MAX_COPIES = 96


def _tune_gemm():
    """benchmarks/tune_gemm.py as a module (its shapes, weight helpers and graph timer)."""
    spec = importlib.util.spec_from_file_location("tune_gemm",
                                                  Path(__file__).with_name("tune_gemm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Tried first (not yet measured: guesses around the W4 GEMV's best tiles, per byte): a warp
# over 512 columns with 2-4 rows a thread, and whole-row tiles whose loads all issue before the
# PDL wait. Then the rest of the space, most bytes per thread first.
SEEDS = ((8, 512, 4, 3), (16, 512, 4, 3), (8, 1024, 4, 3), (16, 1024, 8, 3), (4, 1024, 2, 3),
         (8, 512, 2, 3), (4, 2048, 4, 2), (2, 4096, 4, 2), (4, 4096, 8, 2), (2, 8192, 8, 2),
         (8, 2048, 8, 2), (1, 4096, 2, 2))


def candidates(n: int, k: int, quick: bool = False) -> list:
    """Tiles to try, likeliest first: 1 to 8 16-byte weight vectors per thread (fewer leaves
    bandwidth unused per thread, more spills the accumulators)."""
    from llmaccel.kernels.gemv_fp8 import GemvFp8Config, valid_config

    if quick:
        return [GemvFp8Config(8, 64, 1, 2), GemvFp8Config(16, 128, 2, 3),
                GemvFp8Config(4, 256, 1, 2)]
    space = [GemvFp8Config(bn, bk, nw, ns) for bn, bk, nw, ns in itertools.product(
        (1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048, 4096, 8192), (1, 2, 4, 8), (2, 3, 4))
        if 1 <= bn * bk / (16 * 32 * nw) <= 8]
    seeds = [GemvFp8Config(*t) for t in SEEDS]
    rest = sorted((c for c in space if c not in seeds),
                  key=lambda c: (-c.block_n * c.block_k / c.num_warps, c.num_stages != 3,
                                 c.num_warps))
    # a tile may overhang K (masked: 3072 in a 4096 tile is one iteration), but not by 2x
    return [c for c in seeds + rest if c.block_k < 2 * k and valid_config(c)]


def time_cpu(fn, copies: int, calls: int) -> float:
    """--quick: wall-clock microseconds per call (the interpreter's, meaningless as speed)."""
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i % copies)
    return (time.perf_counter() - t0) * 1e6 / calls


def make_fp8_weights(n: int, k: int, copies: int, dev: torch.device
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` random E4M3 weights [N, K] (every finite code; NaN codes 0x7F/0xFF become 0)
    with fp32 scales [N, 1] of a bf16 linear's size."""
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=dev)
        codes[(codes & 0x7F) == 0x7F] = 0
        scale = torch.rand(n, 1, device=dev) * 1e-4 + 1e-5
        out.append((codes.view(torch.float8_e4m3fn), scale))
    return out


def _time_dense(x, n: int, k: int, copies: int, tg, timer, calls: int) -> float:
    """cuBLAS (F.linear) on copies of a dense bf16 weight, freed on return."""
    dense = tg.make_weights(16, n, k, -1, copies, x.device)
    return timer(lambda i: torch.nn.functional.linear(x, dense[i][0]), copies, calls)


def bench_shape(n: int, k: int, users: list[str], dev: torch.device, budget_s: float,
                tg, quick: bool, prequant: bool = False) -> tuple[dict, dict]:
    """Times cuBLAS bf16, the `_scaled_mm` path and the new kernel's tiles on one shape.
    Returns (record, table entry)."""
    from llmaccel.kernels.gemv_fp8 import fp8_gemv, fp8_gemv_ref, quantize_row_fp8
    from llmaccel.models.layers.fp8_linear import fp8_linear, supports_scaled_mm

    t0 = time.time()
    q_bytes = n * k + 4 * n  # codes and fp32 scales
    dense_bytes = 2 * n * k
    copies = 2 if quick else max(2, min(MAX_COPIES, -(-MIN_CYCLE_BYTES // q_bytes)))
    dense_copies = 2 if quick else max(2, min(MAX_COPIES, -(-MIN_CYCLE_BYTES // dense_bytes)))
    calls = 4 if quick else max(24, copies)
    timer = time_cpu if quick else tg.time_graph  # tune_gemm's CUDA-graph timer
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    cublas_us = _time_dense(x, n, k, dense_copies, tg, timer,
                            calls if quick else max(24, dense_copies))
    ws = make_fp8_weights(n, k, copies, dev)
    scaled_mm = supports_scaled_mm(dev, x.dtype)  # False on the CPU: the fp32 reference path
    mm_us = timer(lambda i: fp8_linear(x, ws[i][0], ws[i][1], use_scaled_mm=scaled_mm),
                  copies, calls)
    ref = fp8_gemv_ref(x, ws[0][0], ws[0][1]).float()
    timed = []
    for cfg in candidates(n, k, quick):
        if not quick and time.time() - t0 > budget_s and timed:
            break
        try:
            # each tile must agree with the reference before it is timed
            err = (fp8_gemv(x, ws[0][0], ws[0][1], config=cfg).float() - ref).abs().max().item()
            if err > 2e-2 * ref.abs().max().item():
                print(f"  {cfg.describe()}: wrong result (max error {err:.3g}), skipped")
                continue
            us = timer(lambda i, cfg=cfg: fp8_gemv(x, ws[i][0], ws[i][1], config=cfg),
                       copies, calls)
        except Exception as e:  # noqa: BLE001 (e.g. out of registers or shared memory)
            print(f"  {cfg.describe()}: {type(e).__name__}: {str(e)[:120]}")
            continue
        timed.append((us, cfg))
    if not timed:
        raise RuntimeError(f"no tile ran for {n} x {k}")
    best_us, best = min(timed, key=lambda t: t[0])
    pre = {}
    if prequant:
        # The row quantized once (quantize_row_fp8) instead of by every program: the GEMV
        # alone on the quantized row per tile, then the pair (a prequant tile) for the best.
        q, xs = quantize_row_fp8(x)
        pre_timed = []
        t1 = time.time()
        for cfg in candidates(n, k, quick):
            if not quick and time.time() - t1 > budget_s / 2 and pre_timed:
                break
            try:
                us = timer(lambda i, cfg=cfg: fp8_gemv(q, ws[i][0], ws[i][1], config=cfg,
                                                       x_scale=xs), copies, calls)
            except Exception as e:  # noqa: BLE001
                print(f"  prequant {cfg.describe()}: {type(e).__name__}: {str(e)[:120]}")
                continue
            pre_timed.append((us, cfg))
        p_us, p_cfg = min(pre_timed, key=lambda t: t[0])
        err = (fp8_gemv(q, ws[0][0], ws[0][1], config=p_cfg, x_scale=xs).float()
               - ref).abs().max().item()
        pair = replace(p_cfg, prequant=True)  # fp8_gemv quantizes the row first
        chain_us = timer(lambda i: fp8_gemv(x, ws[i][0], ws[i][1], config=pair), copies, calls)
        pre = {"prequant_gemv_us": round(p_us, 2), "prequant_tile": p_cfg.describe(),
               "prequant_pair_us": round(chain_us, 2), "prequant_max_err": err,
               "prequant_tiles_timed": len(pre_timed)}
        print(f"  prequant: GEMV alone {p_us:.2f} us ({p_cfg.describe()}), with the row's "
              f"quantize kernel {chain_us:.2f} us; inline best {best_us:.2f} us", flush=True)
        if chain_us < best_us:  # the pair wins: the entry says to quantize first
            best_us, best = chain_us, pair
    mm_name = "_scaled_mm" if scaled_mm else "reference"
    print(f"{n:>6} x {k:<5} cuBLAS bf16 {cublas_us:7.2f} us "
          f"({dense_bytes / cublas_us / 1e3:5.0f} GB/s) | {mm_name} {mm_us:7.2f} us "
          f"({q_bytes / mm_us / 1e3:5.0f} GB/s) | new {best_us:7.2f} us "
          f"({q_bytes / best_us / 1e3:5.0f} GB/s) {best.describe():<16} "
          f"x{mm_us / best_us:4.2f} vs {mm_name}, x{cublas_us / best_us:4.2f} vs bf16  "
          f"[{len(timed)} tiles]", flush=True)
    model = ",".join(users)
    record = {
        "workload": "fp8gemv", "model": model, "load_format": "dummy", "backend": "llmaccel",
        "config": {"m": 1, "n": n, "k": k, "kernel": best.describe(), "tiles_timed": len(timed),
                   "baseline": mm_name},
        "metric": "us", "value": round(best_us, 2), "gbps": round(q_bytes / best_us / 1e3, 1),
        "scaled_mm_us": round(mm_us, 2), "scaled_mm_gbps": round(q_bytes / mm_us / 1e3, 1),
        "cublas_bf16_us": round(cublas_us, 2),
        "cublas_bf16_gbps": round(dense_bytes / cublas_us / 1e3, 1),
        "speedup_vs_scaled_mm": round(mm_us / best_us, 2),
        "speedup_vs_bf16": round(cublas_us / best_us, 2),
        **pre,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__, "commit": current_commit(),
        "command": "python benchmarks/bench_fp8_gemv.py" + (" --quick" if quick else ""),
    }
    entry = {"backend": "triton", "config": best.__dict__, "us": round(best_us, 2),
             "scaled_mm_us": round(mm_us, 2), "model": model}
    return record, entry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3.2-3b,llama-3.2-1b")
    ap.add_argument("--out-jsonl", default="fp8gemv.jsonl")
    ap.add_argument("--out-table", default=None,
                    help="merge the best tiles into this tuning table ('auto': this GPU's)")
    ap.add_argument("--budget-s", type=float, default=160,
                    help="time for the whole tile sweep (shared out over the shapes)")
    ap.add_argument("--pdl", action="store_true",
                    help="launch the Triton kernel with programmatic dependent launch, as the "
                         "engine does on Hopper (off by default, like tune_gemm.py)")
    ap.add_argument("--prequant", action="store_true",
                    help="also time the GEMV on a row quantized once by its own kernel "
                         "(quantize_row_fp8), alone per tile and as a pair for the best; the "
                         "pair's tile (prequant=True) is the entry where it is fastest")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = ap.parse_args(argv)
    if args.quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from llmaccel.kernels import pdl
    from llmaccel.kernels.gemm_tuning import write_table

    tg = _tune_gemm()
    if args.quick:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shapes = {(40, 256): ["quick"], (72, 128): ["quick"]}
    else:
        dev = torch.device("cuda")
        shapes = {nk: users for nk, users in tg.linear_shapes(args.models.split(",")).items()
                  if not all(u.endswith("lm_head") for u in users)}
    if args.pdl:
        print(f"PDL {'on' if pdl.configure(dev, requested=True) else 'unsupported here: off'}")
    t0 = time.time()
    records, entries = [], {}
    for i, ((n, k), users) in enumerate(shapes.items()):
        # what is left of the budget, shared by the shapes still to run
        budget = (args.budget_s - (time.time() - t0)) / (len(shapes) - i)
        record, entry = bench_shape(n, k, users, dev, budget, tg, args.quick, args.prequant)
        record["config"]["pdl"] = pdl.enabled()
        records.append(record)
        if record["speedup_vs_scaled_mm"] > 1:  # no measured win, no entry
            entries[f"fp8gemv:1:{n}:{k}"] = entry
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    with open(args.out_jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print("\n| layers | N | K | cuBLAS bf16 us | _scaled_mm us | new us | new GB/s | tile | "
          "x _scaled_mm | x bf16 |\n" + "|---" * 10 + "|")
    for r in records:
        c = r["config"]
        print(f"| {r['model']} | {c['n']} | {c['k']} | {r['cublas_bf16_us']:.2f} | "
              f"{r['scaled_mm_us']:.2f} | {r['value']:.2f} | {r['gbps']:,.0f} | {c['kernel']} | "
              f"{r['speedup_vs_scaled_mm']:.2f} | {r['speedup_vs_bf16']:.2f} |")
    if args.out_table:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        path = write_table(args.out_table, name, entries)
        print(f"{len(entries)} fp8gemv entries -> {path}")
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
