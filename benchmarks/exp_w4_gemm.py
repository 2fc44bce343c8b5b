"""Experiment: the tensor-core W4A16 GEMM (`kernels/gemm_w4_cuda.py`) against what the engine ran
before for 2+ rows (dequantize + cuBLAS from 32 rows, the Triton W4A16 kernel below) and against
cuBLAS on bf16 weights, on the llama-3.2-3b shapes.

    python benchmarks/exp_w4_gemm.py --out DIR [--rows 2,4,8,16,32,64,128,256,512]

Per shape and row count: every candidate tile checked against `gemm.linear_ref` (fp32
dequantize, bf16 weight, F.linear) on one weight copy, then timed as a call inside a replayed
CUDA graph cycling through > 256 MB of weights (`tune_gemm.time_graph`). Group 128,
symmetric (GPTQ's default). Writes exp_w4_gemm.jsonl under --out and prints a table.
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


def candidates(m: int):
    from llmaccel.kernels.gemm_w4_cuda import DEFAULT_CONFIGS, GemmW4Config, config_for

    out = {config_for(m, 5120), config_for(m, 16384)}
    for c in DEFAULT_CONFIGS:
        if c.block_m <= max(16, 2 * m):
            out.add(c)
    for c in list(out):
        for cps, stages in ((4, 3), (4, 4), (2, 6), (4, 6), (4, 8)):
            v = GemmW4Config(c.wm, c.wn, c.mt, c.ntw, cps, stages)
            if v.valid():
                out.add(v)
    if m <= 16:
        out.add(GemmW4Config(1, 4, 1, 1, 4, 6))  # 16 x 32: twice the blocks
        out.add(GemmW4Config(1, 4, 1, 1, 4, 8))
    if m >= 64:
        # wider warp tiles: each x fragment feeds more n8 tiles (fewer shared loads an mma)
        for c in (GemmW4Config(4, 1, 2, 8, 4, 3), GemmW4Config(2, 2, 2, 8, 4, 3),
                  GemmW4Config(2, 1, 2, 8, 4, 4), GemmW4Config(2, 2, 1, 8, 4, 4),
                  GemmW4Config(4, 1, 1, 8, 4, 4), GemmW4Config(2, 2, 2, 4, 4, 4)):
            if c.valid():
                out.add(c)
    # each tile with and without LEAN (the .cu; the defaults are LEAN since run 6)
    out |= {GemmW4Config(c.wm, c.wn, c.mt, c.ntw, c.cps, c.stages, True) for c in list(out)}
    if m >= 64:  # split-K: the tall tiles' grids are small for 3072-5120 columns
        for c in (GemmW4Config(2, 2, 4, 4, 4, 3), GemmW4Config(2, 2, 2, 4, 4, 3)):
            for lean in (False, True):
                for split in (2, 3, 4):
                    out.add(GemmW4Config(c.wm, c.wn, c.mt, c.ntw, c.cps, c.stages, lean, split))
    return sorted(out, key=lambda c: c.describe())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="2,4,8,16,32,64,128,256,512")
    ap.add_argument("--shapes", default=",".join(k for k in SHAPES if k != "lm_head"))
    args = ap.parse_args()
    from llmaccel.kernels.gemm import dequantize_packed, linear_ref, pack_int4_rows, triton_linear
    from llmaccel.kernels.gemm_tuning import packed_config
    from llmaccel.kernels.gemm_w4_cuda import supports, w4a16_gemm_cuda

    dev = torch.device("cuda")
    torch.manual_seed(0)
    out_path = Path(args.out) / "exp_w4_gemm.jsonl"
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"), "group": GROUP}
    rows_list = [int(r) for r in args.rows.split(",")]
    table = []
    with out_path.open("w") as f:
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            wbytes = n * k // 2
            copies = max(2, CYCLE_BYTES // wbytes)
            codes = [torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8)
                     for _ in range(copies)]
            ws = [pack_int4_rows(c) for c in codes]
            del codes
            ss = [(torch.rand(n, k // GROUP, device=dev) * 0.02 + 0.001).to(torch.bfloat16)
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
                cfg_t = packed_config(m, n, k, 4, GROUP, dev)
                rec["triton_us"] = time_graph(
                    lambda i: triton_linear(x, ws[i], 4, ss[i], None, GROUP, None, cfg_t),
                    copies)
                tiles = {}
                for cfg in candidates(m):
                    if not supports(x, ws[0], ss[0], None, GROUP, None, cfg):
                        continue
                    y = w4a16_gemm_cuda(x, ws[0], ss[0], None, GROUP, None, cfg).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        raise SystemExit(f"{name} m={m} {cfg.describe()}: rel err {err:.3g}")
                    us = time_graph(lambda i, c=cfg: w4a16_gemm_cuda(x, ws[i], ss[i], None,
                                                                     GROUP, None, c), copies)
                    tiles[cfg.describe()] = {"us": round(us, 2), "rel_err": err}
                best = min(tiles, key=lambda t: tiles[t]["us"])
                rec["gemm_w4_tiles"] = tiles
                rec["gemm_w4_best"] = best
                rec["gemm_w4_us"] = tiles[best]["us"]
                f.write(json.dumps(rec) + "\n")
                f.flush()
                table.append(rec)
                print(f"{name:8s} m={m:4d} bf16 {rec['cublas_bf16_us']:8.2f} deq+cublas "
                      f"{rec['dequant_cublas_us']:8.2f} triton {rec['triton_us']:8.2f} "
                      f"gemm_w4 {rec['gemm_w4_us']:8.2f} ({best})", flush=True)
            del ws, ss, wb
            torch.cuda.empty_cache()
    print("\n| shape | M | cuBLAS bf16 us | dequant+cuBLAS us | Triton W4 us | gemm_w4 us | "
          "x dequant+cuBLAS | x bf16 | tile |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['shape']} | {r['m']} | {r['cublas_bf16_us']:.2f} | "
              f"{r['dequant_cublas_us']:.2f} | {r['triton_us']:.2f} | {r['gemm_w4_us']:.2f} | "
              f"{r['dequant_cublas_us'] / r['gemm_w4_us']:.2f} | "
              f"{r['cublas_bf16_us'] / r['gemm_w4_us']:.2f} | {r['gemm_w4_best']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
