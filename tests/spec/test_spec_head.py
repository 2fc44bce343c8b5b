"""Speculative method "head" (an EAGLE-style draft head) in the engine: every round's drafts
equal an independent computation from the target's features (transformers) and the head's
definition, with prefix caching, chunked prefill and preemption; outputs stay the target's
greedy tokens; blocks come back; bad heads are clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_tiny_head, make_tiny_model, tiny_configs

from llmaccel import LLM, SamplingParams
from llmaccel.errors import CorruptCheckpointError, LLMAccelError

K = 3
SPEC = {"method": "head", "num_speculative_tokens": K, "adaptive": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("head-pair")
    cfg = tiny_configs()["qwen2"]
    hf = make_tiny_model(cfg, d / "target", seed=1)
    tensors = make_tiny_head(cfg, d / "head", seed=5, fc_bias=True)
    return d, hf, tensors


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Rotate-half rotary embedding of x [T, heads, d] at positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat(
        [ang.sin()] * 2, -1)[:, None].float()
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_head(t: dict, cfg, emb_ids, feats):
    """The head's outputs o_i for inputs (emb_ids[i], feats[i]) at positions 0..T-1, written
    from its definition: fc, causal GQA attention with rope (no input norm), residual, RMSNorm,
    SiLU MLP, residual."""
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = h // heads
    x = torch.cat([emb_ids, feats], -1) @ t["fc.weight"].T + t.get("fc.bias", 0.0)
    T = x.shape[0]
    pos = torch.arange(T)
    p = "layers.0."
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(T, heads, hd)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(T, kv, hd)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(T, kv, hd)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), -torch.inf)
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, h)
    r = x + attn @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(r, t[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    m = torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (
        m @ t[p + "mlp.up_proj.weight"].T)
    return r + m @ t[p + "mlp.down_proj.weight"].T


@torch.no_grad()
def reference_drafts(hf, t: dict, tokens: list[int], k: int,
                     vocab: list[int] | None = None) -> list[int]:
    """k greedy drafts after `tokens`: the target's final-norm features f_i of the context,
    the head over (token i + 1, f_i), then its own outputs for further drafts; with `vocab`,
    each draft is the argmax over those tokens only."""
    ids = torch.tensor([tokens])
    feats = list(hf.model(ids).last_hidden_state[0, :-1])
    emb, lm = hf.model.embed_tokens.weight, hf.lm_head.weight
    toks = list(tokens[1:])
    drafts = []
    for _ in range(k):
        out = reference_head(t, hf.config, emb[torch.tensor(toks)], torch.stack(feats))[-1]
        logits = out @ lm.T
        d = (int(logits.argmax()) if vocab is None
             else vocab[int(logits[torch.tensor(vocab)].argmax())])
        drafts.append(d)
        toks.append(d)
        feats.append(out)
    return drafts


def _record_rounds(llm):
    """Wrap the engine's verify: (context tokens, drafts) of every drafting sequence."""
    spec = llm.engine.spec
    rounds, verify = [], spec.verify

    def recording(seqs, *args, **kw):
        for s in seqs:
            rounds.append((s.token_slice(0, s.num_tokens), list(s.spec_token_ids)))
        return verify(seqs, *args, **kw)

    spec.verify = recording
    return rounds


