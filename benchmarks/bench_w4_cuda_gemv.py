"""Experiment: the CUDA C batch-1 W4A16 GEMV (`kernels/gemv_w4_cuda.py`) against the Triton
GEMV (`kernels/gemv_w4.py`, the GPU table's tile) and cuBLAS bf16, on the llama-3.2-3b shapes.

    python benchmarks/bench_w4_cuda_gemv.py --out DIR

1. Per shape: every CUDA tile (rows x chunks) checked against `gemm.linear_ref`, then timed as
   one call inside a replayed CUDA graph of calls cycling through > 256 MB of weights
   (`tune_gemm.time_graph`), with PDL as the engine launches (both kernels).
2. A chain like a decode step's GEMVs: 28 layers of qkv -> o -> gate_up -> down, distinct
   weights per layer, one graph; each kernel's best tile. Prints us per layer and TB/s.
Writes bench_w4_cuda_gemv.jsonl under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tune_gemm import projection_shapes  # noqa: E402  (this folder: sys.path[0])
from llmaccel.bench.results import current_commit

SHAPES = projection_shapes("llama-3.2-3b")  # the layer shapes (N, K) of the 3B model
GROUP = 128
CYCLE_BYTES = 256 * 2**20



def cuda_tiles(k: int):
    from llmaccel.kernels.gemv_w4_cuda import MAX_THREADS, CudaGemvW4Config

    out = []
    for rows, chunks, math in ((2, 1, 0), (4, 1, 0), (1, 1, 1), (2, 1, 1), (3, 1, 1),
                               (4, 1, 1), (6, 1, 1), (8, 1, 1), (4, 2, 1)):
        c = CudaGemvW4Config(rows, chunks, math)
        if c.threads(k) <= MAX_THREADS:
            out.append(c)
    return out


def fused_kwargs(name: str, n: int, k: int, dev) -> dict | None:
    """The fusion DecoderLayer.forward_fused gives this shape (and its input x)."""
    h = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    if name in ("qkv", "gate_up"):
        return {"x": h, "norm_weight": torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
                "eps": 1e-5}
    if name == "o":
        return {"x": h, "residual": torch.randn(1, n, device=dev, dtype=torch.bfloat16)}
    if name == "down":
        return {"x": torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16), "silu": True,
                "residual": torch.randn(1, n, device=dev, dtype=torch.bfloat16)}
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out-table", default=None,
                    help="merge each shape's fastest plain tile into this tuning table as "
                         "w4cuda:1:N:K ('auto': this GPU's file in kernels/configs/)")
    args = ap.parse_args()
    from llmaccel.kernels import pdl
    from llmaccel.kernels.gemm import linear_ref
    from llmaccel.kernels.gemm_tuning import gemv_w4_config
    from llmaccel.kernels.gemv_w4 import default_gemv_w4_config, w4a16_gemv
    from llmaccel.kernels.gemv_w4_cuda import w4a16_gemv_cuda

    import tune_gemm as tg  # run as a script, this folder is on sys.path
    dev = torch.device("cuda")
    use_pdl = pdl.configure(dev, True)
    recs = []
    best = {}
    table: dict = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / "bench_w4_cuda_gemv.jsonl", "w")

    def emit(rec):
        rec.update(device=torch.cuda.get_device_name(), torch=torch.__version__, pdl=use_pdl,
                   commit=current_commit(),
                   command="python benchmarks/bench_w4_cuda_gemv.py")
        fh.write(json.dumps(rec) + "\n")
        fh.flush()
        recs.append(rec)

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        qbytes = n * k // 2 + 2 * n * (k // GROUP)
        copies = max(2, min(96, -(-CYCLE_BYTES // qbytes)))
        ws = tg.make_weights(4, n, k, GROUP, copies, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        dense = tg.make_weights(16, n, k, -1, max(2, min(96, -(-CYCLE_BYTES // (2 * n * k)))), dev)
        cub = tg.time_graph(lambda i: torch.nn.functional.linear(x, dense[i][0]), len(dense),
                            max(24, len(dense)))
        del dense
        tcfg = gemv_w4_config(n, k, GROUP, dev) or default_gemv_w4_config(n, k, GROUP)
        ref = linear_ref(x.float(), ws[0][0], 4, ws[0][1].float(), None, GROUP)
        got = w4a16_gemv(x, ws[0][0], ws[0][1], None, GROUP, config=tcfg).float()
        terr = ((got - ref).norm() / ref.norm()).item()
        tus = tg.time_graph(lambda i: w4a16_gemv(x, ws[i][0], ws[i][1], None, GROUP,
                                                 config=tcfg), copies, max(24, copies))
        emit({"exp": "w4cuda", "shape": name, "n": n, "k": k, "kernel": "triton " +
              tcfg.describe(), "us": round(tus, 2), "gbps": round(qbytes / tus / 1e3),
              "rel_err": terr, "cublas_bf16_us": round(cub, 2)})
        print(f"{name:8} cuBLAS bf16 {cub:7.2f} us | triton {tcfg.describe():18} {tus:7.2f} us "
              f"{qbytes / tus / 1e3:6.0f} GB/s", flush=True)
        timed = []
        for cfg in cuda_tiles(k):
            try:
                got = w4a16_gemv_cuda(x, ws[0][0], ws[0][1], None, GROUP, config=cfg).float()
                torch.cuda.synchronize()
                err = ((got - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    print(f"  {cfg.describe()}: WRONG rel err {err:.3g}")
                    emit({"exp": "w4cuda", "shape": name, "kernel": cfg.describe(),
                          "rel_err": err, "wrong": True})
                    continue
                us = tg.time_graph(lambda i, cfg=cfg: w4a16_gemv_cuda(
                    x, ws[i][0], ws[i][1], None, GROUP, config=cfg), copies, max(24, copies))
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg.describe()}: {type(e).__name__}: {str(e)[:200]}")
                continue
            timed.append((us, cfg))
            emit({"exp": "w4cuda", "shape": name, "n": n, "k": k, "kernel": cfg.describe(),
                  "us": round(us, 2), "gbps": round(qbytes / us / 1e3), "rel_err": err})
            print(f"  {cfg.describe():14} {us:7.2f} us {qbytes / us / 1e3:6.0f} GB/s "
                  f"err {err:.2e}", flush=True)
        bus, bcfg = min(timed, key=lambda t: t[0])
        # asymmetric zeros, and PDL off, on the best tile
        zref = linear_ref(x.float(), ws[0][0], 4, ws[0][1].float(), ws[0][2], GROUP)
        zgot = w4a16_gemv_cuda(x, ws[0][0], ws[0][1], ws[0][2], GROUP, config=bcfg).float()
        zerr = ((zgot - zref).norm() / zref.norm()).item()
        zus = tg.time_graph(lambda i: w4a16_gemv_cuda(x, ws[i][0], ws[i][1], ws[i][2], GROUP,
                                                      config=bcfg), copies, max(24, copies))
        pdl.set_enabled(False)
        nus = tg.time_graph(lambda i: w4a16_gemv_cuda(x, ws[i][0], ws[i][1], None, GROUP,
                                                      config=bcfg), copies, max(24, copies))
        pdl.set_enabled(use_pdl)
        emit({"exp": "w4cuda-best", "shape": name, "n": n, "k": k, "kernel": bcfg.describe(),
              "us": round(bus, 2), "asym_us": round(zus, 2), "asym_rel_err": zerr,
              "no_pdl_us": round(nus, 2), "triton_us": round(tus, 2),
              "speedup_vs_triton": round(tus / bus, 3)})
        print(f"  best {bcfg.describe()} {bus:.2f} us (x{tus / bus:.2f} vs triton); asym "
              f"{zus:.2f} us err {zerr:.2e}; no PDL {nus:.2f} us", flush=True)
        best[name] = (tcfg, bcfg)
        table[f"w4cuda:1:{n}:{k}"] = {"backend": "cuda", "config": bcfg.__dict__,
                                      "us": round(bus, 2), "model": f"llama-3.2-3b:{name}"}
        # the shape's fused decode variant (as DecoderLayer.forward_fused calls it)
        fkw = fused_kwargs(name, n, k, dev)
        if fkw is not None:
            ftimed = []
            for cfg in cuda_tiles(k):
                xin = fkw.pop("x")
                us = tg.time_graph(lambda i, cfg=cfg, xin=xin: w4a16_gemv_cuda(
                    xin, ws[i][0], ws[i][1], None, GROUP, config=cfg, **fkw), copies,
                    max(24, copies))
                fkw["x"] = xin
                ftimed.append((us, cfg))
            fus, fcfg = min(ftimed, key=lambda t: t[0])
            best[name] = (tcfg, bcfg, fcfg)
            emit({"exp": "w4cuda-fused", "shape": name, "n": n, "k": k,
                  "fusion": sorted(kk for kk in fkw if kk != "x"),
                  "tiles": {c.describe(): round(u, 2) for u, c in ftimed},
                  "kernel": fcfg.describe(), "us": round(fus, 2), "plain_us": round(bus, 2)})
            print(f"  fused {sorted(kk for kk in fkw if kk != 'x')}: best {fcfg.describe()} "
                  f"{fus:.2f} us (plain {bus:.2f}); " + " ".join(
                      f"{c.describe()}:{u:.2f}" for u, c in ftimed), flush=True)
        del ws

    # the chain of a step's GEMVs (no LM head)
    chain = [s for s in ("qkv", "o", "gate_up", "down") if s in best]
    if chain:
        layers = []
        for _ in range(28):
            layers.append({s: tg.make_weights(4, *SHAPES[s], GROUP, 1, dev)[0] for s in chain})
        xs = {s: torch.randn(1, SHAPES[s][1], device=dev, dtype=torch.bfloat16) for s in chain}
        total_bytes = 28 * sum(SHAPES[s][0] * SHAPES[s][1] // 2 + 2 * SHAPES[s][0] *
                               SHAPES[s][1] // GROUP for s in chain)

        def run(kind):
            def f(_):
                for lw in layers:
                    for s in chain:
                        w = lw[s]
                        if kind == "triton":
                            w4a16_gemv(xs[s], w[0], w[1], None, GROUP, config=best[s][0])
                        elif kind == "cuda":
                            w4a16_gemv_cuda(xs[s], w[0], w[1], None, GROUP, config=best[s][1])
                        else:  # fused variants (their norm / SiLU kernels are saved)
                            kw = dict(fk[s])
                            xin = kw.pop("x")
                            w4a16_gemv_cuda(xin, w[0], w[1], None, GROUP, config=best[s][-1],
                                            **kw)
            return f

        fk = {s: fused_kwargs(s, *SHAPES[s], dev) for s in chain}
        res = {}
        for kind in ("triton", "cuda", "cuda-fused", "triton", "cuda", "cuda-fused"):
            us = tg.time_graph(run(kind), 1, 1)
            res.setdefault(kind, []).append(us)
        for kind, v in res.items():
            us = min(v)
            emit({"exp": "w4cuda-chain", "kernel": kind, "layers": 28, "shapes": chain,
                  "us": round(us, 1), "us_per_layer": round(us / 28, 2),
                  "tbps": round(total_bytes / us / 1e6, 3), "runs_us": [round(u, 1) for u in v]})
        print("\nchain of 28 layers (" + " -> ".join(chain) + "), PDL " + str(use_pdl))
        print("| kernel | us | us/layer | TB/s |\n|---|---|---|---|")
        for kind, v in res.items():
            us = min(v)
            print(f"| {kind} | {us:.1f} | {us / 28:.2f} | {total_bytes / us / 1e6:.3f} |")
    if args.out_table:
        from llmaccel.kernels.gemm_tuning import write_table

        path = write_table(args.out_table, torch.cuda.get_device_name(), table,
                           torch=torch.__version__,
                           commit=current_commit())
        print(f"wrote {len(table)} w4cuda entries into {path}")
    print("\n| shape | triton us | best cuda | cuda us | x | asym us | no-PDL us |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        if r["exp"] == "w4cuda-best":
            print(f"| {r['shape']} | {r['triton_us']} | {r['kernel']} | {r['us']} | "
                  f"{r['speedup_vs_triton']} | {r['asym_us']} | {r['no_pdl_us']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
