"""Experiment: quantized linear layers at prefill sizes on the llama-3.2-3b shapes. Three ways
to compute x @ W^T for a W4A16 (group 128) or W8A16 (per channel) layer, each against cuBLAS
bf16 on the same shape:
  - the fused Triton GEMM (`kernels/gemm.py`) with this GPU table's tile for the shape;
  - dequantize the weight to bf16 (`gemm.dequantize_packed`), then cuBLAS (F.linear): what
    `PackedLinearMethod` runs from LLMACCEL_DEQUANT_GEMM_MIN_M rows;
  - cuBLAS bf16 alone (the floor).

    python benchmarks/exp_w4_prefill.py --out DIR [--m 16,32,64,128,256,512]

Every timing replays a CUDA graph of calls cycling through > 256 MB of weights
(`tune_gemm.time_graph`). The dequantized weight is checked equal, bit for bit, to
`gemm.linear_ref`'s. Writes exp_w4_prefill.jsonl under --out and prints a table.
(Session 25's first version also swept GEMM tiles and a 16-bit dequantization inside the
GEMM: `2026-11-26-w4-prefill-tiles-h100.*`.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tune_gemm import projection_shapes  # noqa: E402  (this folder: sys.path[0])

SHAPES = {k: v for k, v in projection_shapes("llama-3.2-3b").items()  # (N, K)
          if k != "lm_head"}
CYCLE_BYTES = 256 * 2**20



def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--m", default="16,32,64,128,256,512")
    args = ap.parse_args()
    import torch.nn.functional as F

    from llmaccel.kernels.gemm import dequantize_packed, linear_ref, pack_int4_rows, \
        triton_linear
    from llmaccel.kernels.gemm_tuning import packed_config

    import tune_gemm as tg  # run as a script, this folder is on sys.path
    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ms = [int(v) for v in args.m.split(",")]
    recs = []
    for bits, group in ((4, 128), (8, -1)):
        for name, (n, k) in SHAPES.items():
            per_copy = n * k // 2 if bits == 4 else n * k
            copies = max(2, CYCLE_BYTES // per_copy)
            ws = []
            for i in range(copies):
                g = torch.Generator().manual_seed(i)
                ng = 1 if group == -1 else k // group
                codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
                scales = (torch.rand(n, ng, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
                zeros = torch.randint(0, 1 << bits, (n, ng), generator=g, dtype=torch.uint8)
                w = pack_int4_rows(codes) if bits == 4 else codes
                ws.append((w.to(dev), scales.to(dev), zeros.to(dev)))
            w0, s0, z0 = ws[0]
            deq = dequantize_packed(w0, bits, s0, z0, group, torch.bfloat16)
            eye = torch.eye(k, device=dev)
            exact = torch.equal(deq, linear_ref(eye, w0, bits, s0.float(), z0, group).t()
                                .contiguous().to(torch.bfloat16))
            del eye
            dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                     for _ in range(max(2, CYCLE_BYTES // (n * k * 2)))]
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                cfg = packed_config(m, n, k, bits, k if group == -1 else group, dev)
                cub = tg.time_graph(lambda i: F.linear(x, dense[i]), len(dense))
                tri = tg.time_graph(lambda i: triton_linear(x, ws[i][0], bits, ws[i][1],
                                                            ws[i][2], group, config=cfg),
                                    copies)
                dq = tg.time_graph(lambda i: F.linear(x, dequantize_packed(
                    ws[i][0], bits, ws[i][1], ws[i][2], group, torch.bfloat16)), copies)
                rec = {"bits": bits, "group": group, "shape": name, "n": n, "k": k, "m": m,
                       "cublas_bf16_us": round(cub, 2), "triton_gemm_us": round(tri, 2),
                       "triton_tile": cfg.describe(), "dequant_cublas_us": round(dq, 2),
                       "dequant_exact": exact, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__,
                       "commit": os.environ.get("LLMACCEL_COMMIT", "unknown")}
                recs.append(rec)
                print(json.dumps(rec), flush=True)
            del ws, dense
            torch.cuda.empty_cache()
    with open(out / "exp_w4_prefill.jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    print("\n| bits | M | layers | cuBLAS bf16 us | Triton GEMM us | dequant + cuBLAS us | "
          "x (Triton / dequant) |")
    print("|---|---|---|---|---|---|---|")
    for bits in (4, 8):
        for m in ms:
            rows = [r for r in recs if r["bits"] == bits and r["m"] == m]
            c, t, d = (sum(r[key] for r in rows) for key in
                       ("cublas_bf16_us", "triton_gemm_us", "dequant_cublas_us"))
            print(f"| {bits} | {m} | qkv+o+gate_up+down | {c:.1f} | {t:.1f} | {d:.1f} | "
                  f"{t / d:.2f} |")
    print("dequantized weights equal linear_ref's:", all(r["dequant_exact"] for r in recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
