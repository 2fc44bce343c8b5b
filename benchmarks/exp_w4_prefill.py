"""Experiment: the Triton W4A16 GEMM (`kernels/gemm.py`) at prefill sizes against cuBLAS bf16
on the llama-3.2-3b shapes, with the weight tile dequantized in fp32 (as before) or in the
activation dtype (`GemmConfig.deq16`), over a grid of tiles.

    python benchmarks/exp_w4_prefill.py --out DIR [--m 128,512] [--out-table auto]

Every timing replays a CUDA graph of calls cycling through > 256 MB of weights
(`tune_gemm.time_graph`). Each deq16 tile's output is checked equal, bit for bit, to the same
tile dequantized in fp32. With --out-table, a shape's fastest tile replaces the table's
"4:M:N:K" entry where it beat it in this run. Writes exp_w4_prefill.jsonl under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072),
          "down": (3072, 8192)}
GROUP = 128
CYCLE_BYTES = 256 * 2**20


def _tg():
    spec = importlib.util.spec_from_file_location(
        "tune_gemm", Path(__file__).with_name("tune_gemm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiles():
    from llmaccel.kernels.gemm import GemmConfig

    for bm, bn, bk, w, st in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8),
                                               (3, 4)):
        if bm * bn > 128 * 128 and w == 4:
            continue  # too many accumulator registers per thread
        yield GemmConfig(bm, bn, bk, True, w, st)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--m", default="128")
    ap.add_argument("--out-table", default=None)
    args = ap.parse_args()
    from dataclasses import replace

    from llmaccel.kernels.gemm import pack_int4_rows, triton_linear
    from llmaccel.kernels.gemm_tuning import lookup, write_table

    tg = _tg()
    dev = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recs, table = [], {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, CYCLE_BYTES // (n * k // 2))
        ws = []
        for i in range(copies):
            g = torch.Generator().manual_seed(i)
            codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            scales = (torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
            zeros = torch.randint(0, 16, (n, k // GROUP), generator=g, dtype=torch.uint8)
            ws.append((pack_int4_rows(codes).to(dev), scales.to(dev), zeros.to(dev)))
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                 for _ in range(max(2, CYCLE_BYTES // (n * k * 2)))]
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cub = tg.time_graph(lambda i: torch.nn.functional.linear(x, dense[i]), len(dense))
            hit = lookup(4, m, n, k, dev)
            table_cfg = hit[1] if hit is not None else None

            def run(cfg, i=0):
                w, s, z = ws[i]
                return triton_linear(x, w, 4, s, z, GROUP, config=cfg)

            table_us = tg.time_graph(lambda i: run(table_cfg, i), copies) if table_cfg else None
            best = {}
            for cfg in tiles():
                for deq in (False, True):
                    c = replace(cfg, deq16=deq)
                    try:
                        us = tg.time_graph(lambda i: run(c, i), copies)
                    except Exception as e:  # out of shared memory / registers: skip the tile
                        print(f"  {c.describe()}: {type(e).__name__}")
                        continue
                    if deq and not torch.equal(run(c), run(cfg)):
                        print(f"  {c.describe()}: NOT EQUAL to its fp32 dequantization")
                        continue
                    if deq not in best or us < best[deq][1]:
                        best[deq] = (c, us)
            rec = {"shape": name, "n": n, "k": k, "m": m, "cublas_bf16_us": round(cub, 2),
                   "table": table_cfg.describe() if table_cfg else None,
                   "table_us": round(table_us, 2) if table_us else None,
                   "best_fp32_deq": best[False][0].describe(),
                   "best_fp32_deq_us": round(best[False][1], 2),
                   "best_deq16": best[True][0].describe() if True in best else None,
                   "best_deq16_us": round(best[True][1], 2) if True in best else None,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "commit": os.environ.get("LLMACCEL_COMMIT", "unknown")}
            recs.append(rec)
            print(json.dumps(rec), flush=True)
            winner = min(best.values(), key=lambda t: t[1])
            if table_us is None or winner[1] < table_us:
                table[f"4:{m}:{n}:{k}"] = {
                    "backend": "triton", "config": winner[0].__dict__,
                    "triton_us": round(winner[1], 2), "cublas_bf16_us": round(cub, 2)}
    with open(out / "exp_w4_prefill.jsonl", "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    if args.out_table and table:
        path = write_table(args.out_table, torch.cuda.get_device_name(), table,
                           torch=torch.__version__,
                           commit=os.environ.get("LLMACCEL_COMMIT", "unknown"))
        print(f"wrote {len(table)} entries into {path}")
    print("\n| shape | M | cuBLAS bf16 us | table tile us | best fp32-dequant us | best deq16 us |")
    print("|---|---|---|---|---|---|")
    for r in recs:
        print(f"| {r['shape']} | {r['m']} | {r['cublas_bf16_us']} | {r['table_us']} "
              f"({r['table']}) | {r['best_fp32_deq_us']} ({r['best_fp32_deq']}) | "
              f"{r['best_deq16_us']} ({r['best_deq16']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
