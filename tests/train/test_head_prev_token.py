"""A draft head that also reads the token at each feature's position (`prev_token`,
train/head_trainer.py and models/eagle_head.py): fc(cat[embed(x_{i+1}), f_i, embed(x_i)]).

Checked here: a fresh one is EAGLE-1's head plus a third fc part of the documented size (a
scaled rotation); training lowers its held-out KL and moves that part; the unrolled training
steps read the token at each drafted position; a plain head starts one (init_head) with its
own weights in the first two parts; in our engine the head drafts exactly what the training
module drafts, every round, eagerly, through the graph runner's chained steps and with
overlapped drafting (the catch-up's ids on the device), and the drafts do depend on those
ids; bad settings and checkpoints are clear errors."""

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
from llmaccel.train.head_trainer import build_draft_head, load_draft_head, target_features
from llmaccel.train.head_init import PREV_TOKEN_INIT

H = 64  # tiny_models' hidden size (2 layers)


def _cfg(target, out, **kw) -> DistillConfig:
    base = dict(target=str(target), out=str(out), steps=30, batch_size=4, eval_every=10,
                heldout=0.2, patience=5, device="cpu", kind="head", prev_token=True)
    return DistillConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prev-target")
    make_tiny_model(tiny_configs()["llama"], d, seed=3)
    return d


