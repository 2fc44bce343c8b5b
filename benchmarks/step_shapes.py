"""Which steps of a large-batch generation replay a CUDA graph: the engine's own decisions
(scheduler, chunked prefill, `ModelRunner.execute`'s rows-or-eager choice) with the model
stubbed out, on the CPU.

Self-distillation text (benchmarks/head_data.py) runs 256 sequences whose answers end at
different lengths, so new requests are admitted every step and their prompts' prefill mixes
with the decodes. A mixed step replays a decode graph only when all its tokens fit the largest
captured graph (512 rows by default); a step of 256 decodes and two ~200-token prompts does
not, and runs eagerly, bound by the host's launches. This counts such steps for a given
graph size and step token budget, from the same code the GPU engine runs (the CUDA-graph
runner's host path, eager on the CPU).

    python benchmarks/step_shapes.py --requests 2048 --max-num-seqs 256 --step-tokens 0,768

Prompt and answer lengths are drawn at random around those of the committed head text (prompts
100-400 tokens, answers 16-256, ~157 on average). Not a timing: it says how many steps would
run eagerly, not what they cost.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from host_overhead import TEXT, _default_model, stub_model  # noqa: E402


def lengths(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) per request: prompts uniform in 100-400; answers
    uniform in 16-256 for two thirds of the requests (they end early) and 256 (cut at
    max_tokens) for the rest, ~157 on average as in the committed head text."""
    rng = random.Random(seed)
    return [(rng.randint(100, 400), 256 if rng.random() < 1 / 3 else rng.randint(16, 256))
            for _ in range(n)]


def run(model: str, requests: int, max_num_seqs: int, step_tokens: int, seed: int) -> dict:
    """One generation of `requests` (seeded lengths); per step: its tokens and whether it
    replayed a graph. `step_tokens` 0: the engine's defaults (graphs up to 512 rows, 8192
    tokens a step); else max_num_batched_tokens and graphs up to that many rows."""
    import llmaccel.engine.cuda_graph as cuda_graph
    from llmaccel import LLM, SamplingParams

    kw = {"max_num_batched_tokens": step_tokens} if step_tokens else {}
    llm = LLM(model, load_format="dummy", dtype="float32", device="cpu", max_model_len=2048,
              max_num_seqs=max_num_seqs, enable_prefix_caching=False, cpu_kv_cache_gib=12.0,
              **kw)
    tok = llm.get_tokenizer()
    stream = tok.encode(TEXT, add_special_tokens=False)
    # the GPU engine's capture sizes: to 512 rows by default (engine/sizing.capture_sizes),
    # to the step budget as head_data.py --max-step-tokens sets them
    most = step_tokens or max(max_num_seqs, 512)
    stub_model(llm, stream, graph_path=True,
               graph_sizes=cuda_graph.default_capture_sizes(most))
    runner = llm.engine.runner
    steps: list[tuple[int, bool]] = []
    execute = runner.execute

    def recorded(step, *args, **kwargs):
        out = execute(step, *args, **kwargs)
        steps.append((sum(n for _, n in step.scheduled), runner.ran_graph))
        return out

    runner.execute = recorded
    prompts, params = [], []
    for p, a in lengths(requests, seed):
        prompts.append({"prompt_token_ids": (stream * (p // len(stream) + 1))[:p]})
        params.append(SamplingParams(temperature=0, max_tokens=a, ignore_eos=True))
    llm.generate(prompts, params, use_tqdm=False)
    eager = [n for n, g in steps if not g]
    tokens = sum(n for n, _ in steps)
    buckets = Counter(min(n // 128 * 128, 1024) for n, _ in steps)
    return {"step_tokens": step_tokens, "largest_graph": most, "steps": len(steps),
            "eager_steps": len(eager), "eager_share": round(len(eager) / len(steps), 3),
            "tokens_per_step": round(tokens / len(steps), 1),
            "eager_tokens_share": round(sum(eager) / tokens, 3),
            "steps_by_tokens": {f"{k}-{k + 127}": v for k, v in sorted(buckets.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF (fetched)")
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--step-tokens", default="0,768",
                    help="comma-separated: 0 (the defaults) or a step token budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="a JSON-lines file to append records to")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from llmaccel.bench.results import append_jsonl, current_commit

    model = args.model or _default_model()
    for st in (int(s) for s in args.step_tokens.split(",")):
        rec = {"name": "step-shapes", "commit": current_commit(),
               "device": "cpu (model stubbed)", "requests": args.requests,
               "max_num_seqs": args.max_num_seqs, "seed": args.seed,
               **run(model, args.requests, args.max_num_seqs, st, args.seed)}
        print(json.dumps(rec), flush=True)
        if args.out:
            append_jsonl(args.out, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
