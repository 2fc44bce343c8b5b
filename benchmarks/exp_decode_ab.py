"""A/B of a decode-path switch at batch 1: graph replay time of one decode step and the greedy
tokens of a few prompts, under the current environment (switches such as LLMACCEL_NORM_QUANT are
read at import: run once per setting, naming it with --label, then `--compare A B`).

    LLMACCEL_NORM_QUANT=1 python benchmarks/exp_decode_ab.py --quantization fp8 --out on.json
    LLMACCEL_NORM_QUANT=0 python benchmarks/exp_decode_ab.py --quantization fp8 --out off.json
    python benchmarks/exp_decode_ab.py --compare on.json off.json

Random (dummy) weights: the tokens check that both paths compute the same thing, not quality
(random logits have near-ties, so a change of summation order alone can flip a token).
A diagnostic; whole-run numbers of record come from gpu_speed.py. For changes to launch order
(PDL release points) it misled once: graph replay had a change 2.1% faster that W1 measured
1.6% slower (benchmarks/results/2026-11-26-quant-decode-s21.md), so decide those in W1.
"""

from __future__ import annotations

import argparse
import json
import os


def measure(args: argparse.Namespace) -> dict:
    import torch

    from llmaccel import LLM, SamplingParams
    from llmaccel.engine.cuda_graph import replay_ms
    from llmaccel.quant.presets import preset_config

    extra = {}
    if args.quantization != "bf16":
        extra["hf_overrides"] = {"quantization_config": preset_config(args.quantization)}
    llm = LLM(args.shape, load_format="dummy", dtype="bfloat16", max_model_len=2048, **extra,
              skip_tokenizer_init=True, enable_prefix_caching=False,
              cudagraph_capture_sizes=[1])
    runner = llm.engine.runner
    g = runner.graphs.graphs[runner.graphs.sizes[0]]
    times = [replay_ms(g, 200, warmup=20) * 1e3 for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = []
    for i in range(args.prompts):  # one at a time: batch 1, the graphed path
        prompt = {"prompt_token_ids": [(17 * i + 5 * j) % 1000 + 10 for j in range(64)]}
        outs.append(list(llm.generate(prompt, params)[0].outputs[0].token_ids))
    return {"quantization": args.quantization, "shape": args.shape,
            "label": args.label, "env": {k: v for k, v in os.environ.items()
                                         if k.startswith("LLMACCEL_")},
            "replay_us": sorted(times),
            "replay_us_median": sorted(times)[len(times) // 2],
            "device": torch.cuda.get_device_name(), "tokens": outs}


def compare(a_path: str, b_path: str) -> None:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same = sum(x == y for ta, tb in zip(a["tokens"], b["tokens"]) for x, y in zip(ta, tb))
    total = sum(len(t) for t in a["tokens"])
    first = [next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
             for ta, tb in zip(a["tokens"], b["tokens"])]
    print(f"{a['quantization']:>14} {a['label']} {a['replay_us_median']:8.1f} us | "
          f"{b['label']} {b['replay_us_median']:8.1f} us | "
          f"x{b['replay_us_median'] / a['replay_us_median']:.3f} | tokens equal {same}/{total}"
          f" first diff {first}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--quantization", default="fp8")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out")
    ap.add_argument("--label", default="run", help="names the setting in --compare")
    ap.add_argument("--compare", nargs=2)
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    result = measure(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}))


if __name__ == "__main__":
    main()
