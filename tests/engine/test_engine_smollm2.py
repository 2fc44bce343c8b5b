"""The engine on the real SmolLM2-135M-Instruct equals transformers' greedy generate, in every
mode of the matrix (prompts are slices of real text, so the distributions are realistic)."""

import random

import pytest

from engine_matrix import LONG_GENERATION, MODES, check_mode, hf_greedy, run_engine

TEXT = """The history of computing is the story of machines that grew faster and smaller at
the same time. Early computers filled rooms, drew kilowatts of power and were programmed with
switches and punched cards. The transistor replaced the vacuum tube, the integrated circuit put
many transistors on one chip, and the microprocessor put a whole computer on a single die.
Memory followed a similar path: magnetic cores gave way to dynamic RAM, and caches were added to
hide the growing gap between the speed of processors and the speed of memory. Today the cost of
moving data often exceeds the cost of computing on it, which is why modern accelerators spend
so much silicon on high-bandwidth memory and on-chip buffers. Language models make this very
clear: generating one token requires reading every weight of the model from memory, so the
speed of decoding is set mostly by memory bandwidth rather than by arithmetic. Techniques such
as quantization, batching, caching of keys and values, and speculative decoding all attack this
bottleneck from different directions. Quantization shrinks the bytes per weight; batching
shares each weight read among many requests; the key-value cache avoids recomputing attention
over the prompt; and speculative decoding lets a small model propose several tokens that the
large model verifies in a single pass."""


@pytest.fixture(scope="module")
def workload(smollm2_hf):
    # The weights as an HF safetensors directory: each mode's engine then loads in a second
    # instead of re-reading the GGUF (the GGUF path is covered by test_smollm2.py).
    hf, tok, model_dir = smollm2_hf
    ids = tok(TEXT + "\n\n" + TEXT).input_ids  # long enough for 300-token prompts
    rng = random.Random(0)
    # Every prompt but the 1-token one is longer than the chunked modes' 16-token budget.
    lengths = [1, 300] + [rng.randint(17, 300) for _ in range(14)]
    prompts = [ids[(start := rng.randrange(0, len(ids) - k + 1)):start + k] for k in lengths]
    prompts += [ids[:150 + rng.randint(1, 30)] for _ in range(4)]  # a shared 150+ prefix
    max_tokens = [rng.randint(1, 16) for _ in prompts[:16]] + [LONG_GENERATION] * 4
    return str(model_dir), prompts, max_tokens, hf_greedy(hf, prompts, max_tokens)


# sync-all-three and spec-ngram run on the tiny models only: each real-model mode costs a
# minute or more of CI (spec-ngram-all-three runs here: real text gives n-gram drafts a real
# chance). chunked-prefill, preemption and prefix-caching alone are `slow` here (all-three
# covers them together on this model; the tiny models run each alone in every CI run), as
# is sync-prefix-caching (synchronous scheduling: the tiny models run it in every CI run).
REAL_SLOW = ("chunked-prefill", "preemption", "sync-prefix-caching", "prefix-caching")


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=pytest.mark.slow) if m in REAL_SLOW else m
    for m in MODES if m not in ("sync-all-three", "spec-ngram")])
def test_smollm2_matches_transformers(workload, mode):
    model, prompts, max_tokens, expected = workload
    llm, got = run_engine(model, mode, prompts, max_tokens, max_num_batched_tokens=16)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): {g} != {e}"
    check_mode(llm, mode)
