"""Experiment: the tensor-core CUDA C batch-1 FP8 GEMV (`kernels/gemv_fp8_cuda.py`) against
the Triton FP8 GEMV (`kernels/gemv_fp8.py`, the GPU table's tile) on the llama-3.2-3b shapes,
both taking the row quantized already (`quantize_row_fp8`), as the engine's prequant path.

    python benchmarks/exp_fp8_cuda.py --out DIR

Per shape: each CUDA tile checked against `fp8_gemv_ref`, then timed as one call inside a
replayed CUDA graph cycling through > 256 MB of weights, with PDL; then the 28 layers' four
GEMVs chained in one graph with each kernel's best tile. Writes exp_fp8_cuda.jsonl.
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
    args = ap.parse_args()
    from llmaccel.kernels import pdl
    from llmaccel.kernels.gemm_tuning import gemv_fp8_config
    from llmaccel.kernels.gemv_fp8 import fp8_gemv, fp8_gemv_ref, quantize_row_fp8
    from llmaccel.kernels.gemv_fp8_cuda import CudaGemvFp8Config, fp8_gemv_cuda
    from llmaccel.quant.fp8 import FP8_DTYPE
    from llmaccel.quant.fp8_linear import untuned_gemv_fp8

    import tune_gemm as tg  # run as a script, this folder is on sys.path
    dev = torch.device("cuda")
    use_pdl = pdl.configure(dev, True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / "exp_fp8_cuda.jsonl", "w")
    best = {}
    rows = []

    def emit(rec):
        rec.update(device=torch.cuda.get_device_name(), torch=torch.__version__, pdl=use_pdl,
                   commit=os.environ.get("LLMACCEL_COMMIT", "unknown"),
                   command="python benchmarks/exp_fp8_cuda.py")
        fh.write(json.dumps(rec) + "\n")
        fh.flush()

    def weights(n, k, copies):
        return [((torch.randn(n, k, device=dev) * 40).clamp(-448, 448).to(FP8_DTYPE),
                 torch.rand(n, 1, device=dev) * 1e-3 + 1e-4) for _ in range(copies)]

    for name, (n, k) in SHAPES.items():
        copies = max(2, min(64, -(-CYCLE_BYTES // (n * k))))
        ws = weights(n, k, copies)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        xq, xs = quantize_row_fp8(x)
        ref = fp8_gemv_ref(x, *ws[0]).float()
        tcfg = gemv_fp8_config(n, k, dev) or untuned_gemv_fp8()
        tus = tg.time_graph(lambda i: fp8_gemv(xq, ws[i][0], ws[i][1], None, tcfg, x_scale=xs),
                            copies, max(24, copies))
        timed = []
        cfgs = [CudaGemvFp8Config(loads, rg) for loads in (2, 3, 4, 6, 8, 12, 16)
                for rg in (1, 2, 4)] + [CudaGemvFp8Config(cc_rows=r) for r in (1, 2, 3, 4, 6, 8)]
        for cfg in cfgs:
            if not cfg.fits(k):
                continue
            got = fp8_gemv_cuda(xq, xs, *ws[0], config=cfg).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 5e-3:
                print(f"  {cfg.describe()}: WRONG {err:.3g}")
                continue
            us = tg.time_graph(lambda i, cfg=cfg: fp8_gemv_cuda(
                xq, xs, ws[i][0], ws[i][1], config=cfg), copies, max(24, copies))
            timed.append((us, cfg, err))
        bus, bcfg, berr = min(timed, key=lambda t: t[0])
        best[name] = (tcfg, bcfg)
        rec = {"exp": "fp8cuda", "shape": name, "n": n, "k": k, "triton": tcfg.describe(),
               "triton_us": round(tus, 2), "cuda": bcfg.describe(), "cuda_us": round(bus, 2),
               "rel_err": berr, "gbps": round(n * k / bus / 1e3),
               "tiles": {c.describe(): round(u, 2) for u, c, _ in timed}}
        emit(rec)
        rows.append(rec)
        print(f"{name:8} triton {tcfg.describe()} {tus:.2f} us | cuda {bcfg.describe()} "
              f"{bus:.2f} us ({n * k / bus / 1e3:.0f} GB/s) x{tus / bus:.2f} | " + " ".join(
                  f"{c.describe()}:{u:.2f}" for u, c, _ in timed), flush=True)
        del ws

    layers = [{s: weights(*SHAPES[s], 1)[0] for s in SHAPES} for _ in range(28)]
    xs_ = {s: quantize_row_fp8(torch.randn(1, SHAPES[s][1], device=dev,
                                           dtype=torch.bfloat16)) for s in SHAPES}
    total = 28 * sum(n * k for n, k in SHAPES.values())

    def run(kind):
        def f(_):
            for lw in layers:
                for s, (w, sc) in lw.items():
                    q, qs = xs_[s]
                    if kind == "triton":
                        fp8_gemv(q, w, sc, None, best[s][0], x_scale=qs)
                    else:
                        fp8_gemv_cuda(q, qs, w, sc, config=best[s][1])
        return f

    res = {}
    for kind in ("triton", "cuda", "triton", "cuda"):
        res.setdefault(kind, []).append(tg.time_graph(run(kind), 1, 1))
    print("\n| kernel | chain us | us/layer | TB/s |\n|---|---|---|---|")
    for kind, v in res.items():
        us = min(v)
        emit({"exp": "fp8cuda-chain", "kernel": kind, "us": round(us, 1),
              "us_per_layer": round(us / 28, 2), "tbps": round(total / us / 1e6, 3),
              "runs_us": [round(u, 1) for u in v]})
        print(f"| {kind} | {us:.1f} | {us / 28:.2f} | {total / us / 1e6:.3f} |")
    print("\n| shape | triton us | cuda us | x |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['triton_us']} | {r['cuda_us']} ({r['cuda']}) | "
              f"{r['triton_us'] / r['cuda_us']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
