"""A copy of a GEMV tuning table with some batch-1 tiles replaced, to time whole decode steps
on other tiles (LLMACCEL_GEMM_CONFIGS=OUT python benchmarks/exp_norm_tail.py ...). The per-layer
tuners time one GEMV in a chain of the same GEMV; in a step each GEMV follows a small
latency-bound kernel, behind which a tile that loads its whole weight slice before the PDL
wait can hide its reads. An experiment, not a tuner.

    python benchmarks/exp_step_tiles.py --out /tmp/t.json --w4 3072:3072=4,4096,4,2,4
"""

from __future__ import annotations

import argparse
import json

from llmaccel.kernels.gemm_tuning import CONFIG_DIR


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=str(CONFIG_DIR / "NVIDIA_H100_80GB_HBM3.json"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--w4", action="append", default=[],
                    help="N:K=block_n,block_k,num_warps,num_stages,vec")
    ap.add_argument("--fp8", action="append", default=[],
                    help="N:K=block_n,block_k,num_warps,num_stages,prequant(0/1)")
    args = ap.parse_args()
    table = json.load(open(args.base))
    for prefix, specs, names in (("w4gemv", args.w4, ("block_n", "block_k", "num_warps",
                                                     "num_stages", "vec")),
                                 ("fp8gemv", args.fp8, ("block_n", "block_k", "num_warps",
                                                       "num_stages", "prequant"))):
        for spec in specs:
            shape, values = spec.split("=")
            config = dict(zip(names, (int(v) for v in values.split(","))))
            if "prequant" in config:
                config["prequant"] = bool(config["prequant"])
            key = f"{prefix}:1:{shape}"
            table["entries"][key] = {**table["entries"].get(key, {"backend": "triton"}),
                                     "config": config}
            print(key, config)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
