"""Draft distillation (llmaccel/train/distill.py, draft_head.py): training a head or a student
lowers its held-out KL to the target and raises top-1 agreement; the head's forward is the
EAGLE-1 semantics, checked against a step-by-step computation; the saved head has exactly the
checkpoint's tensors and reloads to the same logits; the saved student loads in transformers
and drafts for the target in our engine with unchanged greedy output; the CLI runs and its
bad inputs fail clearly."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from engine_matrix import hf_greedy
from safetensors.torch import load_file
from distill_case import H, V, distill_cfg, drafted_outputs, hf_target, make_distill_target
from tiny_models import make_tiny_model, periodic_blocks, save_word_tokenizer, tiny_configs

from llmaccel.errors import LLMAccelError
from llmaccel.train.distill import build_student, distill_draft, evaluate_student
from llmaccel.train.head_trainer import (LAYER_TENSORS, build_draft_head, load_draft_head,
                                       save_draft_head, target_features)
from llmaccel.train.head_training import evaluate_head



@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_distill_target(tmp_path_factory.mktemp("distill-target"))


@pytest.fixture(scope="module")
def trained_head(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    blocks = periodic_blocks()
    return distill_draft(distill_cfg(target_dir, out, kind="head", lr=1e-2), progress=False,
                         blocks=blocks), out, blocks


def test_head_training_lowers_heldout_kl_and_raises_agreement(trained_head):
    res, out, _ = trained_head
    assert res.stopped is None and res.steps_run == 30 and res.best_step > 0
    assert res.best_kl < 0.3 * res.baseline_kl, res.history
    assert res.best_top1 > res.baseline_top1 + 0.2, res.history
    regs = [h["heldout_reg"] for h in res.history]
    assert regs[-1] < 0.5 * regs[0]  # o_i moves onto f_{i+1} too
    summary = json.loads((out / "distill.json").read_text())
    assert summary["kind"] == "head" and len(summary["history"]) == 4
    assert summary["best_kl"] == res.best_kl and summary["best_step"] == res.best_step


def test_head_saves_its_training_texts_draft_vocabulary(trained_head):
    res, out, blocks = trained_head
    vocab = json.loads((out / "draft_vocab.json").read_text())
    train = blocks[:len(blocks) - 8]  # heldout 0.2 of 40 blocks: the last 8
    counts = torch.bincount(train.flatten(), minlength=V)
    # every token of the text, most frequent first (the motif's 7 tokens), counts as counted
    assert sorted(vocab["token_ids"]) == sorted(set(train.flatten().tolist()))
    assert vocab["counts"] == [int(counts[i]) for i in vocab["token_ids"]]
    assert vocab["counts"] == sorted(vocab["counts"], reverse=True)
    assert vocab["coverage"] == 1.0 and vocab["tokens_counted"] == train.numel()
    summary = json.loads((out / "distill.json").read_text())
    assert summary["saved"]["draft_vocab"]["size"] == 7
    # evaluations report agreement over the draft vocabulary: at most the full one's (the
    # random target's argmax is rarely a motif token)
    for row in res.history:
        assert 0.0 <= row["heldout_top1_draft_vocab"] <= 1.0


def test_a_small_draft_vocabulary_keeps_the_most_frequent_tokens():
    from llmaccel.train.head_trainer import draft_vocabulary

    blocks = torch.tensor([[5, 5, 5, 9, 9, 2], [5, 9, 2, 7, 7, 7]])
    ids, info = draft_vocabulary(blocks, 12, 3)
    assert ids.tolist() == [5, 7, 9] and info["counts"] == [4, 3, 3]  # ties: lower id first
    assert info["distinct_tokens"] == 4 and info["coverage"] == round(10 / 12, 6)


def test_saved_head_has_the_checkpoint_format_and_reloads(trained_head, target_dir):
    res, out, blocks = trained_head
    tensors = load_file(str(out / "model.safetensors"))
    expected = {"fc.weight": (H, 2 * H)}
    shapes = {"q_proj": (64, H), "k_proj": (32, H), "v_proj": (32, H), "o_proj": (H, 64),
              "gate_proj": (96, H), "up_proj": (96, H), "down_proj": (H, 96),
              "post_attention_layernorm": (H,)}
    for name in LAYER_TENSORS:
        expected[f"layers.0.{name}"] = next(s for k, s in shapes.items() if k in name)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == torch.float32 for v in tensors.values())  # the target's dtype
    config = json.loads((out / "config.json").read_text())
    target_config = json.loads((target_dir / "config.json").read_text())
    assert config["llmaccel_draft_head"] == {"kind": "eagle", "target": str(target_dir),
                                             "feature": "final_norm_output", "fc_bias": False}
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["head_dim"] == 16
    assert config["rope_parameters"] == target_config["rope_parameters"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size"):
        assert config[key] == target_config[key], key
    # the best evaluation's weights were saved: reloaded, they score the best held-out KL
    head = load_draft_head(out, hf_target(target_dir))
    held = blocks[-8:]
    again = evaluate_head(head, hf_target(target_dir), held, 4)
    assert math.isclose(again["heldout_kl"], res.best_kl, rel_tol=1e-5)


@torch.no_grad()
def _head_drafts(head, target, context: list[int], k: int) -> list[int]:
    """k greedy drafts of the training module after `context`, as the engine drafts: rows
    (x_{i+1}, f_i) for the context (the last token has no target feature yet), then the
    head's own outputs o in place of the features it lacks."""
    f = target_features(target, torch.tensor([context]))[0]
    ids, feats, drafts = list(context[1:]), list(f[:-1]), []
    for _ in range(k):
        o = head(torch.tensor([ids]), torch.stack(feats)[None])[0, -1]
        drafts.append(int(head.compute_logits(o).argmax()))
        ids.append(drafts[-1])
        feats.append(o)
    return drafts