MODES = {
    "plain": {},
    "prefix-chunked-preempt": dict(enable_prefix_caching=True, max_num_batched_tokens=16,
                                   num_gpu_blocks=14, max_model_len=192),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_drafts_equal_the_reference_and_outputs_the_target(pair, mode):
    d, hf, tensors = pair
    base = [11, 12, 13, 14, 15] * 12
    prompts = [base + [3, 4], base + [7], [5, 6, 7, 8] * 3, list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
                block_size=16, **MODES[mode])
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(d / "target"), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=16, speculative_config={**SPEC, "model": str(d / "head")},
              **MODES[mode])
    rounds = _record_rounds(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert len(rounds) >= 40
    for context, drafts in rounds:
        assert drafts == reference_drafts(hf, tensors, context, len(drafts)), len(context)
    stats = llm.get_stats()
    assert stats.kv_usage == 0 and llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.spec.draft.block_manager.num_used_blocks == 0
    if mode != "plain":
        assert stats.prefix_hit_rate > 0 and stats.num_preemptions > 0


def _with_vocab(d, tmp_path, ids) -> str:
    """A copy of the pair's head with a draft_vocab.json of `ids`."""
    import shutil

    head = tmp_path / "head-vocab"
    shutil.copytree(d / "head", head)
    (head / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
    return str(head)


@pytest.mark.parametrize("size", [None, 20])
def test_a_draft_vocabulary_restricts_the_drafts(pair, tmp_path, size):
    """With draft_vocab.json the head drafts the argmax over its tokens only (the first
    draft_vocab_size of them when set); greedy outputs stay the target's; blocks come back."""
    d, hf, tensors = pair
    ids = list(range(100, 10, -3))  # 30 ids, deliberately not sorted
    head = _with_vocab(d, tmp_path, ids)
    vocab = ids if size is None else ids[:size]
    prompts = [[11, 12, 13, 14, 15] * 6 + [3, 4], [5, 6, 7, 8] * 3, list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=16)
    want = [o.outputs[0].token_ids for o in
            LLM(str(d / "target"), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(d / "target"), speculative_config={**SPEC, "model": head,
                                                     "draft_vocab_size": size}, **kw)
    assert llm.engine.draft_head.draft_ids.tolist() == sorted(vocab)  # kept in id order
    rounds = _record_rounds(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert len(rounds) >= 20
    for context, drafts in rounds:
        assert set(drafts) <= set(vocab)
        assert drafts == reference_drafts(hf, tensors, context, len(drafts), vocab)
    # the restriction matters: the whole vocabulary drafts differently somewhere
    assert any(dr != reference_drafts(hf, tensors, ctx, len(dr)) for ctx, dr in rounds)
    assert llm.engine.spec.draft.block_manager.num_used_blocks == 0


def test_bad_draft_vocabularies_are_clear_errors(pair, tmp_path):
    d, _, _ = pair
    target = str(d / "target")

    def load(head, **spec):
        return LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
                   speculative_config={**SPEC, "model": str(head), **spec})

    with pytest.raises(LLMAccelError, match="needs the head's draft_vocab.json"):
        load(d / "head", draft_vocab_size=8)
    head = _with_vocab(d, tmp_path, [1, 2, 3])
    with pytest.raises(LLMAccelError, match="larger than the 3 tokens"):
        load(head, draft_vocab_size=4)
    assert load(head, draft_vocab_size=0).engine.draft_head.draft_ids is None
    for bad in ([1, 1], [1, 10 ** 6], [], "x"):
        (tmp_path / "head-vocab" / "draft_vocab.json").write_text(
            json.dumps({"token_ids": bad}))
        with pytest.raises(CorruptCheckpointError, match="distinct token ids"):
            load(head)
    (tmp_path / "head-vocab" / "draft_vocab.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="is not a draft vocabulary"):
        load(head)
    with pytest.raises(LLMAccelError, match="applies to method='head'"):
        LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
            speculative_config={"method": "ngram", "draft_vocab_size": 8})


def test_bad_heads_are_clear_errors(pair, tmp_path):
    d, hf, _ = pair
    target = str(d / "target")

    def load(head):
        return LLM(target, dtype="float32", device="cpu", skip_tokenizer_init=True,
                   speculative_config={**SPEC, "model": str(head)})

    with pytest.raises(LLMAccelError, match="has no config.json"):
        load(tmp_path / "nowhere")
    with pytest.raises(LLMAccelError, match="is not a draft head"):
        load(d / "target")
    wide = tiny_configs()["qwen2"]
    wide.hidden_size = 96
    make_tiny_head(wide, tmp_path / "wide", seed=1)
    with pytest.raises(LLMAccelError, match="hidden_size 96, the target 64"):
        load(tmp_path / "wide")
    from safetensors.torch import load_file, save_file

    torn = tmp_path / "torn"
    make_tiny_head(tiny_configs()["qwen2"], torn, seed=1)
    t = load_file(str(torn / "model.safetensors"))
    del t["layers.0.mlp.down_proj.weight"]
    save_file(t, str(torn / "model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="lacks 1 weights"):
        load(torn)
    cfg = json.loads((torn / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (torn / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError, match="num_hidden_layers 2"):
        load(torn)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [None, list(range(100, 10, -3))])
def test_head_under_cuda_graphs_on_gpu(pair, tmp_path, vocab):
    """The head's catch-up and draft steps replay CUDA graphs (static feature and output
    buffers, the draft vocabulary's scatter); in fp32 its drafts follow the CPU reference and
    outputs stay the target's."""
    d, hf, tensors = pair
    head = str(d / "head") if vocab is None else _with_vocab(d, tmp_path, vocab)
    prompts = [[11, 12, 13, 14, 15] * 12 + [3, 4], [5, 6, 7, 8] * 3, list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", skip_tokenizer_init=True, block_size=16,
              enable_prefix_caching=True)
    want = [o.outputs[0].token_ids for o in
            LLM(str(d / "target"), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(d / "target"), speculative_config={**SPEC, "model": head,
                                                     "auto_disable": False}, **kw)
    assert llm.engine.spec.draft.runner.graphs is not None
    rounds = _record_rounds(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    same = sum(dr == reference_drafts(hf, tensors, ctx, len(dr), vocab) for ctx, dr in rounds)
    assert len(rounds) >= 30 and same >= 0.9 * len(rounds), (same, len(rounds))
    assert llm.engine.block_manager.num_used_blocks == 0
