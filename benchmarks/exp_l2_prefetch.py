"""Experiment: L2 prefetch of the next GEMV's weights (`kernels/l2_prefetch.py`) in a chain like
a batch-1 decode step's, on the llama-3.2-3b shapes (H100: run on the device).

    python benchmarks/exp_l2_prefetch.py --out DIR [--caps 0,8,24] [--fp8]

Chains of 28 layers of qkv -> o -> gate_up -> down (CUDA C int4 GEMVs, default tiles, group
128; `--fp8`: the CUDA C FP8 GEMVs), distinct weights per layer, one CUDA graph with PDL, each
GEMV prefetching the next one's scales and codes up to the cap (0: none). Two chains: the
GEMVs alone, and with the Triton add + RMSNorm before qkv and gate_up (the step's gaps
without attention). Every cap twice, interleaved; the minimum is reported. Also checks that
outputs with and without prefetch are equal bit for bit. Writes exp_l2_prefetch.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_gemm import projection_shapes  # noqa: E402  (this folder: sys.path[0])

SHAPES = {k: v for k, v in projection_shapes("llama-3.2-3b").items()  # (N, K)
          if k != "lm_head"}
ORDER = ("qkv", "o", "gate_up", "down")
GROUP = 128
LAYERS = 28


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--caps", default="0,4,8,16,24,32,64", help="MiB per GEMV")
    ap.add_argument("--tails", default="0", help="LLMACCEL_L2_PREFETCH_TAIL values: how many "
                    "of a GEMV's last blocks issue its prefetch (0: all)")
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args()
    from llmaccel.kernels import pdl
    from llmaccel.kernels.l2_prefetch import ranges_of, tail_blocks
    from llmaccel.kernels.rmsnorm import fused_add_rms_norm

    import tune_gemm as tg
    dev = torch.device("cuda")
    use_pdl = pdl.configure(dev, True)
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        lw = {}
        for s in ORDER:
            n, k = SHAPES[s]
            if args.fp8:
                w = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
                lw[s] = (torch.rand(n, 1, device=dev) * 0.01, w)
            else:
                w, sc, _ = tg.make_weights(4, n, k, GROUP, 1, dev)[0]
                lw[s] = (sc, w)
        layers.append(lw)
    flat = [(s, lw[s]) for lw in layers for s in ORDER]
    total_bytes = sum(t.numel() * t.element_size() for _, ts in flat for t in ts)
    xs = {s: torch.randn(1, SHAPES[s][1], device=dev, dtype=torch.bfloat16) for s in ORDER}
    hidden = SHAPES["o"][0]
    res = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    xn = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    nw = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5

    if args.fp8:
        from llmaccel.kernels.gemv_fp8_cuda import fp8_gemv_cuda
        from llmaccel.kernels.gemv_fp8 import quantize_row_fp8

        qx = {s: quantize_row_fp8(xs[s]) for s in ORDER}

        def gemv(s, ts, pf):
            q, sc = qx[s]
            return fp8_gemv_cuda(q, sc, ts[1], ts[0], prefetch=pf)
    else:
        from llmaccel.kernels.gemv_w4_cuda import w4a16_gemv_cuda

        def gemv(s, ts, pf):
            return w4a16_gemv_cuda(xs[s], ts[1], ts[0], None, GROUP, prefetch=pf)

    def chain(cap, norms):
        pfs = [ranges_of(list(flat[(i + 1) % len(flat)][1]), int(cap * 2**20)) if cap else ()
               for i in range(len(flat))]

        def f(_):
            outs = []
            for i, (s, ts) in enumerate(flat):
                if norms and s in ("qkv", "gate_up"):
                    fused_add_rms_norm(xn, res, nw, 1e-5)
                outs.append(gemv(s, ts, pfs[i]))
            return outs
        return f

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fh = open(out / "exp_l2_prefetch.jsonl", "w")
    caps = [float(c) for c in args.caps.split(",")]
    tails = [int(t) for t in args.tails.split(",")]
    # (cap, tail) settings; cap 0 once
    settings = [(0.0, 0)] + [(c, t) for c in caps if c for t in tails]
    # bit-exact: prefetching changes no math
    a = chain(0, False)(0)
    b = chain(max(caps), False)(0)
    torch.cuda.synchronize()
    equal = all(torch.equal(p, q) for p, q in zip(a, b))
    print(f"outputs equal with and without prefetch: {equal}")
    kind = "fp8" if args.fp8 else "int4"
    rows = []
    for norms in (False, True):
        times: dict[tuple, list[float]] = {}
        for _ in range(2):
            for cap, tail in settings:
                os.environ["LLMACCEL_L2_PREFETCH_TAIL"] = str(tail)
                tail_blocks.cache_clear()
                times.setdefault((cap, tail), []).append(tg.time_graph(chain(cap, norms), 1, 1))
        for cap, tail in settings:
            us = min(times[cap, tail])
            rec = {"exp": "l2-prefetch-chain", "weights": kind, "norms": norms, "cap_mib": cap,
                   "tail_blocks": tail,
                   "layers": LAYERS, "us": round(us, 1), "tbps": round(total_bytes / us / 1e6, 3),
                   "runs_us": [round(u, 1) for u in times[cap, tail]], "outputs_equal": equal,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "pdl": use_pdl, "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"),
                   "command": "python benchmarks/exp_l2_prefetch.py" + (" --fp8" if args.fp8
                                                                       else "")}
            fh.write(json.dumps(rec) + "\n")
            rows.append(rec)
    base = {r["norms"]: r["us"] for r in rows if r["cap_mib"] == 0}
    print(f"\n{kind} chain of {LAYERS} layers, {total_bytes / 1e9:.2f} GB, PDL {use_pdl}")
    print("| norms | cap MiB | tail blocks | us | TB/s | x no prefetch |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        x = base.get(r["norms"], r["us"]) / r["us"]
        print(f"| {r['norms']} | {r['cap_mib']:g} | {r['tail_blocks']} | {r['us']} | "
              f"{r['tbps']} | {x:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
