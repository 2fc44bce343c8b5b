"""Experiment: the wgmma W4A16 GEMM (`kernels/gemm_w4_wgmma.py`) against cuBLAS on bf16 weights,
the mma.sync W4A16 GEMM (`kernels/gemm_w4_cuda.py`, its default tile) and dequantize + cuBLAS,
on the llama-3.2-3b shapes.

    python benchmarks/exp_w4_wgmma.py --out DIR [--rows 16,32,64,128,256,512]

Per shape and row count: every candidate tile checked against `gemm.linear_ref` (fp32
dequantize, bf16 weight, F.linear), then timed as a call inside a replayed CUDA graph cycling
through > 256 MB of weights (`tune_gemm.time_graph`). Group 128, symmetric. Writes
exp_w4_wgmma.jsonl under --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tune_gemm import projection_shapes, time_graph  # noqa: E402

SHAPES = projection_shapes("llama-3.2-3b")
GROUP = 128
CYCLE_BYTES = 256 * 2**20


def candidates(m: int, n: int, k: int):
    """The default tile and the families that led runs 2-6 (x tiles of 64 or 128 rows, one or
    two warpgroups, K split 1, 2 or 4 ways, 64 or 128 k a stage, 3 or 4 stages), without the
    proxy fence, each with and without the L2 prefetch of the block's code rows."""
    from llmaccel.kernels.gemm_w4_wgmma import WgmmaW4Config, config_for

    out = {config_for(m, n, k, GROUP)}
    fams = [(64, 1, 1), (64, 1, 2), (64, 1, 4), (128, 1, 1), (128, 2, 1), (64, 2, 1)] + (
        [(256, 2, 1)] if m > 128 else [])
    if m <= 32:
        fams += [(max(16, -(-m // 16) * 16), 1, s) for s in (1, 2, 4)]
    for bm, wgs, split in fams:
        for ksteps in (4, 8):
            for stages in (3, 4):
                for pf in (True, False):
                    out.add(WgmmaW4Config(bm, wgs, stages, split, 1, False, 0, ksteps, pf))
    return sorted((c for c in out if c.valid()), key=lambda c: c.describe())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="16,32,64,128,256,512")
    ap.add_argument("--shapes", default=",".join(k for k in SHAPES if k != "lm_head"))
    ap.add_argument("--scale-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: what the engine keeps for scales bf16 cannot hold exactly")
    ap.add_argument("--default-only", action="store_true", help="time only the default tile")
    args = ap.parse_args()
    from llmaccel.kernels.gemm import dequantize_packed, linear_ref, pack_int4_rows
    from llmaccel.kernels.gemm_w4_cuda import w4a16_gemm_cuda
    from llmaccel.kernels.gemm_w4_wgmma import config_for, supports, w4a16_gemm_wgmma

    dev = torch.device("cuda")
    torch.manual_seed(0)
    out_path = Path(args.out) / "exp_w4_wgmma.jsonl"
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"), "group": GROUP,
            "scale_dtype": args.scale_dtype}
    rows_list = [int(r) for r in args.rows.split(",")]
    table = []
    with out_path.open("w") as f:
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            copies = max(2, CYCLE_BYTES // (n * k // 2))
            ws = [pack_int4_rows(torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8))
                  for _ in range(copies)]
            sdt = getattr(torch, args.scale_dtype)
            ss = [(torch.rand(n, k // GROUP, device=dev) * 0.02 + 0.001).to(sdt)
                  for _ in range(copies)]
            bcopies = max(2, CYCLE_BYTES // (n * k * 2))
            wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                  for _ in range(bcopies)]
            for m in rows_list:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = linear_ref(x, ws[0], 4, ss[0], None, GROUP).float()
                rec = {**meta, "shape": name, "n": n, "k": k, "m": m}
                rec["cublas_bf16_us"] = time_graph(lambda i: F.linear(x, wb[i % bcopies]),
                                                   bcopies)
                rec["dequant_cublas_us"] = time_graph(
                    lambda i: F.linear(x, dequantize_packed(ws[i], 4, ss[i], None, GROUP,
                                                            torch.bfloat16)), copies)
                rec["gemm_w4_us"] = time_graph(
                    lambda i: w4a16_gemm_cuda(x, ws[i], ss[i], None, GROUP), copies)
                tiles = {}
                for cfg in ([config_for(m, n, k, GROUP)] if args.default_only
                            else candidates(m, n, k)):
                    if not supports(x, ws[0], ss[0], None, GROUP, None, cfg):
                        continue
                    y = w4a16_gemm_wgmma(x, ws[0], ss[0], None, GROUP, None, cfg).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    if not err < 1e-2:
                        raise SystemExit(f"{name} m={m} {cfg.describe()}: rel err {err:.3g}")
                    us = time_graph(lambda i, c=cfg: w4a16_gemm_wgmma(x, ws[i], ss[i], None,
                                                                      GROUP, None, c), copies)
                    tiles[cfg.describe()] = {"us": round(us, 2), "rel_err": err}
                best = min(tiles, key=lambda t: tiles[t]["us"])
                rec["wgmma_tiles"] = tiles
                rec["wgmma_best"] = best
                rec["wgmma_us"] = tiles[best]["us"]
                rec["wgmma_default"] = config_for(m, n, k, GROUP).describe()
                rec["wgmma_default_us"] = tiles[rec["wgmma_default"]]["us"]
                f.write(json.dumps(rec) + "\n")
                f.flush()
                table.append(rec)
                print(f"{name:8s} m={m:4d} bf16 {rec['cublas_bf16_us']:7.2f} deq+cublas "
                      f"{rec['dequant_cublas_us']:7.2f} mma.sync {rec['gemm_w4_us']:7.2f} "
                      f"wgmma {rec['wgmma_us']:7.2f} ({best}; default "
                      f"{rec['wgmma_default_us']:.2f})", flush=True)
            del ws, ss, wb
            torch.cuda.empty_cache()
    print("\n| shape | M | cuBLAS bf16 | dequant+cuBLAS | mma.sync GEMM | wgmma default | "
          "wgmma best | best tile |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['shape']} | {r['m']} | {r['cublas_bf16_us']:.2f} | "
              f"{r['dequant_cublas_us']:.2f} | {r['gemm_w4_us']:.2f} | "
              f"{r['wgmma_default_us']:.2f} | {r['wgmma_us']:.2f} | {r['wgmma_best']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
