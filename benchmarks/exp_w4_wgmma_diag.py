"""Experiment: where the wgmma W4A16 GEMM's time goes. The best tiles of run 5 at 64 and 128 rows
timed with parts of the main loop switched off (DIAG in csrc/gemm_w4_wgmma.cu: 1 no
dequantization, 2 no x loads in the loop, 4 no wgmma, 8 no barrier; the results are wrong, only
the times count).

    python benchmarks/exp_w4_wgmma_diag.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tune_gemm import projection_shapes, time_graph  # noqa: E402

SHAPES = projection_shapes("llama-3.2-3b")
GROUP = 128
CYCLE_BYTES = 256 * 2**20
TILES = {"qkv": (64, 1, 6, 1), "o": (64, 1, 6, 1), "gate_up": (128, 2, 4, 1),
         "down": (64, 1, 6, 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default="128")
    args = ap.parse_args()
    from llmaccel.kernels.gemm import pack_int4_rows
    from llmaccel.kernels.gemm_w4_wgmma import WgmmaW4Config, w4a16_gemm_wgmma

    dev = torch.device("cuda")
    out = Path(args.out) / "exp_w4_wgmma_diag.jsonl"
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"), "group": GROUP}
    with out.open("w") as f:
        for name, (bm, wgs, stages, split) in TILES.items():
            n, k = SHAPES[name]
            copies = max(2, CYCLE_BYTES // (n * k // 2))
            ws = [pack_int4_rows(torch.randint(0, 16, (n, k), device=dev, dtype=torch.uint8))
                  for _ in range(copies)]
            ss = [(torch.rand(n, k // GROUP, device=dev) * 0.02 + 0.001).to(torch.bfloat16)
                  for _ in range(copies)]
            for m in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                times = {}
                for diag in (0, 1, 2, 4, 8, 3, 7, 15, 12):
                    cfg = WgmmaW4Config(bm, wgs, stages, split, 1, False, diag)
                    times[diag] = round(time_graph(
                        lambda i, c=cfg: w4a16_gemm_wgmma(x, ws[i], ss[i], None, GROUP, None, c),
                        copies), 2)
                rec = {**meta, "shape": name, "m": m, "tile": WgmmaW4Config(
                    bm, wgs, stages, split, 1, False).describe(), "us_by_diag": times}
                f.write(json.dumps(rec) + "\n")
                print(name, m, rec["tile"], times, flush=True)
            del ws, ss
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
