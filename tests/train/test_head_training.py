"""A head's training (llmaccel/train/head_training.py): the unrolled loss and the per-step
held-out agreement, the KL over the draft vocabulary, cached target features, evaluations on
fewer held-out blocks, and a run that diverges, stopped with its best weights saved."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from distill_case import H, distill_cfg, drafted_outputs, hf_target, make_distill_target
from safetensors.torch import load_file
from tiny_models import periodic_blocks

from llmaccel.errors import LLMAccelError
from llmaccel.train.distill import distill_draft
from llmaccel.train.head_trainer import build_draft_head, load_draft_head, target_features
from llmaccel.train.head_training import evaluate_head, head_losses


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_distill_target(tmp_path_factory.mktemp("distill-target"))


def test_a_diverging_head_stops_early_and_saves_its_best(target_dir, tmp_path):
    """A learning rate far too high: the held-out KL stops improving, training stops before
    its last step, and the saved head is the best evaluation's, not the last one's."""
    blocks = periodic_blocks()
    res = distill_draft(distill_cfg(target_dir, tmp_path, kind="head", lr=3.0, steps=100,
                             eval_every=2, patience=2), progress=False, blocks=blocks)
    assert res.stopped and "did not improve" in res.stopped and res.steps_run < 100
    kls = [h["heldout_kl"] for h in res.history]
    assert res.best_kl == min(kls) and max(kls) > 2 * res.best_kl
    head = load_draft_head(tmp_path, hf_target(target_dir))
    again = evaluate_head(head, hf_target(target_dir), blocks[-8:], 4)
    assert math.isclose(again["heldout_kl"], res.best_kl, rel_tol=1e-5)


def test_unrolled_loss_and_heldout_agreement_per_step(target_dir):
    """head_losses with unroll_steps=2 is the mean of step 1's loss and step 2's, the
    latter fitted to f_{i+2} and p_{i+2}; evaluate_head's step-j agreement is the share of
    rows whose j-th draft (drafted row by row) is the target's argmax."""
    target = hf_target(target_dir)
    head = build_draft_head(target, init=False)
    blocks = periodic_blocks(3, 12, period=5)
    f = target_features(target, blocks)
    loss2, parts = head_losses(head, target, blocks, kl_weight=0.5, unroll_steps=2)
    loss1, _ = head_losses(head, target, blocks, kl_weight=0.5, unroll_steps=1)
    with torch.no_grad():
        o2 = head.unroll(blocks, f[:, :-1], 2)[1][:, :-1]
        reg = F.smooth_l1_loss(o2, f[:, 2:])
        p = F.log_softmax(head.compute_logits(f[:, 2:]), -1)
        q = F.log_softmax(head.compute_logits(o2), -1)
        kl = (p.exp() * (p - q)).sum(-1).mean()
    torch.testing.assert_close(loss2, (loss1 + reg + 0.5 * kl) / 2, rtol=1e-5, atol=1e-6)
    decayed, _ = head_losses(head, target, blocks, kl_weight=0.5, unroll_steps=2,
                             unroll_decay=0.25)
    torch.testing.assert_close(decayed, (loss1 + 0.25 * (reg + 0.5 * kl)) / 1.25,
                               rtol=1e-5, atol=1e-6)
    assert math.isclose(parts["kl_step2"], kl.item(), rel_tol=1e-5)
    m = evaluate_head(head, target, blocks, batch_size=2, steps=3)
    with torch.no_grad():
        for step in (2, 3):
            hits = rows = 0
            for b in range(len(blocks)):
                for t in range(blocks.shape[1] - step):  # rows with a feature f_{t+step}
                    o = drafted_outputs(head, blocks[b], f[b], t, step)[-1]
                    want = head.compute_logits(f[b, t + step]).argmax()
                    hits += int(head.compute_logits(o).argmax() == want)
                    rows += 1
            assert math.isclose(m[f"heldout_top1_step{step}"], hits / rows), step
    assert "heldout_top1_step4" not in m


def test_head_trained_on_its_own_drafts(target_dir, tmp_path):
    """unroll_steps=3 trains: the held-out KL of every step falls; the setting is checked."""
    res = distill_draft(distill_cfg(target_dir, tmp_path / "h", kind="head", lr=1e-2,
                             unroll_steps=3, steps=20), progress=False,
                        blocks=periodic_blocks())
    first, best = res.history[0], next(h for h in res.history if h["step"] == res.best_step)
    for key in ("heldout_kl", "heldout_kl_step2", "heldout_kl_step3", "heldout_kl_step4"):
        assert best[key] < 0.5 * first[key], (key, res.history)
    assert json.loads((tmp_path / "h" / "distill.json").read_text())["config"][
        "unroll_steps"] == 3
    with pytest.raises(LLMAccelError, match="unroll_decay must be in"):
        distill_cfg(target_dir, tmp_path / "x", unroll_decay=0.0).check()
    with pytest.raises(LLMAccelError, match="starts a head"):
        distill_cfg(target_dir, tmp_path / "x", kind="student", init_head=str(tmp_path)).check()
    with pytest.raises(LLMAccelError, match="unroll_steps must be 1-8"):
        distill_cfg(target_dir, tmp_path / "x", unroll_steps=0).check()
    with pytest.raises(LLMAccelError, match="trains a head"):
        distill_cfg(target_dir, tmp_path / "x", kind="student", unroll_steps=2).check()


