"""The engine-vs-transformers test matrix: workloads, engine modes, and the HF reference."""

from __future__ import annotations

import random

import torch

from llmaccel import LLM, SamplingParams

LONG_GENERATION = 48
# n-gram drafts of up to 3 tokens from 1-3 token suffixes, without the adaptive k (so random
# models, whose greedy outputs loop, keep drafting)
SPEC_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3, "adaptive": False}
# Each mode must still give transformers' greedy tokens exactly. Async scheduling is the
# engine's default, so the first four modes run it; the "sync-" modes switch it off.
MODES = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "chunked-prefill": dict(enable_prefix_caching=False, max_num_batched_tokens=7),
    # 24 blocks of 16 hold 384 tokens: one long request fits, the workload does not.
    "preemption": dict(enable_prefix_caching=False, num_gpu_blocks=24, max_model_len=384),
    "all-three": dict(enable_prefix_caching=True, max_num_batched_tokens=7, num_gpu_blocks=24,
                      max_model_len=384),
    # synchronous scheduling (each step's tokens on the host before the next step launches)
    "sync-prefix-caching": dict(enable_prefix_caching=True, async_scheduling=False),
    "sync-all-three": dict(enable_prefix_caching=True, max_num_batched_tokens=7,
                           num_gpu_blocks=24, max_model_len=384, async_scheduling=False),
    # speculative decoding (n-gram lookup; steps are not launched ahead with it)
    "spec-ngram": dict(enable_prefix_caching=True, speculative_config=SPEC_NGRAM),
    "spec-ngram-all-three": dict(enable_prefix_caching=True, max_num_batched_tokens=16,
                                 num_gpu_blocks=24, max_model_len=384,
                                 speculative_config=SPEC_NGRAM),
}


def random_workload(vocab: int, seed: int = 0, n: int = 16, shared: int = 4):
    """n prompts of 1..300 tokens (both ends included) and `shared` more that extend one long
    prefix, with mixed max_tokens (the shared ones generate 48, long enough to outgrow a small
    KV pool and force preemptions)."""
    rng = random.Random(seed)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(n - 2)]
    prompts = [[rng.randrange(vocab) for _ in range(k)] for k in lengths]
    base = [rng.randrange(vocab) for _ in range(120)]
    prompts += [base + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
                for _ in range(shared)]
    max_tokens = [rng.randint(1, 24) for _ in prompts[:n]] + [LONG_GENERATION] * shared
    return prompts, max_tokens


def hf_greedy(hf, prompts, max_tokens) -> list[list[int]]:
    out = []
    for p, m in zip(prompts, max_tokens):
        ids = torch.tensor([p], device=hf.device)
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m,
                          do_sample=False, eos_token_id=[], pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def run_engine(model: str, mode: str, prompts, max_tokens, device: str = "cpu", **extra):
    config = {**MODES[mode], **{k: v for k, v in extra.items() if k in MODES[mode]}}
    extra = {k: v for k, v in extra.items() if k not in MODES[mode]}
    llm = LLM(model, dtype="float32", device=device, block_size=16, **config, **extra)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def check_mode(llm: LLM, mode: str, launched_ahead: bool = True) -> None:
    """The engine ended clean and the mode's features took effect. `launched_ahead=False`
    where no step can be launched ahead although async scheduling is on (requests that ask for
    logprobs, which need the host's sampler)."""
    stats = llm.get_stats()
    assert llm.engine.block_manager.num_used_blocks == 0 and stats.kv_usage == 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    if "prefix" in mode or mode.endswith("all-three"):
        assert stats.prefix_hit_rate > 0
    if mode == "preemption" or mode.endswith("all-three"):
        assert stats.num_preemptions > 0
    if mode == "chunked-prefill" or mode.endswith("all-three"):
        assert llm.engine.max_num_batched_tokens <= 16
    if mode.startswith("spec"):  # drafts were proposed, verified, some accepted
        spec = stats.spec_decode
        assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0, spec
        assert spec["num_emitted_tokens"] == spec["num_steps"] + spec["num_accepted_tokens"]
        return
    if launched_ahead and not mode.startswith("sync"):  # decode steps were launched ahead (with a 7-token
        # budget and preemptions, requests wait most of the time, and waiting ones block it)
        share = 0.1 if mode == "prefix-caching" else 0.02
        assert stats.num_async_steps > share * stats.num_steps, (stats.num_async_steps,
                                                                 stats.num_steps)
