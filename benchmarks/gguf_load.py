"""Seconds to load a GGUF model as the engine does (config, tokenizer, weights) and to convert
it to an HF directory (`models/convert.gguf_to_hf_dir`), with the fast GGUF path
(`models/gguf_loading.py`: one metadata parse, torch dequantization) and without it
(LLMACCEL_FAST_GGUF=0: transformers with gguf-py alone), each in a fresh process, alternating.

    python benchmarks/gguf_load.py --gguf ~/.cache/shared-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --repeats 2 --out benchmarks/results/2026-12-01-s40-gguf-load-cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time, torch
from pathlib import Path
what, path, out = sys.argv[1:4]
t = time.perf_counter()
if what == "load":
    from llmaccel.models.config import make_model_config
    from llmaccel.models.loader import get_model
    from llmaccel.models.tokenizer import get_tokenizer
    mc = make_model_config(path, dtype=torch.bfloat16)
    tok = get_tokenizer(mc)
    model = get_model(mc, "cpu")
    n = sum(p.numel() for p in model.parameters())
else:
    from llmaccel.models.convert import gguf_to_hf_dir
    gguf_to_hf_dir(path, out, torch.bfloat16, return_model=False)
    n = 0
print(json.dumps({"seconds": time.perf_counter() - t, "params": n}))
"""


def run(what: str, gguf: str, fast: bool) -> float:
    env = dict(os.environ, LLMACCEL_FAST_GGUF="1" if fast else "0")
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-c", CHILD, what, gguf, tmp], env=env,
                             capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--what", default="load,convert")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from llmaccel.bench.results import append_jsonl, current_commit

    run("load", args.gguf, True)  # the file into the page cache first (untimed)
    records = []
    for what in args.what.split(","):
        for rep in range(args.repeats):
            for fast in (False, True):
                t = time.perf_counter()
                seconds = run(what, args.gguf, fast)
                rec = {"name": "gguf-load", "commit": current_commit(), "device": "cpu",
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "config": {"what": what, "gguf": os.path.basename(args.gguf),
                                  "fast_gguf": fast, "repeat": rep},
                       "metric": "seconds", "value": round(seconds, 2),
                       "process_seconds": round(time.perf_counter() - t, 2)}
                records.append(rec)
                print(f"{what:8s} fast={fast!s:5s} {seconds:7.1f} s", flush=True)
                if args.out:
                    append_jsonl(args.out, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