def test_trained_head_drafts_for_the_target_in_the_engine(trained_head, target_dir):
    """The saved head loads in our engine (method "head"): greedy output stays the target's,
    drafts are accepted, and every round's drafts are the training module's."""
    from llmaccel import LLM, SamplingParams

    _, out, blocks = trained_head
    prompts = [blocks[-1, :9].tolist(), blocks[-2, :5].tolist(), [7, 99, 3, 150, 42]]
    max_tokens = [16, 12, 8]
    target = hf_target(target_dir)
    expected = hf_greedy(target, prompts, max_tokens)
    llm = LLM(str(target_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
              speculative_config={"method": "head", "model": str(out),
                                  "num_speculative_tokens": 3, "adaptive": False,
                                  # the whole vocabulary: the training text (7 tokens) is
                                  # not this random target's output, as real heads' is
                                  "draft_vocab_size": 0})
    rounds, verify = [], llm.engine.spec.verify

    def recording(seqs, *args, **kw):  # (context, drafts) of every drafting sequence
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
    for context, drafts in rounds:
        assert drafts == _head_drafts(head, target, context, len(drafts)), len(context)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_head_save_and_load_reproduce_the_logits(family, tmp_path):
    """With an fc bias and a target whose head_dim is not hidden / heads (mistral) or whose
    q/k/v have biases the head drops (qwen2): saved, reloaded, the same logits."""
    target = make_tiny_model(tiny_configs()[family], tmp_path / "t", seed=4)
    head = build_draft_head(target, target_name="t", fc_bias=True)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_draft_head(head, tmp_path / "head")
    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert names == {"fc.weight", "fc.bias"} | {f"layers.0.{n}" for n in LAYER_TENSORS}
    ids = periodic_blocks(2, 20)
    f = target_features(target, ids)
    want = head.compute_logits(head(ids[:, 1:], f[:, :-1]))
    again = load_draft_head(tmp_path / "head", target)
    got = again.compute_logits(again(ids[:, 1:], f[:, :-1]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Rotate one head vector [d] to position `pos` (halves convention, HF/Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    rotated = torch.cat([-x[d // 2:], x[:d // 2]])
    return (x.double() * cos + rotated.double() * sin).to(x.dtype)


def _step_by_step(head, next_ids: torch.Tensor, feats: torch.Tensor, emb: torch.Tensor,
                  config: dict) -> torch.Tensor:
    """Output row i of one sequence from the prefix 0..i only, written out as EAGLE-1
    describes it: fc, attention without an input norm, residual, post-norm MLP, residual."""
    w = {k: v.detach() for k, v in head.state_dict().items()}
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    theta = config["rope_parameters"]["rope_theta"]
    eps = config["rms_norm_eps"]

    def lin(name, x):
        return x @ w[f"layers.0.{name}.weight"].T

    hs = [w["fc.weight"] @ torch.cat([emb[next_ids[i]], feats[i]]) for i in range(len(next_ids))]
    outs = []
    for i in range(len(hs)):
        q = lin("self_attn.q_proj", hs[i]).view(nh, d)
        keys = [lin("self_attn.k_proj", hs[j]).view(nkv, d) for j in range(i + 1)]
        vals = [lin("self_attn.v_proj", hs[j]).view(nkv, d) for j in range(i + 1)]
        heads = []
        for n in range(nh):
            g = n // (nh // nkv)  # the key/value head this query head shares
            qn = _rope(q[n], i, theta)
            scores = torch.stack([_rope(keys[j][g], j, theta) @ qn for j in range(i + 1)])
            probs = torch.softmax(scores / math.sqrt(d), dim=0)
            heads.append(sum(p * vals[j][g] for j, p in enumerate(probs)))
        r = hs[i] + lin("self_attn.o_proj", torch.cat(heads))
        normed = (r / torch.sqrt(r.pow(2).mean() + eps)
                  * w["layers.0.post_attention_layernorm.weight"])
        m = lin("mlp.down_proj",
                F.silu(lin("mlp.gate_proj", normed)) * lin("mlp.up_proj", normed))
        outs.append(r + m)
    return torch.stack(outs)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_head_forward_equals_a_step_by_step_computation(family, tmp_path):
    target = make_tiny_model(tiny_configs()[family], tmp_path, seed=5)
    head = build_draft_head(target, init=False)  # random weights: nothing cancels by design
    ids = periodic_blocks(1, 12, period=5)
    f = target_features(target, ids)
    with torch.no_grad():
        got = head(ids[:, 1:], f[:, :-1])[0]
        want = _step_by_step(head, ids[0, 1:], f[0, :-1], target.get_input_embeddings().weight,
                             head.config_dict)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got[1:].sub(got[:-1]).abs().max() > 1e-3  # rows differ: positions matter
    # the logits are the target's lm_head on o
    torch.testing.assert_close(head.compute_logits(got), got @ target.lm_head.weight.T)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_unrolled_head_equals_drafting_on_its_own_outputs(family, tmp_path):
    """DraftHead.unroll (training on its own drafts, one masked layer call per step) gives
    at every row and step what drafting row by row gives."""
    target = make_tiny_model(tiny_configs()[family], tmp_path, seed=5)
    head = build_draft_head(target, init=False)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(3))
    f = target_features(target, ids)
    with torch.no_grad():
        outs = head.unroll(ids, f[:, :-1], 3)
        torch.testing.assert_close(outs[0], head(ids[:, 1:], f[:, :-1]), rtol=0, atol=0)
        for b in range(2):
            for t in range(0, 10 - 2):  # rows whose three next tokens lie in the block
                want = drafted_outputs(head, ids[b], f[b], t, 3)
                for s in range(3):
                    torch.testing.assert_close(outs[s][b, t], want[s], rtol=1e-4, atol=1e-5)
    # later steps differ from the first: they read the head's outputs, not the target's
    assert (outs[1][:, :8] - outs[0][:, 1:9]).abs().max() > 1e-3


def test_unroll_detach_blocks_only_the_fed_back_gradient(tmp_path):
    """With `detach` the drafts are the same, and a later step's loss no longer reaches the
    parameters through the earlier step's output: its gradient equals the one computed with
    that output fed back as a constant."""
    target = make_tiny_model(tiny_configs()["llama"], tmp_path, seed=5)
    head = build_draft_head(target, init=False)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    f = target_features(target, ids)[:, :-1].detach()

    def grads(detach: bool):
        head.zero_grad()
        outs = head.unroll(ids, f, 2, detach=detach)
        outs[1].pow(2).mean().backward()
        return outs, [p.grad.clone() for p in head.parameters()]

    (o_plain, g_plain), (o_det, g_det) = grads(False), grads(True)
    for a, b in zip(o_plain, o_det):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert max((a - b).abs().max().item() for a, b in zip(g_plain, g_det)) > 1e-6
    # by hand: step 2 on step 1's output as a constant
    head.zero_grad()
    with torch.no_grad():
        first = head.unroll(ids, f, 1)[0]
    n = ids.shape[1] - 1
    rows = torch.arange(n)
    h1 = head._inputs(ids[:, 1:], f)
    h2 = head._inputs(ids[:, (rows + 2).clamp(max=n)], first)
    blocks = torch.arange(2).repeat_interleave(n)
    t = rows.repeat(2)
    allowed = ((blocks[None, :] == 0) & (t[None, :] <= t[:, None])) | (
        (t[None, :] == t[:, None]) & (blocks[None, :] <= blocks[:, None]))
    out2 = head._layer(torch.cat([h1, h2], 1), (t + blocks).expand(2, -1), allowed)[:, -n:]
    out2.pow(2).mean().backward()
    for a, p in zip(g_det, head.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def trained_student(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    blocks = periodic_blocks()
    return distill_draft(distill_cfg(target_dir, out, kind="student", lr=5e-3), progress=False,
                         blocks=blocks), out, blocks


def test_student_starts_as_the_targets_first_layers(target_dir):
    target = hf_target(target_dir)
    student = build_student(target, 1)
    assert student.config.num_hidden_layers == 1 and len(student.model.layers) == 1
    theirs = target.state_dict()
    mine = student.state_dict()
    assert set(mine) == {k for k in theirs if ".layers.1." not in k}
    for k, v in mine.items():
        assert torch.equal(v, theirs[k]), k
    with pytest.raises(LLMAccelError, match="layers"):
        build_student(target, 2)


def test_student_training_lowers_heldout_kl(trained_student, target_dir):
    from transformers import AutoModelForCausalLM

    res, out, blocks = trained_student
    assert res.best_kl < 0.6 * res.baseline_kl and res.best_top1 > res.baseline_top1, \
        res.history
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.config.num_hidden_layers == 1 and loaded.config.vocab_size == V
    again = evaluate_student(loaded, hf_target(target_dir), blocks[-8:], 4)
    assert math.isclose(again["heldout_kl"], res.best_kl, rel_tol=1e-5)
    assert json.loads((out / "distill.json").read_text())["saved"]["layers"] == 1


def test_student_drafts_for_the_target_in_the_engine(trained_student, target_dir):
    from llmaccel import LLM, SamplingParams

    _, out, blocks = trained_student
    prompts = [blocks[-1, :9].tolist(), blocks[-2, :5].tolist(), [7, 99, 3, 150, 42]]
    max_tokens = [12, 10, 8]
    expected = hf_greedy(hf_target(target_dir), prompts, max_tokens)
    llm = LLM(str(target_dir), dtype="float32", device="cpu", skip_tokenizer_init=True,
              speculative_config={"method": "draft", "model": str(out),
                                  "num_speculative_tokens": 3, "adaptive": False})
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    spec = llm.get_stats().spec_decode
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] > 0, spec


@pytest.fixture(scope="module")
def cli_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-target")
    text = "the cat sat on the mat and the dog sat on the log " * 40
    cfg = tiny_configs()["llama"]
    cfg.vocab_size = save_word_tokenizer(sorted(set(text.split())), d)
    make_tiny_model(cfg, d, seed=3)
    (d / "train.txt").write_text(text)
    return d


def _invoke(*args: str):
    from typer.testing import CliRunner

    from llmaccel.cli import app

    return CliRunner().invoke(app, ["distill-draft", *args])


@pytest.mark.parametrize("kind", ["head", "student"])
def test_cli_distills_text_and_writes_the_draft(cli_target, tmp_path, kind):
    out = tmp_path / "out"
    extra = ["--unroll-steps", "2"] if kind == "head" else []
    r = _invoke(str(cli_target), "--kind", kind, "--data", str(cli_target / "train.txt"),
                "--steps", "4", "--eval-every", "2", "--seq-len", "16", "--batch-size", "2",
                "--lr", "1e-3", "--device", "cpu", "--out", str(out), *extra)
    assert r.exit_code == 0, r.output
    assert "held-out KL" in r.output and "top-1 agreement" in r.output
    summary = json.loads((out / "distill.json").read_text())
    assert summary["kind"] == kind and summary["train_blocks"] >= 1
    if kind == "head":
        assert summary["config"]["unroll_steps"] == 2
        assert "heldout_top1_step2" in summary["history"][-1]
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    if kind == "student":
        assert (out / "tokenizer.json").is_file() and config["num_hidden_layers"] == 1
    else:
        assert config["llmaccel_draft_head"]["target"] == str(cli_target)


def test_cli_bad_inputs_fail_clearly(cli_target, tmp_path):
    data = ["--data", str(cli_target / "train.txt"), "--seq-len", "16", "--device", "cpu"]
    r = _invoke(str(cli_target), "--kind", "tree", *data, "--out", str(tmp_path / "a"))
    assert isinstance(r.exception, LLMAccelError) and "kind must be one of" in str(r.exception)
    r = _invoke(str(cli_target), "--kind", "student", "--layers", "2", *data,
                "--out", str(tmp_path / "b"))
    assert isinstance(r.exception, LLMAccelError)
    assert "--layers 2 must be below the target's 2 layers" in str(r.exception)
    r = _invoke(str(cli_target), "--kind", "head", "--layers", "1", *data,
                "--out", str(tmp_path / "c"))
    assert isinstance(r.exception, LLMAccelError) and "student" in str(r.exception)
    assert not any((tmp_path / n).exists() for n in "abc")  # nothing half-written


def test_head_goes_on_from_a_saved_head(trained_head, target_dir, tmp_path):
    """init_head: training starts from the saved head (its first evaluation is the saved
    head's best one), here going on with unrolled steps."""
    res, out, blocks = trained_head
    again = distill_draft(distill_cfg(target_dir, tmp_path / "h2", kind="head", lr=1e-3, steps=5,
                               eval_every=5, unroll_steps=2, unroll_decay=0.5,
                               init_head=str(out)), progress=False, blocks=blocks)
    assert math.isclose(again.history[0]["heldout_kl"], res.best_kl, rel_tol=1e-5)
    assert again.history[0]["heldout_kl"] < 0.5 * res.baseline_kl
    with pytest.raises(LLMAccelError, match="not an llmaccel draft head"):
        distill_draft(distill_cfg(target_dir, tmp_path / "h3", kind="head", steps=1,
                           init_head=str(target_dir)), progress=False, blocks=blocks)


