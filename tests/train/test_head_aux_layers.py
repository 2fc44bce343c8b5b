"""A draft head with EAGLE-3's multi-layer features (`aux_layers`, train/head_trainer.py and
models/eagle_head.py): the target's features are its final hidden state followed by the hidden
state entering each aux layer through that layer's input norm, fused to the head's width.

Checked here: the features are what the target computes (against HF's hidden states by hand);
a fresh fused head is exactly the plain head (fuse passes the final hidden state through);
training it lowers its held-out KL and uses the aux features; cached features train the same
head; the checkpoint has fuse.weight and the marker's layers; in our engine the head drafts
exactly what the training module drafts from HF's features, every round (the target's feature
cache rows, aux included, equal training's), with the target's greedy output; bad aux layers
are clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cpu_graphs import graphs_on_cpu
from engine_matrix import hf_greedy
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model, periodic_blocks, tiny_configs

from llmaccel.errors import CorruptCheckpointError, LLMAccelError
from llmaccel.train.distill import distill_draft
from llmaccel.train.distill_common import DistillConfig
from llmaccel.train.head_trainer import (build_draft_head, load_draft_head, target_features)

H = 64  # tiny_models' hidden size (2 layers)


def _cfg(target, out, **kw) -> DistillConfig:
    base = dict(target=str(target), out=str(out), steps=30, batch_size=4, eval_every=10,
                heldout=0.2, patience=5, device="cpu", kind="head")
    return DistillConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("aux-target")
    make_tiny_model(tiny_configs()["llama"], d, seed=2)
    return d


def _target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def aux_head(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("aux-head")
    blocks = periodic_blocks()
    return distill_draft(_cfg(target_dir, out, lr=1e-2, aux_layers=(1,)), progress=False,
                         blocks=blocks), out, blocks


def test_features_are_the_final_and_the_aux_layers_normalized_inputs(target_dir):
    target = _target(target_dir)
    ids = periodic_blocks()[:2, :12]
    f = target_features(target, ids, (1,))
    assert f.shape == (2, 12, 2 * H)
    torch.testing.assert_close(f[..., :H], target_features(target, ids))
    # the hidden state entering layer 1 = the embedding plus layer 0's two residual branches
    emb = target.model.embed_tokens(ids)
    layer0 = target.model.layers[0]
    pos = torch.arange(12)[None].expand(2, -1)
    cos_sin = target.model.rotary_emb(emb, pos)
    mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    after0 = layer0(emb, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    after0 = after0[0] if isinstance(after0, tuple) else after0
    norm1 = target.model.layers[1].input_layernorm
    torch.testing.assert_close(f[..., H:], norm1(after0), rtol=1e-5, atol=1e-5)


def test_a_fresh_fused_head_is_the_plain_head(target_dir):
    target = _target(target_dir)
    plain = build_draft_head(target)
    fused = build_draft_head(target, aux_layers=(1,))
    assert fused.fuse.weight.shape == (H, 2 * H)
    ids = periodic_blocks()[:2, :10]
    wide = target_features(target, ids, (1,))
    with torch.no_grad():
        a = plain(ids[:, 1:], wide[:, :-1, :H])
        b = fused(ids[:, 1:], wide[:, :-1])
    torch.testing.assert_close(a, b)


def test_fused_head_trains_and_uses_the_aux_features(aux_head, target_dir):
    res, out, blocks = aux_head
    assert res.best_kl < 0.3 * res.baseline_kl, res.history
    assert res.best_top1 > res.baseline_top1 + 0.2, res.history
    w = load_file(str(out / "model.safetensors"))
    assert w["fuse.weight"].shape == (H, 2 * H)
    assert w["fuse.weight"][:, H:].abs().max() > 1e-3  # the aux layer's block moved off zero
    config = json.loads((out / "config.json").read_text())
    assert config["llmaccel_draft_head"]["aux_hidden_state_layers"] == [1]
    summary = json.loads((out / "distill.json").read_text())
    assert summary["config"]["aux_layers"] == [1]
    # reloaded as a training module it keeps its layers and weights
    head = load_draft_head(out, _target(target_dir))
    assert head.aux_layers == (1,)
    torch.testing.assert_close(head.fuse.weight, w["fuse.weight"].float())


def test_cached_aux_features_train_the_same_head(target_dir, tmp_path):
    blocks = periodic_blocks()
    runs = {}
    for cached in (False, True):
        out = tmp_path / f"h{int(cached)}"
        runs[cached] = distill_draft(_cfg(target_dir, out, lr=1e-2, steps=8, eval_every=4,
                                          unroll_steps=2, aux_layers=(1,),
                                          cache_features=cached), progress=False,
                                     blocks=blocks), load_file(str(out / "model.safetensors"))
    (plain, plain_w), (fast, fast_w) = runs[False], runs[True]
    for a, b in zip(plain.history, fast.history, strict=True):
        for key in ("train_loss", "heldout_kl", "heldout_top1", "heldout_kl_step2"):
            if a[key] is not None:
                assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a, b)
    for name, w in plain_w.items():
        torch.testing.assert_close(fast_w[name], w, rtol=1e-4, atol=1e-5)
    summary = json.loads((tmp_path / "h1" / "distill.json").read_text())
    assert summary["saved"]["feature_cache"]["bytes"] == 4 * blocks.numel() * 2 * H


@torch.no_grad()
def _head_drafts(head, target, context: list[int], k: int) -> list[int]:
    """k greedy drafts of the training module after `context`, as the engine drafts: the
    context's rows with the target's (fused) features, then the head's own outputs."""
    dev = head.fc.weight.device
    f = head.fuse_features(target_features(target, torch.tensor([context], device=dev),
                                           head.aux_layers))[0]
    ids, feats, drafts = list(context[1:]), list(f[:-1]), []
    for _ in range(k):
        o = head(torch.tensor([ids], device=dev), torch.stack(feats)[None])[0, -1]
        drafts.append(int(head.compute_logits(o).argmax()))
        ids.append(drafts[-1])
        feats.append(o)
    return drafts


