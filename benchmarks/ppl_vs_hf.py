"""W6 cross-check: WikiText-2 test perplexity of one model through our engine and through
transformers (`AutoModelForCausalLM`, its own loss), over the same windows of the same token ids
(eval/perplexity.py, eval/hf_perplexity.py). Both in fp32 on CPU unless told otherwise.

    python benchmarks/ppl_vs_hf.py [--model PATH] [--name smollm2-135m] [--context 2048]
        [--stride N] [--limit N] [--device cpu] [--dtype float32] [--out benchmarks/results]

The default model is SmolLM2-135M-Instruct (GGUF Q4_1; both sides dequantize it the same way
through transformers' GGUF reader), from ../shared/models/fetch or llmaccel's own cache. Writes
<out>/<date>-W6-ppl-vs-hf-<name>.jsonl (BENCHMARKS.md records, metric `ppl`, backends
`llmaccel` and `hf-eager`) and a markdown summary stating the relative difference, computed from
the records' NLLs, and whether it is within 0.1%.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FETCH = REPO.parent / "shared" / "models" / "fetch"
TOLERANCE_PCT = 0.1  # the agreement asked of the two backends
OURS, HF = "llmaccel", "hf-eager"


def default_model() -> str:
    """SmolLM2's GGUF: ../shared/models/fetch (verified, cached), else llmaccel's own copy."""
    if FETCH.exists():
        out = subprocess.run(["bash", str(FETCH), "smollm2-135m-instruct"], capture_output=True,
                             text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[-1]
    from llmaccel.models.default_model import default_model_path

    return str(default_model_path())


def relative_difference_pct(records: list) -> float | None:
    """(ppl_hf / ppl_ours - 1) in percent, from the records' NLLs (full precision: the records'
    values are rounded)."""
    nll = {r.backend: r.config["nll"] for r in records}
    if OURS not in nll or HF not in nll:
        return None
    return (math.exp(nll[HF] - nll[OURS]) - 1) * 100


def markdown(records: list, command: str) -> str:
    first = records[0]
    c = first.config
    lines = [f"# W6 perplexity, our engine against transformers: {first.model}", "",
             f"Device: {first.device}; torch {first.torch}; commit `{first.commit}`. "
             f"Command: `{command}`", "",
             f"WikiText-2 test, context {c['context']}, stride {c['stride']}, rows joined: "
             f"{c['joining']}; {c['dtype']} on {c['device']}. The same token ids (one "
             "tokenizer) and the same windows on both sides; transformers' number is its own "
             "loss (labels -100 outside the scored tokens). Lower is better.", "",
             "| backend | ppl | nll (nats/token) | scored tokens | windows | seconds |",
             "|---|---|---|---|---|---|"]
    for r in records:
        # exp(nll): the record's value is rounded to 3 decimals
        lines.append(f"| {r.backend} | {math.exp(r.config['nll']):.4f} | {r.config['nll']:.6f} | "
                     f"{r.config['scored_tokens']:,} | {r.config['windows']} | "
                     f"{r.config['seconds']:.0f} |")
    rel = relative_difference_pct(records)
    if rel is not None:
        verdict = "yes" if abs(rel) <= TOLERANCE_PCT else "NO"
        lines += ["", f"- relative difference ({HF} / {OURS} - 1, from the NLLs): {rel:+.4f}%",
                  f"- within {TOLERANCE_PCT}%: {verdict}"]
    if c.get("limit"):
        lines += ["", f"**Partial: the first {c['limit']} windows only.**"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, command: str) -> tuple[Path, Path, list]:
    from llmaccel.bench.results import RunMeta, current_commit, make_record, write_jsonl
    from llmaccel.eval.hf_perplexity import hf_perplexity, load_hf_causal_lm
    from llmaccel.eval.perplexity import load_eval_text, perplexity, tokenize_eval_text
    from llmaccel.models.config import make_model_config
    from llmaccel.models.loader import get_model

    device = torch.device(args.device or "cpu")
    model = args.model or default_model()
    mc = make_model_config(model, dtype=args.dtype, max_model_len=args.context, device=device)
    text, _ = load_eval_text("wikitext2", "hf")
    token_ids = tokenize_eval_text(mc, text)  # one tokenizer, one list: both backends read it
    stride = args.stride or args.context
    meta = RunMeta(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   torch=torch.__version__, commit=current_commit(), command=command)
    base = {"data": "wikitext2 test", "context": args.context, "stride": stride,
            "joining": "hf", "dtype": str(mc.dtype).removeprefix("torch."),
            "device": device.type, "limit": args.limit, "source": str(model),
            "total_tokens": len(token_ids), "threads": torch.get_num_threads()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-W6-ppl-vs-hf-{args.name}"
    jsonl, md = out / f"{stem}.jsonl", out / f"{stem}.md"
    load_format = mc.load_format
    records = []

    def measure(backend: str, build, evaluate, extra: dict) -> None:
        t0 = time.perf_counter()
        net = build()
        loaded = time.perf_counter() - t0
        res = evaluate(net, token_ids, args.context, stride, args.limit, data="wikitext2",
                       joining="hf", progress=True)
        config = {**base, **extra, "scored_tokens": res.scored_tokens, "windows": res.windows,
                  "nll": res.nll, "load_s": round(loaded, 1), "seconds": round(res.seconds, 1)}
        records.append(make_record(meta, "W6", args.name, backend, config, "ppl", res.ppl,
                                   load_format=load_format))
        print(f"{backend:>9}: ppl {res.ppl:.6f} (nll {res.nll:.8f}) over {res.scored_tokens:,} "
              f"tokens, {res.windows} windows, {res.seconds:.0f}s", flush=True)
        # after each backend: a run cut short keeps what it measured
        write_jsonl(jsonl, records)
        md.write_text(markdown(records, command))

    measure(OURS, lambda: get_model(mc, device), perplexity, {})
    import transformers

    hf_extra = {"transformers": transformers.__version__}

    def build_hf():
        hf = load_hf_causal_lm(mc, device)
        hf_extra["attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        return hf

    measure(HF, build_hf, hf_perplexity, hf_extra)
    a, b = records
    if (a.config["scored_tokens"], a.config["windows"]) != (b.config["scored_tokens"],
                                                             b.config["windows"]):
        raise SystemExit("the backends scored different tokens: a bug in one of them")
    return jsonl, md, records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: "
                    "SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--name", default="smollm2-135m", help="short model name for the records")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--stride", type=int, default=None, help="default: the context")
    ap.add_argument("--limit", type=int, default=None, help="at most this many windows")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    jsonl, md, _ = run(args, "python benchmarks/ppl_vs_hf.py " + shlex.join(argv))
    print(md.read_text())
    print(f"wrote {jsonl} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
