"""Step-cost curve for speculative decoding (W5): the GPU time of one captured decode
graph over B x q rows -- B sequences each verifying q tokens (the last one and q - 1 drafts) --
against B x 1 rows (a plain decode step), on named shapes with random weights.

    python benchmarks/spec_step_cost.py --shapes llama-3.2-3b,qwen2.5-1.5b,qwen2.5-0.5b \\
        --batches 1,4,16,64 --k 4 --name W5-step-cost-h100 --out results
    python benchmarks/spec_step_cost.py --shapes qwen2.5-1.5b,qwen2.5-0.5b \\
        --quantization bf16,gptq-int4-g128,fp8 ...     # quantized targets (the draft in bf16)

The engine runs a verify step exactly this way (ModelRunner gives each token its own decode
row, padded up to the next captured size), so these are the step costs speculation pays. Each
row attends over `--context` earlier tokens plus its own position. Records: `step_time_ms`
per (shape, batch, tokens per sequence), with the graph's padded row count, and
`verify_cost_ratio` = time(B x (k + 1)) / time(B x 1) per (shape, batch). With two shapes that
form a draft pair, the table also shows c = draft decode / target decode at each batch.
`--quantization` times every shape but the last (the draft, kept in bf16) in each scheme
(llmaccel.quant.presets names, dummy codes): a quantized target's verify step may take other
kernels than its decode step (the batch-1 GEMVs serve one row only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llmaccel.bench.results import current_commit
from llmaccel import LLM
from llmaccel.bench.engine_runs import EngineSettings, engine_kwargs
from llmaccel.engine.cuda_graph import default_capture_sizes, replay_ms


def _time_graph(runner, rows: int, context: int, batch: int, q: int,
                iters: int) -> tuple[float, int]:
    """Stage B x q decode rows (row j of sequence b at position context + j, over its own
    blocks) and time replays of the graph that serves them; returns (ms, padded rows)."""
    graphs = runner.graphs
    bs = runner.block_size
    width = -(-(context + q) // bs)
    ids, positions, slots, seq_lens, tables = [], [], [], [], []
    for b in range(batch):
        table = list(range(b * width, (b + 1) * width))
        for j in range(q):
            p = context + j
            ids.append(1000 + b + j)
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            seq_lens.append(p + 1)
            tables.append(table)
    graphs.run(ids, positions, slots, seq_lens, tables)
    padded = min(s for s in graphs.sizes if s >= rows)
    return replay_ms(graphs.graphs[padded], iters, warmup=5), padded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama-3.2-3b")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--k", type=int, default=4, help="drafts per step: q runs 1 .. k + 1")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--name", default="W5-step-cost")
    ap.add_argument("--out", default=".")
    ap.add_argument("--quantization", default="bf16",
                    help="comma-separated schemes for the target shapes (bf16: unquantized)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("spec_step_cost times CUDA graphs: it needs a GPU")
    batches = [int(b) for b in args.batches.split(",")]
    qs = list(range(1, args.k + 2))
    rows_needed = sorted({b * q for b in batches for q in qs})
    commit = current_commit()
    command = "python benchmarks/spec_step_cost.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    device = torch.cuda.get_device_name()
    records, times = [], {}
    names = args.shapes.split(",")
    schemes = args.quantization.split(",")
    # (row label, shape, scheme): every target shape in every scheme; the draft (the last of
    # two or more shapes) in bf16 only
    runs = [(n if q == "bf16" else f"{n} [{q}]", n, q)
            for n in (names[:-1] if len(names) >= 2 else names) for q in schemes]
    if len(names) >= 2:
        runs.append((names[-1], names[-1], "bf16"))
    for label, shape, scheme in runs:
        quant = {} if scheme == "bf16" else {"quantization": scheme}
        # the engine's default capture sizes up to the largest step, as a verify step uses them
        llm = LLM(shape, **engine_kwargs(EngineSettings(**quant), 2048, {
            "max_num_seqs": max(rows_needed),
            "cudagraph_capture_sizes": default_capture_sizes(max(rows_needed))}))
        runner = llm.engine.runner
        for b in batches:
            for q in qs:
                ms, padded = _time_graph(runner, b * q, args.context, b, q, args.iters)
                times[label, b, q] = ms
                records.append({
                    "workload": "W5", "model": shape, "load_format": "dummy",
                    "backend": "llmaccel",
                    "config": {"batch": b, "tokens_per_seq": q, "rows": b * q,
                               "graph_rows": padded, "context": args.context,
                               "dtype": "bfloat16", **quant},
                    "metric": "step_time_ms", "value": round(ms, 4), "device": device,
                    "torch": torch.__version__, "commit": commit, "command": command})
            ratio = times[label, b, args.k + 1] / times[label, b, 1]
            records.append({
                "workload": "W5", "model": shape, "load_format": "dummy", "backend": "llmaccel",
                "config": {"batch": b, "k": args.k, "context": args.context, **quant},
                "metric": "verify_cost_ratio", "value": round(ratio, 4), "device": device,
                "torch": torch.__version__, "commit": commit, "command": command})
        del llm, runner
        torch.cuda.empty_cache()
    shapes = [label for label, _, _ in runs]
    head = "| shape | batch | " + " | ".join(f"q={q} ms" for q in qs) + " | verify/decode |"
    lines = [head, "|" + "---|" * (len(qs) + 3)]
    for shape in shapes:
        for b in batches:
            cells = " | ".join(f"{times[shape, b, q]:.3f}" for q in qs)
            lines.append(f"| {shape} | {b} | {cells} | "
                         f"{times[shape, b, args.k + 1] / times[shape, b, 1]:.2f} |")
    table = "\n".join(lines)
    if len(names) >= 2:
        # c for a pair: the last shape drafting for each earlier one (in each scheme)
        draft = shapes[-1]
        pair = ["", "| target | draft | batch | c = draft decode / target decode |",
                "|---|---|---|---|"]
        for target in shapes[:-1]:
            for b in batches:
                pair.append(f"| {target} | {draft} | {b} | "
                            f"{times[draft, b, 1] / times[target, b, 1]:.3f} |")
        table += "\n" + "\n".join(pair)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{args.name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    (out / f"{args.name}.md").write_text(
        f"# {args.name}\n\nDevice: {device}. Command: `{command}`\n\nGPU time per replay of "
        f"the captured decode graph (mean of {args.iters}), random weights (bf16, or the "
        f"scheme in brackets), context "
        f"{args.context}; q = tokens per sequence (1: plain decode; k + 1: a verify step).\n\n"
        f"{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
