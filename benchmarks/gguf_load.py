"""Seconds to load a GGUF model as the engine does (config, tokenizer, weights: one metadata
parse, torch dequantization, `models/gguf_loading.py`) against transformers' own GGUF loading
(gguf-py), and to convert it to an HF directory (`models/convert.gguf_to_hf_dir`), each in a
fresh process, alternating.

    python benchmarks/gguf_load.py --gguf ~/.cache/shared-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --repeats 2 --out gguf-load-cpu.jsonl
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
if what == "hf-load":  # the baseline: what transformers (with gguf-py) does with the file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = Path(path)
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name,
                                                 dtype=torch.bfloat16)
    n = sum(q.numel() for q in model.parameters())
elif what == "load":
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


def run(what: str, gguf: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-c", CHILD, what, gguf, tmp],
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

    run("load", args.gguf)  # the file into the page cache first (untimed)
    records = []
    for what in args.what.split(","):
        for rep in range(args.repeats):
            # loading: transformers' way, then ours; converting: ours (no baseline)
            for fast in ((False, True) if what == "load" else (True,)):
                t = time.perf_counter()
                seconds = run(what if fast else "hf-load", args.gguf)
                rec = {"name": "gguf-load", "commit": current_commit(), "device": "cpu",
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "config": {"what": what, "gguf": os.path.basename(args.gguf),
                                  "loader": "llmaccel" if fast else "transformers",
                                  "repeat": rep},
                       "metric": "seconds", "value": round(seconds, 2),
                       "process_seconds": round(time.perf_counter() - t, 2)}
                records.append(rec)
                loader = "llmaccel" if fast else "transformers"
                print(f"{what:8s} {loader:12s} {seconds:7.1f} s", flush=True)
                if args.out:
                    append_jsonl(args.out, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
