"""Speculation switched off and on between rounds, as the automatic switch does on a GPU (W5's
head runs had 9-27 plain rounds among ~350 speculative ones). On the CPU the switch has no
measured costs and never runs, so a fixed pattern stands in for it: three rounds on, three
off. Chain and tree drafts (draft_topk 1 and 3), with and without overlapped drafting (the
CUDA-graph runner's code on the CPU), with the kind of head W5 runs (prev-token, a draft
vocabulary) and a plain one. Outputs must stay plain greedy decoding's, and every KV block
must come back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cpu_graphs import graphs_on_cpu
from safetensors.torch import load_file, save_file
from tiny_models import make_echo_head_pair

from llmaccel import LLM, SamplingParams

K = 3
PROMPTS = [[11, 12, 13, 14, 15] * 12 + [3, 4], [11, 12, 13, 14, 15] * 12 + [7],
           [5, 6, 7, 8] * 3, list(range(30, 52))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The echo pair of test_spec_tree, and a prev-token copy of its head with a draft
    vocabulary (fc's third part zero: the same drafts, through the prev-token code)."""
    d = tmp_path_factory.mktemp("toggle-pair")
    make_echo_head_pair(d)
    src, dst = d / "head", d / "prev-head"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    h = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = torch.cat([tensors["fc.weight"], torch.zeros(h, h)], 1).contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["llmaccel_draft_head"]["prev_token_embedding"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    # every id but a few of the prompts' (so some drafts are impossible)
    ids = [i for i in range(cfg["vocab_size"]) if i not in (13, 31, 40)]
    (dst / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
    return d


def _toggled(spec, period: int = 3) -> dict[str, int]:
    """Replace the decision per round (propose and skip_round each start one) with `period`
    rounds on, `period` off; returns the counters."""
    n = {"rounds": 0, "on": 0}
    propose, skip = spec.propose, spec.skip_round

    def on(batch=None, round_index=None) -> bool:
        return (n["rounds"] // period) % 2 == 0

    def counted_propose(running, waiting=0):
        n["rounds"] += 1
        n["on"] += on()
        return propose(running, waiting)

    def counted_skip(batch):
        n["rounds"] += 1
        return skip(batch)

    spec.speculate_at = on
    spec.propose, spec.skip_round = counted_propose, counted_skip
    return n


# four of the eight combinations, each setting in both states (the suite's time budget)
@pytest.mark.parametrize(("head", "topk", "overlap"), [
    ("head", 1, False), ("head", 3, True), ("prev-head", 1, True), ("prev-head", 3, False)])
def test_rounds_switched_off_and_on_stay_lossless(pair, head, topk, overlap, monkeypatch):
    d = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                block_size=16)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    overlap_cfg = {"draft_overlap": overlap}
    spec_cfg = {"method": "head", "model": str(d / head), "num_speculative_tokens": K,
                "adaptive": False, "draft_topk": topk}
    llm = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=16, speculative_config={**spec_cfg, **overlap_cfg})
    if overlap:
        graphs_on_cpu(llm.engine.spec.draft.runner, K - 1,
                      -(-llm.engine.model_config.max_model_len // 16))
    spec = llm.engine.spec
    n = _toggled(spec)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    # both kinds of round ran, and speculation was switched back on after plain rounds
    assert spec.stats.num_off_steps >= 3 and spec.stats.num_steps >= 3, (n, spec.stats)
    assert n["rounds"] > 2 * 3 * 2 and 0 < n["on"] < n["rounds"]
    if overlap:
        assert spec.num_overlapped >= 1
    if topk > 1:
        assert spec.num_tree_accepted >= 1
    assert llm.engine.block_manager.num_used_blocks == 0
    assert spec.draft.block_manager.num_used_blocks == 0
