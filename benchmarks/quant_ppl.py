"""W6 for the quantization formats: WikiText-2 test perplexity of a model unquantized and
quantized by each method, every checkpoint measured through our engine the same way
(`llmaccel.eval.perplexity`: context 2048, stride 2048, rows joined as `datasets` does).

    python benchmarks/quant_ppl.py --model ../models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --name smollm2-135m [--methods bf16,rtn-int8,...] [--limit N] --out benchmarks/results

A GGUF source is first converted to an HF safetensors directory (transformers dequantizes it:
the "bf16" row is the GGUF's own weights, which for a Q4 file are already 4-bit values) and
every method quantizes that directory. Writes <out>/<date>-W6-quant-<name>.jsonl (metric
`ppl`, `config.quantization` in BENCHMARKS.md's names) and a markdown table with each format's
increase over bf16 and, for GPTQ/AWQ, the share of RTN-int4's increase they recover.
Group-128 schemes fall back to the largest group that tiles every layer (SmolLM2's 576-wide
rows take 64) and say so in the record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from llmaccel.quant.schemes import SCHEMES as METHODS
from llmaccel.quant.schemes import fitting_group, hf_source, quantize_scheme  # noqa: F401

ALL = ("bf16", *METHODS)


def run(args: argparse.Namespace, command: str) -> tuple[Path, Path, list[dict]]:
    from llmaccel.bench.results import current_commit
    from llmaccel.eval.perplexity import evaluate_perplexity
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    src = hf_source(args.model, work)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    records: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-W6-quant-{args.name}"
    jsonl, md = out / f"{stem}.jsonl", out / f"{stem}.md"
    for name in args.methods:
        config = {"quantization": name, "context": args.context, "stride": args.context,
                  "joining": "hf", "data": "wikitext2 test", "dtype": dtype, "source": args.model,
                  "limit_windows": args.limit}
        t0 = time.perf_counter()
        if name == "bf16":
            path = src
        else:
            done = quantize_scheme(src, name, work / f"{args.name}-{name}", device=device,
                                   n_samples=args.n_samples, seq_len=args.seq_len,
                                   sink_weight=args.sink_weight, act_order=args.act_order)
            path = done.path
            config.update(done.config)
        res = evaluate_perplexity(str(path), context=args.context, limit=args.limit,
                                  dtype=dtype, device=device)
        config.update({"scored_tokens": res.scored_tokens, "windows": res.windows,
                       "nll": round(res.nll, 6), "seconds": round(time.perf_counter() - t0, 1)})
        rec = {"workload": "W6", "model": args.name, "load_format": "safetensors",
               "backend": "llmaccel", "config": config, "metric": "ppl",
               "value": round(res.ppl, 4), "device": gpu, "torch": torch.__version__,
               "commit": current_commit(), "command": command}
        records.append(rec)
        print(f"{args.name} {name:>16}: ppl {res.ppl:.4f} ({res.scored_tokens:,} tokens, "
              f"{config['seconds']:.0f}s)", flush=True)
        # after every format: a run cut short still leaves the formats it finished
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
        md.write_text(markdown(records, command))
    return jsonl, md, records


def markdown(records: list[dict], command: str) -> str:
    """The table, with ratios computed from the records."""
    by = {r["config"]["quantization"]: r for r in records}
    base = by.get("bf16", {}).get("value")
    rtn4 = by.get("rtn-int4-g128", {}).get("value")
    first = records[0] if records else {}
    lines = [f"# W6 perplexity by quantization format: {first.get('model')}", "",
             f"Device: {first.get('device')}; torch {first.get('torch')}; commit "
             f"`{first.get('commit')}`. Command: `{command}`", "",
             "WikiText-2 test, context = stride = "
             f"{first.get('config', {}).get('context')}, rows joined with a blank line "
             "(`datasets`' recipe), through our engine. Lower is better.", "",
             "| format | ppl | vs bf16 | share of RTN-int4's increase recovered | group | note |",
             "|---|---|---|---|---|---|"]
    for name, r in by.items():
        c = r["config"]
        delta = f"{(r['value'] / base - 1) * 100:+.2f}%" if base else "–"
        rec = "–"
        if base and rtn4 and name.startswith(("gptq", "awq")) and rtn4 > base:
            rec = f"{(rtn4 - r['value']) / (rtn4 - base) * 100:.0f}%"
        lines.append(f"| {name} | {r['value']:.4f} | {delta} | {rec} | "
                     f"{c.get('group_size', '–')} | {c.get('note', '')} |")
    if first.get("config", {}).get("limit_windows"):
        lines += ["", f"**Partial: the first {first['config']['limit_windows']} windows only.**"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or an HF directory")
    ap.add_argument("--name", required=True, help="short model name for the records")
    ap.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m], default=list(ALL))
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None, help="windows per format (partial)")
    ap.add_argument("--n-samples", type=int, default=128, help="GPTQ/AWQ calibration sequences")
    ap.add_argument("--seq-len", type=int, default=2048, help="calibration sequence length")
    ap.add_argument("--act-order", action="store_true",
                    help="act-order (desc_act) for the gptq-int4-g128 row too")
    ap.add_argument("--sink-weight", type=float, default=None,
                    help="GPTQ: Hessian weight of each calibration sequence's first token "
                         "(default seq_len / 64; 1 = plain GPTQ)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--work", default="runs/quant_ppl", help="converted and quantized models")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    bad = [m for m in args.methods if m not in ALL]
    if bad:
        ap.error(f"unknown methods {bad}; choose from {', '.join(ALL)}")
    jsonl, md, _ = run(args, "python benchmarks/quant_ppl.py " + shlex.join(argv))
    print(md)
    print(f"wrote {jsonl} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
