"""Where the GPU waits between batch-1 decode steps: a W1-like request (prompt 128, greedy)
through the engine under the torch profiler; prints, for a few steps in the middle, every GPU
operation outside the step's CUDA graph kernels (copies, memsets, small kernels) and every idle
gap of more than --min-gap us, with the step period. A diagnostic, not a benchmark of record.

    python benchmarks/profile_step_gaps.py --shape llama-3.2-3b \
        --quantization gptq-int4-g128-lm-head
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _is_linear(name: str) -> bool:
    return "gemv" in name or name.startswith("_linear_kernel")


def build_llm(model: str, quantization: str | None, *, dummy: bool = True,
              dtype: str = "bfloat16"):
    """The engine for a profile: `model`'s weights or, `dummy`, random ones of a shape name;
    quantized by a preset name (None / bf16: not)."""
    from llmaccel import LLM

    extra = {}
    if quantization and quantization != "bf16":
        from llmaccel.quant.presets import preset_config
        extra["hf_overrides"] = {"quantization_config": preset_config(quantization)}
    if dummy:
        extra.update(load_format="dummy", skip_tokenizer_init=True)
    return LLM(model, dtype=dtype, max_model_len=2048, enable_prefix_caching=False, **extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-3b")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--min-gap", type=float, default=1.0)
    ap.add_argument("--show-steps", type=int, default=3)
    args = ap.parse_args()
    from llmaccel import SamplingParams

    llm = build_llm(args.shape, args.quantization)
    prompt = {"prompt_token_ids": [(7 * j) % 900 + 10 for j in range(128)]}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompt, params)  # warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params)
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    # the step boundary: the last kernel of each step merges the greedy argmax's chunks
    # (kernels/greedy.py)
    heads = [i for i, e in enumerate(evs) if e.name.startswith("_merge_kernel")]
    if len(heads) < 8:
        print("could not find the steps' argmax kernels; names:",
              sorted({e.name[:60] for e in evs})[:40])
        return
    periods = [evs[b].time_range.end - evs[a].time_range.end for a, b in zip(heads, heads[1:])]
    print(f"{len(heads)} steps; step period (argmax merge to argmax merge) median "
          f"{statistics.median(periods):.1f} us")
    graph_names = {}
    mid = len(heads) // 2
    for a, b in zip(heads[mid:mid + args.show_steps], heads[mid + 1:mid + 1 + args.show_steps]):
        window = evs[a:b + 1]
        busy = sum(e.time_range.end - e.time_range.start for e in window[1:])
        print(f"\n-- step: {window[-1].time_range.end - window[0].time_range.end:.1f} us, "
              f"{len(window) - 1} GPU ops, busy (summed) {busy:.1f} us")
        prev_end = window[0].time_range.end
        t0 = prev_end
        for e in window[1:]:
            gap = e.time_range.start - prev_end
            name = e.name[:70]
            graph_names[name] = graph_names.get(name, 0) + 1
            small = not any(k in name for k in ("gemv", "rms_norm", "paged_decode", "gemm",
                                                "Kernel2", "cutlass", "sm90"))
            if gap > args.min_gap or small:
                print(f"  +{e.time_range.start - t0:8.1f} us  gap {gap:6.1f}  "
                      f"{e.time_range.end - e.time_range.start:6.1f} us  {name}")
            prev_end = max(prev_end, e.time_range.end)
    # Each kernel's share of the step's critical path: the time from the previous op's end
    # to its own end (with PDL a kernel starts early; what it adds is how much later it ends).
    share: dict[str, list[float]] = {}
    for a, b in zip(heads[1:-1], heads[2:]):
        prev_end = evs[a].time_range.end
        window = evs[a + 1:b + 1]
        n_linear = sum(_is_linear(e.name) for e in window)
        seen = 0
        for e in window:
            key = e.name[:40]
            if _is_linear(e.name):  # which projection: qkv, o, gate_up, down per layer, head
                key += " " + (("qkv", "o", "gate_up", "down")[seen % 4]
                              if seen < n_linear - 1 else "lm_head")
                seen += 1
            share.setdefault(key, []).append(max(0.0, e.time_range.end - prev_end))
            prev_end = max(prev_end, e.time_range.end)
    steps = len(heads) - 2
    print("\ncritical-path share per step (end-to-end increments), us:")
    print("| op | per step | per call | calls/step |\n|---|---|---|---|")
    for key, v in sorted(share.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {key} | {sum(v) / steps:.1f} | {sum(v) / len(v):.2f} | {len(v) / steps:.0f} |")
    print("\nops per step by name:")
    for n, c in sorted(graph_names.items(), key=lambda kv: -kv[1]):
        print(f"  {c / args.show_steps:6.1f}  {n}")


if __name__ == "__main__":
    main()