def test_cached_features_train_the_same_head(target_dir, tmp_path):
    """cache_features: the target's features computed once per block (train/feature_cache.py)
    are what target_features returns, and training on them gives the same history and head
    as computing them every step (same seed; unrolled steps and feature noise included)."""
    from llmaccel.train.head_trainer import target_features
    from llmaccel.train.feature_cache import FeatureCache, cache_bytes, require_fit

    blocks = periodic_blocks()
    target = hf_target(target_dir)
    cache = FeatureCache(target, blocks[:7], 3, target_features)
    assert cache.features.shape == (7, blocks.shape[1], H)
    assert cache.nbytes == cache_bytes(blocks[:7], H, torch.float32) == 7 * blocks.shape[1] * H * 4
    torch.testing.assert_close(cache[torch.tensor([5, 0])],
                               target_features(target, blocks[[5, 0]]))
    runs = {}
    for cached in (False, True):
        out = tmp_path / f"h{int(cached)}"
        runs[cached] = distill_draft(distill_cfg(target_dir, out, kind="head", lr=1e-2, steps=12,
                                          eval_every=6, unroll_steps=2,
                                          cache_features=cached), progress=False,
                                     blocks=blocks), load_file(str(out / "model.safetensors"))
    (plain, plain_w), (fast, fast_w) = runs[False], runs[True]
    assert len(plain.history) == len(fast.history) == 3
    for a, b in zip(plain.history, fast.history):
        for key in ("train_loss", "heldout_kl", "heldout_top1", "heldout_kl_step2"):
            if a[key] is not None:
                assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a, b)
    assert plain.best_kl < 0.5 * plain.baseline_kl  # it trained
    for name, w in plain_w.items():
        torch.testing.assert_close(fast_w[name], w, rtol=1e-4, atol=1e-5)
    summary = json.loads((tmp_path / "h1" / "distill.json").read_text())
    assert summary["config"]["cache_features"]
    assert summary["saved"]["feature_cache"]["bytes"] == 4 * blocks.numel() * H
    # the cache must fit the device's free memory, and is for heads only
    require_fit(60, 100, 3, "cuda:0")
    with pytest.raises(LLMAccelError, match="needs 0.0 GiB, more than 60% of the 0.0 GiB free"):
        require_fit(61, 100, 3, "cuda:0")
    with pytest.raises(LLMAccelError, match="cache_features keeps the target's features"):
        distill_cfg(target_dir, tmp_path / "x", kind="student", cache_features=True).check()


def test_loss_over_the_draft_vocabulary_renormalizes_both_distributions(target_dir):
    """restrict_loss_vocab: head_losses' KL is KL(p || q) over the vocabulary's tokens only,
    each distribution renormalized over them (EAGLE-3's draft-vocabulary loss); the
    regression is unchanged, and evaluations still score the whole vocabulary."""
    target = hf_target(target_dir)
    head = build_draft_head(target, init=False)
    blocks = periodic_blocks(3, 12, period=5)
    ids = torch.tensor([3, 0, 9, 17, 40, 41, 100])
    torch.manual_seed(0)
    _, full = head_losses(head, target, blocks, kl_weight=1.0)
    before = evaluate_head(head, target, blocks, 2, steps=1)
    head.restrict_loss_vocab(ids)
    loss, parts = head_losses(head, target, blocks, kl_weight=1.0)
    with torch.no_grad():
        f = target_features(target, blocks)
        o = head(blocks[:, 1:], f[:, :-1])
        w = head.lm_head[ids]
        logp = F.log_softmax(f[:, 1:] @ w.T, -1)
        logq = F.log_softmax(o @ w.T, -1)
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    assert math.isclose(parts["kl"].item(), kl.item(), rel_tol=1e-5)
    assert parts["kl"].item() != pytest.approx(full["kl"].item(), rel=1e-3)
    assert parts["reg"].item() == pytest.approx(full["reg"].item(), rel=1e-6)
    torch.testing.assert_close(loss, parts["reg"] + parts["kl"])
    assert evaluate_head(head, target, blocks, 2, steps=1) == before
    head.restrict_loss_vocab(None)
    assert head_losses(head, target, blocks, kl_weight=1.0)[1]["kl"].item() == pytest.approx(
        full["kl"].item(), rel=1e-6)


def test_eval_blocks_scores_few_while_training_and_all_at_the_end(target_dir, tmp_path):
    """eval_blocks: the evaluations during training score the first N held-out blocks; the
    restored best weights are then scored on all of them (final_heldout in distill.json),
    which equals evaluating the saved head. Timings of each evaluation are recorded."""
    blocks = periodic_blocks()
    res = distill_draft(distill_cfg(target_dir, tmp_path, kind="head", lr=1e-2, steps=10,
                             eval_every=5, eval_blocks=2), progress=False, blocks=blocks)
    summary = json.loads((tmp_path / "distill.json").read_text())
    final = summary["final_heldout"]
    assert final["blocks"] == 8 and summary["saved"]["loss_vocab"] == "draft"
    held = blocks[-8:]
    head = load_draft_head(tmp_path, hf_target(target_dir))
    best_row = next(h for h in res.history if h["step"] == res.best_step)
    assert math.isclose(evaluate_head(head, hf_target(target_dir), held[:2], 4)["heldout_kl"],
                        best_row["heldout_kl"], rel_tol=1e-5)
    assert math.isclose(evaluate_head(head, hf_target(target_dir), held, 4)["heldout_kl"],
                        final["heldout_kl"], rel_tol=1e-5)
    assert final["heldout_kl"] != pytest.approx(best_row["heldout_kl"], rel=1e-6)
    assert all(0 <= h["eval_seconds"] <= h["seconds"] for h in res.history)
    with pytest.raises(LLMAccelError, match="loss_vocab must be draft or full"):
        distill_cfg(target_dir, tmp_path, kind="head", loss_vocab="all").check()
    with pytest.raises(LLMAccelError, match="eval_blocks scores a head"):
        distill_cfg(target_dir, tmp_path, kind="student", eval_blocks=4).check()
