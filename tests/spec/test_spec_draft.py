"""Speculative decoding with a draft model (spec/draft_model.py) in the engine: greedy output
equal to transformers' with prefix caching, chunked prefill and preemption on; sampling
through the draft's q; the draft's KV rolled back and released; vocabulary checks."""

from __future__ import annotations

import pytest
import torch
from engine_matrix import hf_greedy, random_workload
from tiny_models import make_tiny_model, tiny_configs

from llmaccel import LLM, SamplingParams
from llmaccel.spec import SpeculativeConfigError

NOISE = 0.1  # relative to each weight's spread: the draft agrees often, not always


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a draft that is the target with noise on every weight (so it agrees
    often, not always), plus the workload and transformers' greedy outputs."""
    target_dir = tmp_path_factory.mktemp("target")
    draft_dir = tmp_path_factory.mktemp("draft")
    hf = make_tiny_model(tiny_configs()["llama"], target_dir)
    draft = make_tiny_model(tiny_configs()["llama"], draft_dir)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * NOISE * p.std().clamp_min(1e-3))
    draft.save_pretrained(draft_dir)
    prompts, max_tokens = random_workload(hf.config.vocab_size, seed=3)
    return str(target_dir), str(draft_dir), prompts, max_tokens, hf_greedy(hf, prompts,
                                                                           max_tokens)


def _spec(draft: str, **kw) -> dict:
    return {"method": "draft", "model": draft, "num_speculative_tokens": 3, "adaptive": False,
            **kw}


@pytest.mark.parametrize("mode", ["default", "all-three"])
def test_draft_model_greedy_equals_transformers(pair, mode):
    target, draft, prompts, max_tokens, expected = pair
    extra = ({} if mode == "default" else
             {"max_num_batched_tokens": 32, "num_gpu_blocks": 24, "max_model_len": 384})
    llm = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
              enable_prefix_caching=True, speculative_config=_spec(draft), **extra)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i}: {g} != {e}"
    stats = llm.get_stats()
    spec = stats.spec_decode
    assert spec["num_accepted_tokens"] > 0 and spec["num_rollbacks"] > 0, spec
    assert 0.2 < spec["acceptance_rate"] < 0.98, spec
    if mode == "all-three":
        assert stats.num_preemptions > 0 and stats.prefix_hit_rate > 0
    # every block of both pools came back
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.spec.draft.block_manager.num_used_blocks == 0


def test_draft_model_sampling_is_reproducible_with_a_seed(pair):
    target, draft, prompts, _, _ = pair
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)

    def run():
        llm = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
                  speculative_config=_spec(draft))
        outs = llm.generate(prompts[:4], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    first, llm = run()
    again, _ = run()
    assert first == again and all(len(t) == 20 for t in first)
    assert llm.get_stats().spec_decode["num_accepted_tokens"] > 0


def test_draft_with_another_vocabulary_is_refused(pair, tmp_path):
    target, *_ = pair
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = cfg.vocab_size + 8
    make_tiny_model(cfg, tmp_path)
    with pytest.raises(SpeculativeConfigError, match="vocab_size"):
        LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
            speculative_config=_spec(str(tmp_path)))


def test_confidence_threshold_stops_drafting_early(pair):
    """A draft whose top probability falls below draft_confidence_threshold stops after that
    token: with a threshold no random tiny model reaches, one draft per step; output unchanged."""
    target, draft, prompts, max_tokens, expected = pair
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in max_tokens[:6]]
    llm = LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
              speculative_config=_spec(draft, draft_confidence_threshold=0.99))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts[:6], params, use_tqdm=False)]
    assert got == expected[:6]
    spec = llm.get_stats().spec_decode
    assert spec["num_steps"] > 0 and spec["num_draft_tokens"] == spec["num_steps"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "all-three"])
def test_draft_model_on_gpu_verifies_through_cuda_graphs(pair, mode):
    """fp32 on the GPU: greedy output equals transformers' while the verify steps (k + 1 rows
    per sequence) and the draft's catch-up and decode steps replay CUDA graphs."""
    target, draft, prompts, max_tokens, expected = pair
    extra = ({} if mode == "default" else
             {"max_num_batched_tokens": 32, "num_gpu_blocks": 24, "max_model_len": 384})
    # draft_cost_ratio 0: the constant cost model. The measured one would (rightly) switch
    # speculation off: this draft is as large as its target.
    llm = LLM(target, dtype="float32", device="cuda", skip_tokenizer_init=True,
              enable_prefix_caching=True,
              speculative_config=_spec(draft, draft_cost_ratio=0.0), **extra)
    rows: dict[str, list[int]] = {"target": [], "draft": []}
    for name, runner in (("target", llm.engine.runner), ("draft", llm.engine.spec.draft.runner)):
        graphs = runner.graphs
        assert graphs is not None

        def run(ids, *args, _run=graphs.run, _rows=rows[name], **kw):
            _rows.append(len(ids))
            return _run(ids, *args, **kw)
        graphs.run = run
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    spec = llm.get_stats().spec_decode
    assert spec["num_accepted_tokens"] > 0 and spec["num_rollbacks"] > 0, spec
    # verify steps ran as graphs of more rows than sequences (k + 1 = 4 per drafting one)
    assert any(n > 1 and n % 4 == 0 for n in rows["target"]), rows["target"][:50]
    assert rows["draft"], "the draft model never replayed a graph"
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.spec.draft.block_manager.num_used_blocks == 0
