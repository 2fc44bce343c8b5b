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


# prompt_lookup_num_tokens: None (the lookup drafts the head's k), or longer than k (a copied
# span drafts up to 7 while the head drafts 3), in every mode and in the first two
CASES = [(mode, None) for mode in MODES] + [(mode, 7) for mode in list(MODES)[:2]]


@pytest.mark.parametrize("mode,lookup_k", CASES)
def test_lookup_drafts_where_it_matches_and_the_head_elsewhere(pair, mode, lookup_k,
                                                                monkeypatch):
    d, hf, tensors = pair
    overlap_cfg = {"draft_overlap": True}  # on: ngram_first must keep it off
    base = [11, 12, 13, 14, 15] * 12
    # The last: this target's first token after it is 98 (found by search over the second
    # token; checked below), so its first round looks up "5 98" and finds a long span.
    prompts = [base + [3, 4], base + [7], [5, 6, 7, 8] * 3, list(range(30, 52)),
               [40, 41, 42, 43, 44], [5, 98, *range(62, 72), 5]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=16,
              **MODES[mode])
    want = [o.outputs[0].token_ids for o in
            LLM(str(d / "target"), **kw).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "head", "model": str(d / "head"), "num_speculative_tokens": K,
            "adaptive": False, "ngram_first": True, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3, "prompt_lookup_num_tokens": lookup_k}
    llm = LLM(str(d / "target"), speculative_config={**spec, **overlap_cfg}, **kw)
    rounds = _record_rounds(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert want[-1][0] == 98
    by_lookup = by_head = longest = 0
    for context, drafts in rounds:
        prompt = next(p for p in prompts if context[:len(p)] == p)
        room = params.max_tokens - (len(context) - len(prompt)) - 1  # near max_tokens
        looked_up = ngram_propose(context, min(lookup_k or K, room), 2, 3)
        if looked_up:
            # (the scheduler trims drafts to a small step budget: max_num_batched_tokens)
            assert drafts == looked_up[:len(drafts)], len(context)
            assert len(drafts) == len(looked_up) or mode != "plain"
            by_lookup += 1
            longest = max(longest, len(drafts))
        else:
            assert len(drafts) <= K
            assert drafts == reference_drafts(hf, tensors, context, len(drafts)), len(context)
            by_head += 1
    assert longest > K if lookup_k else longest == K
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


@pytest.mark.parametrize("extra,message", [
    ({"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens must be >= 1, got 0"),
    ({"prompt_lookup_num_tokens": 8}, "prompt_lookup_num_tokens applies with ngram_first"),
])
def test_prompt_lookup_num_tokens_is_checked(pair, extra, message):
    d, _, _ = pair
    spec = {"method": "head", "model": str(d / "head"), **extra}
    with pytest.raises(LLMAccelError, match=message):
        LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
            speculative_config=spec)


def test_verify_rows_allow_for_the_longest_lookup():
    from llmaccel.engine.config import EngineConfig
    from llmaccel.engine.sizing import rows_per_seq
    from llmaccel.spec.config import SpeculativeConfig

    spec = SpeculativeConfig(method="head", model="h", num_speculative_tokens=3,
                             ngram_first=True, prompt_lookup_num_tokens=7)
    assert spec.max_drafts == 7
    assert rows_per_seq(EngineConfig(speculative_config=spec)) == 8
    assert SpeculativeConfig(method="head", model="h", num_speculative_tokens=3).max_drafts == 3


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
