"""SpeculativeConfig.ngram_first: a draft head (or draft model) whose rounds draft from n-gram
lookup where the context has a match, and from the head elsewhere. Every round's drafts are
what the lookup proposes for that context where it proposes any, else what the head's
definition drafts (an independent transformers computation); outputs are the target's greedy
tokens; blocks come back; no round overlaps (the lookup needs the accepted tokens)."""

from __future__ import annotations

import pytest
from test_spec_head import MODES, _record_rounds, reference_drafts
from tiny_models import make_echo_head_pair

from llmaccel import LLM, SamplingParams
from llmaccel.errors import LLMAccelError
from llmaccel.spec.ngram import ngram_propose

K = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("ngram-first")
    hf, tensors = make_echo_head_pair(d)
    return d, hf, tensors


@pytest.mark.parametrize("mode", list(MODES))
def test_lookup_drafts_where_it_matches_and_the_head_elsewhere(pair, mode, monkeypatch):
    d, hf, tensors = pair
    monkeypatch.setenv("LLMACCEL_DRAFT_OVERLAP", "1")  # on: ngram_first must keep it off
    base = [11, 12, 13, 14, 15] * 12
    prompts = [base + [3, 4], base + [7], [5, 6, 7, 8] * 3, list(range(30, 52)),
               [40, 41, 42, 43, 44]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=16,
              **MODES[mode])
    want = [o.outputs[0].token_ids for o in
            LLM(str(d / "target"), **kw).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "head", "model": str(d / "head"), "num_speculative_tokens": K,
            "adaptive": False, "ngram_first": True, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3}
    llm = LLM(str(d / "target"), speculative_config=spec, **kw)
    rounds = _record_rounds(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    by_lookup = by_head = 0
    for context, drafts in rounds:
        looked_up = ngram_propose(context, K, 2, 3)
        if looked_up:
            # (a round cut short near max_tokens asks for fewer)
            assert drafts == looked_up[:len(drafts)], len(context)
            by_lookup += 1
        else:
            assert drafts == reference_drafts(hf, tensors, context, len(drafts)), len(context)
            by_head += 1
    spec_decoder = llm.engine.spec
    assert by_lookup >= 10 and by_head >= 10, (by_lookup, by_head)
    # (counted when proposed: a few proposals are cut before their verify step)
    assert by_lookup <= spec_decoder.num_ngram_first <= by_lookup + len(prompts)
    assert spec_decoder.num_overlapped == 0
    assert llm.engine.block_manager.num_used_blocks == 0
    assert spec_decoder.draft.block_manager.num_used_blocks == 0
    if mode != "plain":
        stats = llm.get_stats()
        assert stats.prefix_hit_rate > 0 and stats.num_preemptions > 0


def test_ngram_first_needs_a_model_method(pair):
    d, _, _ = pair
    with pytest.raises(LLMAccelError, match="ngram_first applies to method='draft' or 'head'"):
        LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
            speculative_config={"method": "ngram", "ngram_first": True})


def test_a_draft_model_with_lookup_first_stays_lossless(pair, tmp_path):
    """method 'draft' with ngram_first: the draft model catches up on the tokens of the rounds
    the lookup drafted; outputs are the target's greedy tokens and both pools get every block
    back."""
    from tiny_models import make_tiny_model, tiny_configs

    d, _, _ = pair
    make_tiny_model(tiny_configs()["qwen2"], tmp_path / "draft", seed=1)  # the target again
    base = [11, 12, 13, 14, 15] * 8
    prompts = [base + [3, 4], [5, 6, 7, 8] * 3, list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=16)
    want = [o.outputs[0].token_ids for o in
            LLM(str(d / "target"), **kw).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft", "model": str(tmp_path / "draft"), "num_speculative_tokens": K,
            "adaptive": False, "ngram_first": True, "prompt_lookup_min": 2}
    llm = LLM(str(d / "target"), speculative_config=spec, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.spec.num_ngram_first > 0
    assert llm.get_stats().spec_decode["num_accepted_tokens"] > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.spec.draft.block_manager.num_used_blocks == 0
