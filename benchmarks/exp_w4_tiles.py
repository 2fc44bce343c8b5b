"""Write a copy of this GPU's tuning table with other batch-1 int4 GEMV tiles for the
llama-3.2-3b shapes, for an end-to-end A/B (point LLMACCEL_GEMM_CONFIGS at the copy and run
gpu_speed.py W1). Isolated GEMV timings (bench_w4_gemv.py) time each call while the previous
GEMV still streams; inside a decode step a GEMV follows a small kernel, so loads it issues
before its PDL wait (the first tile: all of a row with a whole-row tile) overlap idle HBM time.

    python benchmarks/exp_w4_tiles.py OUT.json VARIANT   (VARIANT: see VARIANTS)
"""

from __future__ import annotations

import json
import sys

from llmaccel.kernels.gemm_tuning import CONFIG_DIR, device_file_name

SHAPES = {"qkv": "5120:3072", "o": "3072:3072", "gate_up": "16384:3072", "down": "3072:8192"}
# (block_n, block_k, num_warps, num_stages, vec) per layer; a block_k >= K is a whole row
VARIANTS = {
    "row2": {"qkv": (2, 4096, 2, 2, 4), "o": (2, 4096, 2, 2, 4), "gate_up": (2, 4096, 2, 2, 4),
             "down": (2, 8192, 4, 2, 4)},
    "row4": {"qkv": (4, 4096, 4, 2, 4), "o": (4, 4096, 4, 2, 4), "gate_up": (4, 4096, 4, 2, 4),
             "down": (4, 8192, 8, 2, 4)},
    "row2-narrow": {"o": (2, 4096, 2, 2, 4), "down": (2, 8192, 4, 2, 4)},
    "half-narrow": {"o": (4, 2048, 2, 2, 4), "down": (4, 4096, 4, 2, 4)},
}


def main(out: str, variant: str, device: str = "NVIDIA H100 80GB HBM3") -> None:
    table = json.loads((CONFIG_DIR / device_file_name(device)).read_text())
    for layer, (bn, bk, nw, ns, vec) in VARIANTS[variant].items():
        key = f"w4gemv:1:{SHAPES[layer]}"
        table["entries"][key] = {"backend": "triton", "model": f"llama-3.2-3b:{layer}",
                                 "config": {"block_n": bn, "block_k": bk, "num_warps": nw,
                                            "num_stages": ns, "vec": vec}}
    with open(out, "w") as f:
        json.dump(table, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
