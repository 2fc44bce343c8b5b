"""N-gram speculation on the real SmolLM2-135M-Instruct, on input-grounded prompts (the model
quotes a text it has already seen, as in an edit or a summary): greedy output equal to decoding
without speculation, and more than half of the drafts accepted (the model reflows the quoted
lines, so each line break costs a rejection)."""

from __future__ import annotations

from test_engine_smollm2 import TEXT

from llmaccel import LLM, SamplingParams


def test_ngram_on_a_quoted_text_accepts_most_drafts(smollm2_hf):
    _, tok, model = smollm2_hf
    model = str(model)
    # (a 135M model quotes prose faithfully for a while, not code: the coder pair is measured
    # on the GPU)
    prompts = [TEXT + "\n\nThe same paragraph again, word for word:\n\n" + TEXT[:n]
               for n in (160, 700)]
    ids = [tok(p).input_ids for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=48)
    kw = {"dtype": "float32", "device": "cpu", "enable_prefix_caching": False}
    plain = LLM(model, **kw).generate(ids, params, use_tqdm=False)
    spec_llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                   **kw)
    spec = spec_llm.generate(ids, params, use_tqdm=False)
    for p, s in zip(plain, spec):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids
    stats = spec_llm.get_stats().spec_decode
    print("n-gram on SmolLM2:", {k: stats[k] for k in ("acceptance_rate", "mean_accepted_len",
                                                         "num_steps", "num_draft_tokens")})
    assert stats["acceptance_rate"] > 0.5
    assert stats["mean_accepted_len"] > 2.0
    per_request = [o.metrics.spec_decode["acceptance_rate"] for o in spec]
    assert all(a > 0.5 for a in per_request), per_request
