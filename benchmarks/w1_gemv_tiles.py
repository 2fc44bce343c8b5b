"""Experiment: W1 on the llama-3.2-3b shape with other tiles for the batch-1 CUDA C int4 GEMV
(`kernels/gemv_w4_cuda.py`), one engine process per variant, all in one call on one GPU.

    python benchmarks/w1_gemv_tiles.py --out DIR --name TAG \
        "base:" "qkv10:qkv=r4c1b10" "fit:qkv=r4c1b10,down=r4c1b6,gate_up=r6c1b11"

A variant is NAME:LAYER=TILE,...: LAYER is qkv, o, gate_up, down or lm_head; TILE is r<rows>c<chunks>
and optionally b<min blocks per SM> (the .cu's MIN_BLOCKS). Each variant's table is this
GPU's table plus those "w4cuda:1:N:K" entries (LLMACCEL_GEMM_CONFIGS), and its W1 records go
to DIR/W1-TAG-NAME.jsonl (gpu_speed.py, int4 + int4 head). `--bf16` adds a bf16 run first.
Isolated sweeps (`exp_w4_cuda.py`) time one GEMV with nothing before it; in a decode step the
grid's waves and what runs beside it matter, so tiles are compared here, in the workload.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SHAPES = {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072),
          "down": (3072, 8192), "lm_head": (128256, 3072)}


def parse_tile(text: str) -> dict:
    m = re.fullmatch(r"r(\d+)c(\d+)(?:b(\d+))?", text)
    if m is None:
        raise SystemExit(f"bad tile {text!r}: want r<rows>c<chunks>[b<min blocks>]")
    return {"rows": int(m[1]), "chunks": int(m[2]), "math": 1, "min_blocks": int(m[3] or 0)}


def table_for(base: dict, spec: str) -> dict:
    table = json.loads(json.dumps(base))
    entries = table.setdefault("entries", {})
    for part in filter(None, spec.split(",")):
        layer, tile = part.split("=")
        n, k = SHAPES[layer]
        entries[f"w4cuda:1:{n}:{k}"] = {"backend": "cuda", "config": parse_tile(tile)}
    return table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--quantization", default="gptq-int4-g128-lm-head")
    args = ap.parse_args()
    import torch

    from llmaccel.kernels.gemm_tuning import table_path
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base_path = table_path(torch.device("cuda"))
    base = json.loads(base_path.read_text()) if base_path and base_path.exists() else {}
    here = Path(__file__).resolve().parent
    runs = ([("bf16", None, "bf16")] if args.bf16 else []) + [
        (v.split(":", 1)[0], v.split(":", 1)[1], args.quantization) for v in args.variants]
    for name, spec, quant in runs:
        env = dict(os.environ)
        if spec is not None:
            path = out / f"table-{name}.json"
            path.write_text(json.dumps(table_for(base, spec)))
            env["LLMACCEL_GEMM_CONFIGS"] = str(path)
        stem = f"W1-{args.name}-{name}"
        subprocess.run([sys.executable, str(here / "gpu_speed.py"), "--workloads", "W1",
                        "--shapes", "llama-3.2-3b", "--backends", "llmaccel",
                        "--quantization", quant, "--repeats", str(args.repeats), "--out",
                        str(out), "--name", stem, "--variant", name], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=False)
        (out / f"{stem}.md").unlink(missing_ok=True)
        if spec is not None:
            (out / f"table-{name}.json").unlink(missing_ok=True)
        recs = [json.loads(line) for line in (out / f"{stem}.jsonl").read_text().splitlines()
                ] if (out / f"{stem}.jsonl").exists() else []
        got = {r["metric"]: r["value"] for r in recs}
        print(f"{name:12s} {spec or '':45s} tok_s {got.get('tok_s', float('nan')):8.1f} "
              f"decode {got.get('decode_tok_s', float('nan')):8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