@pytest.mark.parametrize("overlap", [False, True])
def test_fused_head_drafts_for_the_target_in_the_engine(aux_head, target_dir, overlap,
                                                       monkeypatch):
    """In our engine (method "head") every round's drafts are the training module's drafts
    from HF's features, so the engine's feature cache holds the same aux features; greedy
    output stays the target's. With overlapped drafting the catch-up reads them on the
    device (HeadProposer.overlap_catch_up)."""
    from llmaccel import LLM, SamplingParams

    _, out, blocks = aux_head
    prompts = [blocks[-1, :9].tolist(), blocks[-2, :5].tolist(), [7, 99, 3, 150, 42]]
    max_tokens = [16, 12, 8]
    target = _target(target_dir)
    expected = hf_greedy(target, prompts, max_tokens)
    overlap_cfg = {"draft_overlap": overlap}
    llm = LLM(str(target_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=16, speculative_config={**overlap_cfg, "method": "head", "model": str(out),
                                                 "num_speculative_tokens": 3,
                                                 "adaptive": False, "draft_vocab_size": 0})
    if overlap:  # overlap needs the head's chain as a graph: emulated on the CPU
        width = -(-llm.engine.model_config.max_model_len // 16)
        graphs_on_cpu(llm.engine.spec.draft.runner, 2, width)
    assert llm.engine.model.feature_cache.shape[1] == 2 * H
    rounds, verify = [], llm.engine.spec.verify

    def recording(seqs, *args, **kw):
        rounds.extend((s.token_slice(0, s.num_tokens), list(s.spec_token_ids)) for s in seqs)
        return verify(seqs, *args, **kw)

    llm.engine.spec.verify = recording
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    spec = llm.get_stats().spec_decode
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0, spec
    head = load_draft_head(out, target)
    assert len(rounds) >= 10
    assert (llm.engine.spec.num_overlapped > 0) == overlap
    for context, drafts in rounds:
        assert drafts == _head_drafts(head, target, context, len(drafts)), len(context)


def test_bad_aux_layers_are_clear_errors(aux_head, target_dir, tmp_path):
    from llmaccel import LLM

    res, out, blocks = aux_head
    with pytest.raises(LLMAccelError, match="aux_layers must be distinct layer indexes >= 1"):
        _cfg(target_dir, tmp_path / "a", aux_layers=(0,)).check()
    with pytest.raises(LLMAccelError, match="aux_layers gives a head"):
        _cfg(target_dir, tmp_path / "a", kind="student", aux_layers=(1,)).check()
    with pytest.raises(LLMAccelError, match=r"aux layers \[2\] must be distinct layer indexes "
                                            r"in 1..1 of a 2-layer target"):
        distill_draft(_cfg(target_dir, tmp_path / "b", steps=1, aux_layers=(2,)),
                      progress=False, blocks=blocks)
    with pytest.raises(LLMAccelError, match=r"has aux layers \[1\], this training \[\]"):
        distill_draft(_cfg(target_dir, tmp_path / "c", steps=1, init_head=str(out)),
                      progress=False, blocks=blocks)
    # a checkpoint whose marker names a layer the target lacks, or lacks its fuse weight
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((out / "config.json").read_text())
    config["llmaccel_draft_head"]["aux_hidden_state_layers"] = [5]
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())

    def load(head):
        return LLM(str(target_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
                   speculative_config={"method": "head", "model": str(head),
                                       "num_speculative_tokens": 2, "draft_vocab_size": 0})

    with pytest.raises(CorruptCheckpointError, match=r"aux_hidden_state_layers \[5\] must be "
                                                     r"distinct layer indexes in 1..1"):
        load(bad)
    config["llmaccel_draft_head"]["aux_hidden_state_layers"] = [1]
    (bad / "config.json").write_text(json.dumps(config))
    w = load_file(str(out / "model.safetensors"))
    del w["fuse.weight"]
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="lacks 1 weights.*fuse"):
        load(bad)


def test_cli_takes_aux_layers(tmp_path):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    r = CliRunner().invoke(app, ["distill-draft", "x", "--aux-layers", "2,a", "--out",
                                 str(tmp_path / "o")])
    assert isinstance(r.exception, LLMAccelError)
    assert "--aux-layers takes comma-separated integers" in str(r.exception)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_fused_head_under_cuda_graphs_on_gpu(aux_head, target_dir, overlap, monkeypatch):
    """On the GPU the target writes its aux features inside its CUDA graphs and the head's
    steps replay theirs; in fp32 the drafts follow the training module's (HF's features) and
    outputs stay the target's."""
    from llmaccel import LLM, SamplingParams

    _, out, blocks = aux_head
    overlap_cfg = {"draft_overlap": overlap}
    prompts = [blocks[-1, :9].tolist(), blocks[-2, :5].tolist(), [7, 99, 3, 150, 42]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", skip_tokenizer_init=True, block_size=16)
    want = [o.outputs[0].token_ids for o in
            LLM(str(target_dir), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(target_dir), speculative_config={**overlap_cfg, 
        "method": "head", "model": str(out), "num_speculative_tokens": 3, "adaptive": False,
        "draft_vocab_size": 0, "auto_disable": False}, **kw)
    assert llm.engine.spec.draft.runner.graphs is not None
    rounds, verify = [], llm.engine.spec.verify

    def recording(seqs, *args, **kw):
        rounds.extend((s.token_slice(0, s.num_tokens), list(s.spec_token_ids)) for s in seqs)
        return verify(seqs, *args, **kw)

    llm.engine.spec.verify = recording
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    target = _target(target_dir).cuda()
    head = load_draft_head(out, target)
    same = sum(dr == _head_drafts(head, target, ctx, len(dr)) for ctx, dr in rounds)
    assert len(rounds) >= 10 and same >= 0.9 * len(rounds), (same, len(rounds))
    assert (llm.engine.spec.num_overlapped > 0) == overlap
    assert llm.engine.block_manager.num_used_blocks == 0
