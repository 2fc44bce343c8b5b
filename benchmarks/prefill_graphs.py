"""Small prefill steps as decode-graph rows vs the eager prefill path: the wall time of a
prefill-only generate call (max_tokens 1, so about the TTFT of a batch arriving together),
side by side on one engine, by batch and prompt length (random token ids, prefix caching off).

    python benchmarks/prefill_graphs.py --models qwen2.5-1.5b,qwen2.5-0.5b --batches 1,4,16 \
        --tokens 32,128,512 --out benchmarks/results --name prefill-graphs-h100

`eager` sets the runner's budget to 0 (ModelRunner.prefill_rows_kv_bytes); `graph-rows` keeps
the default, so a cell that exceeds it runs eagerly in both columns (`path` says which ran).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from llmaccel import LLM, SamplingParams


def _wall_ms(llm, prompts, params, repeats: int) -> float:
    for _ in range(2):  # warm-up: Triton compiles the eager path's shapes on first use
        llm.generate(prompts, params, use_tqdm=False)
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(1000 * (time.perf_counter() - start))
    return statistics.median(walls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-1.5b")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--tokens", default="32,128,512")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--name", default="prefill-graphs")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    command = "python benchmarks/prefill_graphs.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    records, rows = [], []
    for model in args.models.split(","):
        llm = LLM(model, dtype=args.dtype, max_model_len=4096, enable_prefix_caching=False)
        runner = llm.engine.runner
        budget = runner.prefill_rows_kv_bytes
        gen = torch.Generator().manual_seed(0)
        for b in [int(x) for x in args.batches.split(",")]:
            for t in [int(x) for x in args.tokens.split(",")]:
                prompts = [{"prompt_token_ids": torch.randint(
                    100, 20000, (t,), generator=gen).tolist()} for _ in range(b)]
                chosen = []
                decide = runner._small_step_as_rows
                runner._small_step_as_rows = lambda step: chosen.append(decide(step)) or chosen[-1]
                runner.prefill_rows_kv_bytes = budget
                graph_ms = _wall_ms(llm, prompts, params, args.repeats)
                path = "graph-rows" if chosen and all(chosen) else (
                    "eager" if not any(chosen) else "mixed")
                runner.prefill_rows_kv_bytes = 0
                eager_ms = _wall_ms(llm, prompts, params, args.repeats)
                del runner._small_step_as_rows
                for mode, ms in (("graph-rows", graph_ms), ("eager", eager_ms)):
                    records.append({
                        "workload": "prefill", "model": model, "load_format": "dummy",
                        "backend": "llmaccel",
                        "config": {"batch": b, "prompt_tokens": t, "max_tokens": 1,
                                   "prefill": mode, "path": path if mode == "graph-rows"
                                   else "eager", "dtype": args.dtype,
                                   "prefill_rows_kv_bytes": budget if mode == "graph-rows"
                                   else 0},
                        "metric": "ttft_ms_p50", "value": round(ms, 3), "device": device,
                        "torch": torch.__version__,
                        "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"),
                        "command": command})
                rows.append(f"| {model} | {b} | {t} | {path} | {graph_ms:.2f} | "
                            f"{eager_ms:.2f} | {eager_ms / graph_ms:.2f} |")
                print(rows[-1], flush=True)
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    table = ("| model | batch | prompt tokens | path | default ms | eager ms | eager / default |\n"
             "|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    (out / f"{args.name}.md").write_text(
        f"# {args.name}\n\nDevice: {device}. Command: `{command}`\n\nMedian wall of a "
        f"prefill-only generate call (max_tokens 1) of `batch` random prompts.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