def _target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prev_head(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prev-head")
    blocks = periodic_blocks()
    res = distill_draft(_cfg(target_dir, out, lr=1e-2), progress=False, blocks=blocks)
    # The engine tests' copy: the previous token's part made loud, so drafts that read a wrong
    # id there come out different (the reference with wrong ids is checked to differ)
    loud = out.parent / (out.name + "-loud")
    loud.mkdir()
    w = load_file(str(out / "model.safetensors"))
    w["fc.weight"][:, 2 * H:] *= 8
    save_file(w, str(loud / "model.safetensors"), metadata={"format": "pt"})
    (loud / "config.json").write_text((out / "config.json").read_text())
    return res, out, loud, blocks


def test_a_fresh_head_is_eagle1_plus_a_scaled_rotation(target_dir):
    target = _target(target_dir)
    plain = build_draft_head(target)
    head = build_draft_head(target, prev_token=True)
    assert head.fc.weight.shape == (H, 3 * H)
    torch.testing.assert_close(head.fc.weight[:, :2 * H], plain.fc.weight)
    torch.testing.assert_close(head.layers.state_dict(), plain.layers.state_dict())
    # PREV_TOKEN_INIT x (final norm RMS / embedding RMS) x an orthogonal matrix
    emb_rms = target.model.embed_tokens.weight.pow(2).mean().sqrt()
    norm_rms = target.model.norm.weight.pow(2).mean().sqrt()
    scale = PREV_TOKEN_INIT * norm_rms / emb_rms
    part = head.fc.weight[:, 2 * H:].detach()
    torch.testing.assert_close(part @ part.T, scale ** 2 * torch.eye(H), rtol=1e-4,
                               atol=1e-4 * float(scale) ** 2)
    ids = periodic_blocks()[:2, :10]
    f = target_features(target, ids)
    with torch.no_grad():
        a = head(ids[:, 1:], f[:, :-1], ids[:, :-1])
        b = head(ids[:, 1:], f[:, :-1], torch.zeros_like(ids[:, :-1]))
    assert not torch.allclose(a, b)  # the third part is heard
    with pytest.raises(LLMAccelError, match="give prev_ids"):
        head(ids[:, 1:], f[:, :-1])


def test_unrolled_steps_read_the_token_at_each_drafted_position(target_dir):
    """unroll's step 2 at row t is the head drafting after x_0..x_{t+1} on its own step-1
    output: the row (x_{t+2}, o^1_t, x_{t+1}) at position t + 1 after the context's rows."""
    torch.manual_seed(0)
    target = _target(target_dir)
    head = build_draft_head(target, prev_token=True)
    with torch.no_grad():
        head.fc.weight[:, 2 * H:].normal_(0, 1.0)  # loud, so a wrong id shows
    ids = periodic_blocks(seed=4)[:1, :9]
    f = target_features(target, ids)
    with torch.no_grad():
        o1, o2 = head.unroll(ids, f[:, :-1], 2)
        for t in (0, 3, 5):
            ctx_ids, ctx_f, ctx_prev = ids[:, 1:t + 2], f[:, :t + 1], ids[:, :t + 1]
            torch.testing.assert_close(head(ctx_ids, ctx_f, ctx_prev)[:, -1], o1[:, t])
            step2 = head(torch.cat([ctx_ids, ids[:, t + 2:t + 3]], 1),
                         torch.cat([ctx_f, o1[:, t:t + 1]], 1),
                         torch.cat([ctx_prev, ids[:, t + 1:t + 2]], 1))[:, -1]
            torch.testing.assert_close(step2, o2[:, t], rtol=1e-4, atol=1e-5)


def test_prev_token_head_trains_and_saves_its_third_part(prev_head, target_dir):
    res, out, _, _ = prev_head
    assert res.best_kl < 0.3 * res.baseline_kl, res.history
    assert res.best_top1 > res.baseline_top1 + 0.2, res.history
    config = json.loads((out / "config.json").read_text())
    assert config["llmaccel_draft_head"]["prev_token_embedding"] is True
    assert json.loads((out / "distill.json").read_text())["config"]["prev_token"] is True
    w = load_file(str(out / "model.safetensors"))
    assert w["fc.weight"].shape == (H, 3 * H)
    fresh = build_draft_head(_target(target_dir), prev_token=True)
    assert not torch.allclose(w["fc.weight"][:, 2 * H:], fresh.fc.weight[:, 2 * H:].detach())
    head = load_draft_head(out, _target(target_dir))
    assert head.prev_token
    torch.testing.assert_close(head.fc.weight, w["fc.weight"].float())


def test_a_plain_head_starts_a_prev_token_head(target_dir, tmp_path):
    blocks = periodic_blocks()
    plain = tmp_path / "plain"
    distill_draft(_cfg(target_dir, plain, steps=4, eval_every=2, prev_token=False, lr=1e-2),
                  progress=False, blocks=blocks)
    # zero steps of training keep the starting point: steps=1 at lr ~0 (warm-up)
    out = tmp_path / "grown"
    distill_draft(_cfg(target_dir, out, steps=1, eval_every=1, init_head=str(plain), lr=1e-12),
                  progress=False, blocks=blocks)
    old, new = load_file(str(plain / "model.safetensors")), load_file(str(out / "model.safetensors"))
    torch.testing.assert_close(new["fc.weight"][:, :2 * H], old["fc.weight"])
    fresh = build_draft_head(_target(target_dir), prev_token=True)
    torch.testing.assert_close(new["fc.weight"][:, 2 * H:], fresh.fc.weight[:, 2 * H:].detach())
    for name in old:
        if name != "fc.weight":
            torch.testing.assert_close(new[name], old[name])
    with pytest.raises(LLMAccelError, match="reads the previous token.*set prev_token"):
        distill_draft(_cfg(target_dir, tmp_path / "back", steps=1, prev_token=False,
                           init_head=str(out)), progress=False, blocks=blocks)


@torch.no_grad()
def _head_drafts(head, target, context: list[int], k: int, wrong_prev: bool = False
                 ) -> list[int]:
    """k greedy drafts of the training module after `context`, as the engine drafts: the
    context's rows with the target's features and the token at each feature's position,
    then the head's own outputs and its previous input token. `wrong_prev`: token 0 at every
    position instead (what a head that lost its ids would draft)."""
    f = target_features(target, torch.tensor([context]))[0]
    ids, feats, prev, drafts = list(context[1:]), list(f[:-1]), list(context[:-1]), []
    for _ in range(k):
        p = [0] * len(prev) if wrong_prev else prev
        o = head(torch.tensor([ids]), torch.stack(feats)[None], torch.tensor([p]))[0, -1]
        drafts.append(int(head.compute_logits(o).argmax()))
        prev.append(ids[-1])
        ids.append(drafts[-1])
        feats.append(o)
    return drafts


@pytest.mark.parametrize("mode", ["eager", "chained", "overlap"])
def test_prev_token_head_drafts_for_the_target_in_the_engine(prev_head, target_dir, mode,
                                                             monkeypatch):
    """In our engine (method "head") every round's drafts are the training module's drafts
    from HF's features and the right previous tokens; greedy output stays the target's.
    chained: the graph runner's chained steps (the previous token from the last step's
    input, DraftHeadForCausalLM.prepare_chained_step); overlap: the catch-up's ids on the
    device (HeadProposer.overlap_catch_up)."""
    from llmaccel import LLM, SamplingParams

    _, _, loud, blocks = prev_head
    prompts = [blocks[-1, :9].tolist(), blocks[-2, :5].tolist(), [7, 99, 3, 150, 42]]
    # long enough that every request has room for the next round's drafts for a while
    # (overlap launches them only then: spec/overlap.launch_next_round)
    max_tokens = [24, 20, 16]
    target = _target(target_dir)
    expected = hf_greedy(target, prompts, max_tokens)
    overlap_cfg = {"draft_overlap": mode == "overlap"}
    llm = LLM(str(target_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
              block_size=16, speculative_config={
                  **overlap_cfg, "method": "head", "model": str(loud),
                  "num_speculative_tokens": 3, "adaptive": False, "draft_vocab_size": 0})
    if mode != "eager":
        width = -(-llm.engine.model_config.max_model_len // 16)
        graphs_on_cpu(llm.engine.spec.draft.runner, 2, width)
    rounds, verify = [], llm.engine.spec.verify

    def recording(seqs, *args, **kw):
        rounds.extend((s.token_slice(0, s.num_tokens), list(s.spec_token_ids)) for s in seqs)
        return verify(seqs, *args, **kw)

    llm.engine.spec.verify = recording
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    head = load_draft_head(loud, target)
    assert len(rounds) >= 10
    assert (llm.engine.spec.num_overlapped > 0) == (mode == "overlap")
    differs = 0
    for context, drafts in rounds:
        assert drafts == _head_drafts(head, target, context, len(drafts)), len(context)
        differs += drafts != _head_drafts(head, target, context, len(drafts), wrong_prev=True)
    assert differs >= len(rounds) // 3, (differs, len(rounds))  # the ids matter
    assert llm.engine.block_manager.num_used_blocks == 0


def test_bad_prev_token_settings_are_clear_errors(prev_head, target_dir, tmp_path):
    from llmaccel import LLM

    _, out, _, _ = prev_head
    with pytest.raises(LLMAccelError, match="prev_token gives a head"):
        _cfg(target_dir, tmp_path / "a", kind="student").check()
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((out / "config.json").read_text())
    config["llmaccel_draft_head"]["prev_token_embedding"] = "yes"
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())

    def load(head):
        return LLM(str(target_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
                   speculative_config={"method": "head", "model": str(head),
                                       "num_speculative_tokens": 2, "draft_vocab_size": 0})

    with pytest.raises(CorruptCheckpointError, match="prev_token_embedding 'yes' must be true"):
        load(bad)
    # the marker says plain, the weights are three parts wide
    config["llmaccel_draft_head"]["prev_token_embedding"] = False
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CorruptCheckpointError, match="does not match its config"):
        load(bad)


def test_cli_takes_prev_token(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import llmaccel.train.distill as distill
    from llmaccel.cli import app

    seen = {}

    def fake(cfg, *a, **kw):
        seen["cfg"] = cfg
        raise LLMAccelError("stop here")

    monkeypatch.setattr(distill, "distill_draft", fake)
    r = CliRunner().invoke(app, ["distill-draft", "x", "--kind", "head", "--prev-token",
                                 "--out", str(tmp_path / "o")])
    assert isinstance(r.exception, LLMAccelError), r.output
    assert seen["cfg"].prev_token is True
    assert math.isclose(seen["cfg"].kl_weight, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_prev_token_head_under_cuda_graphs_on_gpu(prev_head, target_dir, overlap, monkeypatch):
    """On the GPU the head's catch-up and chained steps replay CUDA graphs that read the
    previous tokens from static buffers; in fp32 the drafts follow the training module's and
    outputs stay the target's."""
    from llmaccel import LLM, SamplingParams

    _, _, loud, blocks = prev_head
    overlap_cfg = {"draft_overlap": overlap}
    prompts = [blocks[-1, :9].tolist(), blocks[-2, :5].tolist(), [7, 99, 3, 150, 42]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", skip_tokenizer_init=True, block_size=16)
    want = [o.outputs[0].token_ids for o in
            LLM(str(target_dir), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(target_dir), speculative_config={**overlap_cfg, 
        "method": "head", "model": str(loud), "num_speculative_tokens": 3, "adaptive": False,
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
    head = load_draft_head(loud, target)
    with torch.device("cuda"):
        same = sum(dr == _head_drafts(head, target, ctx, len(dr)) for ctx, dr in rounds)
    assert len(rounds) >= 10 and same >= 0.9 * len(rounds), (same, len(rounds))
    assert (llm.engine.spec.num_overlapped > 0) == overlap
    assert llm.engine.block_manager.num_used_blocks == 0


def test_attention_init_random_draws_q_and_k_afresh(target_dir, tmp_path):
    """attention_init="random": the layer's q/k drawn afresh (the copied last layer's
    attention sits on a sink row), everything else as the target-initialized head; from a
    saved head, its weights with fresh q/k."""
    target = _target(target_dir)
    torch.manual_seed(0)
    copied = build_draft_head(target)
    fresh = build_draft_head(target, attention_init="random")
    a, b = copied.state_dict(), fresh.state_dict()
    for name in a:
        if "q_proj" in name or "k_proj" in name:
            assert not torch.allclose(a[name], b[name]), name
            assert abs(float(b[name].std()) - 0.02) < 0.005, name
        else:
            torch.testing.assert_close(a[name], b[name])
    with pytest.raises(LLMAccelError, match="attention_init must be target or random"):
        build_draft_head(target, attention_init="zeros")
    with pytest.raises(LLMAccelError, match="attention_init must be target or random"):
        _cfg(target_dir, tmp_path / "x", attention_init="zeros").check()
    # from a saved head: its weights, q/k afresh
    blocks = periodic_blocks()
    start, out = tmp_path / "start", tmp_path / "out"
    distill_draft(_cfg(target_dir, start, steps=2, eval_every=2, prev_token=False),
                  progress=False, blocks=blocks)
    distill_draft(_cfg(target_dir, out, steps=1, eval_every=1, prev_token=False, lr=1e-12,
                       init_head=str(start), attention_init="random"), progress=False,
                  blocks=blocks)
    old, new = load_file(str(start / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name in old:
        same = torch.allclose(old[name], new[name])
        assert same != ("q_proj" in name or "k_proj" in name), name


def test_the_heads_attention_weights_are_the_layers(target_dir):
    """train/head_metrics.attention_weights (what evaluate_head's sink share and the copy
    diagnostic read) against transformers' eager attention of the head's layer, per block."""
    from llmaccel.train.head_metrics import attention_weights

    target = _target(target_dir)
    torch.manual_seed(0)
    head = build_draft_head(target, prev_token=True, attention_init="random").eval()
    with torch.no_grad():
        head.layers[0].self_attn.q_proj.weight.mul_(30)  # peaked weights, not near uniform
    ids = periodic_blocks()[:2, :20]
    f = target_features(target, ids)
    n = ids.shape[1] - 1
    got = attention_weights(head, ids, f[:, :-1])
    with torch.no_grad():
        h = head._inputs(ids[:, 1:], f[:, :-1], ids[:, :-1])
        attn = head.layers[0].self_attn
        attn.config._attn_implementation = "eager"
        cos_sin = head.rotary_emb(h, torch.arange(n)[None].expand(2, n))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        _, weights = attn(hidden_states=h, position_embeddings=cos_sin, attention_mask=mask)
    torch.testing.assert_close(got, weights.mean(1))
    assert got[0].max() > 0.5  # peaked: the check is not between two uniform rows