"""A/B of the row-norm tail (DecoderLayer.forward_tail, kernels/gemv_common.py) at batch 1:
graph replay time of one decode step and the greedy tokens of a few prompts, for one setting of
LLMACCEL_GEMV_NORM_TAIL (read at import: run once per setting, then `--compare A B`).

    LLMACCEL_GEMV_NORM_TAIL=1 python benchmarks/exp_norm_tail.py --quantization fp8 --out on.json
    LLMACCEL_GEMV_NORM_TAIL=0 python benchmarks/exp_norm_tail.py --quantization fp8 --out off.json
    python benchmarks/exp_norm_tail.py --compare on.json off.json

Random (dummy) weights: the tokens check that both paths compute the same thing, not quality.
"""

from __future__ import annotations

import argparse
import json
import os


def measure(args: argparse.Namespace) -> dict:
    import torch

    from llmaccel import LLM, SamplingParams
    from llmaccel.engine.cuda_graph import replay_ms
    from llmaccel.models.transformer import DecoderLayer
    from llmaccel.quant.presets import preset_config

    extra = {}
    if args.quantization != "bf16":
        extra["hf_overrides"] = {"quantization_config": preset_config(args.quantization)}
    llm = LLM(args.shape, load_format="dummy", dtype="bfloat16", max_model_len=2048, **extra,
              skip_tokenizer_init=True, enable_prefix_caching=False,
              cudagraph_capture_sizes=[1])
    runner = llm.engine.runner
    model = runner.model
    tails = sum(1 for m in model.modules()
                if isinstance(m, DecoderLayer) and m._tail_by_rows.get(1) is not None)
    g = runner.graphs.graphs[runner.graphs.sizes[0]]
    times = [replay_ms(g, 200, warmup=20) * 1e3 for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = []
    for i in range(args.prompts):  # one at a time: batch 1, the graphed path
        prompt = {"prompt_token_ids": [(17 * i + 5 * j) % 1000 + 10 for j in range(64)]}
        outs.append(list(llm.generate(prompt, params)[0].outputs[0].token_ids))
    return {"quantization": args.quantization, "shape": args.shape,
            "norm_tail": os.environ.get("LLMACCEL_GEMV_NORM_TAIL", "1"),
            "layers_on_tail_path": tails, "replay_us": sorted(times),
            "replay_us_median": sorted(times)[len(times) // 2],
            "device": torch.cuda.get_device_name(), "tokens": outs}


def compare(a_path: str, b_path: str) -> None:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same = sum(x == y for ta, tb in zip(a["tokens"], b["tokens"]) for x, y in zip(ta, tb))
    total = sum(len(t) for t in a["tokens"])
    first = [next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
             for ta, tb in zip(a["tokens"], b["tokens"])]
    print(f"{a['quantization']:>14} tail={a['norm_tail']} ({a['layers_on_tail_path']} layers) "
          f"{a['replay_us_median']:8.1f} us | tail={b['norm_tail']} "
          f"({b['layers_on_tail_path']} layers) {b['replay_us_median']:8.1f} us | "
          f"x{b['replay_us_median'] / a['replay_us_median']:.3f} | tokens equal {same}/{total}"
          f" first diff {first}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--quantization", default="fp8")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out")
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
