"""Small prefill steps as decode-graph rows vs the eager prefill path: the wall time of a
prefill-only generate call (max_tokens 1: about the TTFT of a batch arriving together), side by
side on one engine, by batch, new tokens per prompt, cached context before them, and the
runner's K/V-read budget for running a step as rows (ModelRunner.prefill_rows_kv_bytes; 0
runs every prefill eagerly). Random token ids; each timed call has fresh new tokens, so only
the context (cached once per cell, one per sequence) hits the prefix cache.

    python benchmarks/prefill_graphs.py --models qwen2.5-1.5b --batches 1,4,16 \
        --tokens 32,128,512 --contexts 0,512 --budgets-mib 0,32,128 --out benchmarks/results

`path` says what ran under each budget: graph-rows, eager, or mixed (some steps each). Runs of
at most 16 new tokens per sequence are decode rows under any budget (DECODE_ROWS_MAX).
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


def _prompts(gen, context: list[list[int]], tokens: int) -> list[dict]:
    return [{"prompt_token_ids": ctx + torch.randint(100, 20000, (tokens,),
                                                     generator=gen).tolist()}
            for ctx in context]


def _wall_ms(llm, make, params, repeats: int) -> float:
    for _ in range(2):  # warm-up: Triton compiles the eager path's shapes on first use
        llm.generate(make(), params, use_tqdm=False)
    walls = []
    for _ in range(repeats):
        prompts = make()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(1000 * (time.perf_counter() - start))
    return statistics.median(walls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen2.5-1.5b")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--tokens", default="32,128,512")
    ap.add_argument("--contexts", default="0", help="cached tokens before the new ones "
                    "(multiples of the block size hit the prefix cache whole)")
    ap.add_argument("--budgets-mib", default="0,32", help="K/V bytes per layer a step's rows "
                    "may read (MiB; 0: eager)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--name", default="prefill-graphs")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    command = "python benchmarks/prefill_graphs.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    budgets = [int(x) for x in args.budgets_mib.split(",")]
    records, rows = [], []
    for model in args.models.split(","):
        llm = LLM(model, dtype=args.dtype, max_model_len=4096, enable_prefix_caching=True)
        runner = llm.engine.runner
        # which path each step took: a graph replay (decode rows) or the eager forward
        chosen: list[bool] = []
        execute, replay = runner.execute, runner.graphs.run

        def counted_execute(*a, **kw):
            chosen.append(False)
            return execute(*a, **kw)

        def counted_replay(*a, **kw):
            chosen[-1] = True
            return replay(*a, **kw)

        runner.execute, runner.graphs.run = counted_execute, counted_replay
        gen = torch.Generator().manual_seed(0)
        for ctx_len in [int(x) for x in args.contexts.split(",")]:
            for b in [int(x) for x in args.batches.split(",")]:
                context = [torch.randint(100, 20000, (ctx_len,), generator=gen).tolist()
                           for _ in range(b)]
                if ctx_len:
                    llm.generate([{"prompt_token_ids": c} for c in context], params,
                                 use_tqdm=False)
                for t in [int(x) for x in args.tokens.split(",")]:
                    cells = []
                    for mib in budgets:
                        runner.prefill_rows_kv_bytes = mib << 20
                        chosen.clear()
                        ms = _wall_ms(llm, lambda: _prompts(gen, context, t), params,
                                      args.repeats)
                        path = ("graph-rows" if chosen and all(chosen) else
                                "eager" if not any(chosen) else "mixed")
                        cells.append((ms, path))
                        records.append({
                            "workload": "prefill", "model": model, "load_format": "dummy",
                            "backend": "llmaccel",
                            "config": {"batch": b, "prompt_tokens": t, "context": ctx_len,
                                       "max_tokens": 1, "prefill_rows_kv_mib": mib,
                                       "path": path, "dtype": args.dtype},
                            "metric": "ttft_ms_p50", "value": round(ms, 3), "device": device,
                            "torch": torch.__version__,
                            "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"),
                            "command": command})
                    rows.append(f"| {model} | {b} | {ctx_len} | {t} | " + " | ".join(
                        f"{ms:.2f} ({path})" for ms, path in cells) + " |")
                    print(rows[-1], flush=True)
        del llm, runner
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    head = " | ".join(f"budget {m} MiB: ms (path)" for m in budgets)
    table = (f"| model | batch | cached context | new tokens | {head} |\n"
             f"|---|---|---|---|{'---|' * len(budgets)}\n" + "\n".join(rows))
    (out / f"{args.name}.md").write_text(
        f"# {args.name}\n\nDevice: {device}. Command: `{command}`\n\nMedian wall of a "
        f"prefill-only generate call (max_tokens 1) of `batch` prompts; budget 0 MiB runs "
        f"every prefill eagerly.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
