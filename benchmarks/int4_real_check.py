"""Greedy tokens of a real quantized model on the GPU: our engine with the CUDA C GEMV, with the
Triton GEMV (LLMACCEL_CUDA_KERNELS=0), and (GPTQ int4) transformers on the same weights
dequantized by the GPTQ decoder of tests/test_quant_smollm2.py, all in bf16. --no-reference
skips transformers (FP8 checkpoints: the CUDA C FP8 GEMV against the Triton one).

    python benchmarks/int4_real_check.py --model GPTQ_DIR [--tokens 32] [--out result.json]

GPTQ_DIR is a GPTQ (v1) checkpoint `llmaccel quantize` wrote (with its tokenizer). Prints,
per prompt, how many leading tokens each pair shares."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Once upon a time, in a small village,", "The three primary colors are",
           "import numpy as np\n", "In 1969, the first humans", "A haiku about autumn:\n"]


def _decoder():
    path = Path(__file__).resolve().parent.parent / "tests" / "test_quant_smollm2.py"
    spec = importlib.util.spec_from_file_location("test_quant_smollm2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.decode_gptq_v1


def ours(model: str, tokens: int, cuda_kernels: bool) -> tuple[list[list[int]], str]:
    from llmaccel import LLM, SamplingParams

    os.environ["LLMACCEL_CUDA_KERNELS"] = "1" if cuda_kernels else "0"
    llm = LLM(model, dtype="bfloat16", enable_prefix_caching=False)
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    desc = layer.quant_method.describe(layer)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=tokens,
                                                ignore_eos=True), use_tqdm=False)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    torch.cuda.empty_cache()
    return ids, desc


def reference(model: str, tokens: int) -> list[list[int]]:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    decode = _decoder()
    config = AutoConfig.from_pretrained(model)
    config.quantization_config = None
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    packed = load_file(str(Path(model) / "model.safetensors"))
    state = {}
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.qweight" in packed:
            state[f"{name}.weight"] = decode(packed, name)
    for k, v in packed.items():
        if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
            state[k] = v.float()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    hf.tie_weights()
    hf = hf.to("cuda", torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(model)
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids.cuda()
            gen = hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-reference", action="store_true",
                    help="skip transformers (its reference decodes GPTQ v1 only): e.g. an FP8 "
                         "checkpoint, where the CUDA C FP8 GEMV is checked against Triton's")
    args = ap.parse_args()
    cuda_ids, cuda_desc = ours(args.model, args.tokens, True)
    triton_ids, triton_desc = ours(args.model, args.tokens, False)
    ref_ids = [None] * len(PROMPTS) if args.no_reference else reference(args.model, args.tokens)
    rows = []
    for p, c, t, r in zip(PROMPTS, cuda_ids, triton_ids, ref_ids):
        rows.append({"prompt": p, "cuda_vs_triton": shared(c, t),
                     "cuda_vs_hf": None if r is None else shared(c, r),
                     "triton_vs_hf": None if r is None else shared(t, r), "tokens": args.tokens})
    result = {"model": args.model, "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
              "cuda_kernel": cuda_desc, "triton_kernel": triton_desc, "prompts": rows,
              "commit": os.environ.get("LLMACCEL_COMMIT", "unknown"),
              "command": "python benchmarks/int4_real_check.py"}
    print(f"CUDA path: {cuda_desc}\nTriton path: {triton_desc}")
    print("| prompt | CUDA = Triton | CUDA = HF | Triton = HF |\n|---|---|---|---|")
    def frac(v):
        return "skipped" if v is None else f"{v}/{args.tokens}"

    for r in rows:
        print(f"| {r['prompt']!r} | {frac(r['cuda_vs_triton'])} | {frac(r['cuda_vs_hf'])} | "
              f"{frac(r['triton_vs_hf'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
