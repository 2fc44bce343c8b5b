"""train/head_metrics.py: the n-gram lookup's proposals, copy positions, attention shares,
and evaluate_head's copy and attention measures; train/data.record_blocks."""

from __future__ import annotations

import pytest
import torch
from distill_case import copy_blocks, tiny_head_pair

from llmaccel.errors import LLMAccelError
from llmaccel.train.data import record_blocks
from llmaccel.train.head_metrics import (attention_shares, copy_positions,
                                         lookup_proposals)


def test_lookup_proposes_what_followed_the_latest_earlier_match():
    ids = [1, 2, 3, 9, 1, 2, 4, 1, 2]
    props = lookup_proposals(ids, 2)
    assert props[:5] == [-1] * 5      # (1, 2) at 0-1 has no earlier occurrence
    assert props[5] == 3              # ..1 2 -> 3 (what followed it at 0-1)
    assert props[8] == 4              # the latest match (4-5) wins over the first
    assert props[6] == -1             # (2, 4) never seen before
    assert lookup_proposals([5, 5, 5, 5], 2) == [-1, -1, 5, 5]


def test_copy_positions_compare_the_proposal_with_the_wanted_token():
    blocks = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 7]])
    # row t drafts the token at t + 2; the lookup at t + 1 proposes it
    want = blocks[:, 2:].clone()
    got = copy_positions(blocks, want)
    assert got.shape == (1, 6)
    assert got[0].tolist() == [False, False, False, False, True, False]  # row 4: 1 2 -> 3
    want[0, 4] = 8  # the target wanted something else there: not a copy position
    assert not copy_positions(blocks, want).any()


def test_attention_shares_tell_a_sink_from_a_lookup():
    n = 64
    sink = torch.zeros(1, n, n)
    sink[:, :, 0] = 0.9
    sink[:, torch.arange(n), torch.arange(n)] += 0.1
    sink[:, 0, 0] = 1.0
    moving = torch.zeros(1, n, n)
    moving[:, torch.arange(n), torch.arange(n) // 2] = 1.0  # each query its own key
    s, m = attention_shares(sink), attention_shares(moving)
    assert s["heldout_attn_sink"] == pytest.approx(0.9)
    assert s["heldout_attn_self"] == pytest.approx(0.1)
    assert m["heldout_attn_sink"] < 0.1 and m["heldout_attn_self"] == 0.0


class _Chars:
    """A tokenizer of one id per character."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_record_blocks_start_at_records():
    text = "#abc" + "#defgh" + "#ij" + "#" + "k" * 11 + "#lm" + "#nopq"
    blocks = record_blocks(_Chars(), text, 8, "#")
    rows = ["".join(map(chr, b)) for b in blocks.tolist()]
    # #abc and the start of #defgh; #defgh#ij fits whole; the 12-char record in two blocks,
    # the second ending where it ends; #lm#nopq ends the text
    assert rows == ["#abc#def", "#defgh#i", "#ij#kkkk", "#kkkkkkk", "kkkkkkkk", "#lm#nopq"]
    assert all(len(r) == 8 for r in rows)
    with pytest.raises(LLMAccelError, match="no record"):
        record_blocks(_Chars(), "", 8, "#")
    with pytest.raises(LLMAccelError, match="fewer than two"):
        record_blocks(_Chars(), "#ab#cd", 8, "#")


def test_evaluate_head_reports_copy_and_attention_measures(tmp_path):
    from distill_case import make_distill_target
    from tiny_models import periodic_blocks
    from transformers import AutoModelForCausalLM

    from llmaccel.train.head_trainer import build_draft_head
    from llmaccel.train.head_training import evaluate_head

    target = AutoModelForCausalLM.from_pretrained(make_distill_target(tmp_path / "t"),
                                                  dtype=torch.float32).eval()
    torch.manual_seed(0)
    head = build_draft_head(target, prev_token=True)
    # the target's own greedy text: a tiny random model soon loops, so its next token is
    # often what a lookup proposes (copy positions), and not everywhere
    starts = periodic_blocks(n=6, seq_len=4, period=3)
    blocks = target.generate(starts, attention_mask=torch.ones_like(starts), do_sample=False,
                             max_new_tokens=36, min_new_tokens=36, pad_token_id=0)
    score = evaluate_head(head, target, blocks, batch_size=4)
    # the share of copy positions, computed here from the target's own argmax: row t of
    # block b is one where the lookup at position t + 1 proposes the target's token there
    with torch.no_grad():
        argmax = target(input_ids=blocks).logits.argmax(-1)[:, 1:]
    props = torch.tensor([lookup_proposals(b)[1:] for b in blocks.tolist()])
    assert score["heldout_copy_share"] == pytest.approx(float((props == argmax).float().mean()))
    assert 0 < score["heldout_copy_share"] < 1
    parts = (score["heldout_copy_share"] * score["heldout_top1_copy"]
             + (1 - score["heldout_copy_share"]) * score["heldout_top1_nocopy"])
    assert parts == pytest.approx(score["heldout_top1"])
    assert 0 < score["heldout_attn_sink"] <= 1 and 0 < score["heldout_attn_self"] <= 1


def test_lookup_sources_match_the_reference_lookup():
    from llmaccel.train.head_metrics import lookup_sources

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 5, (4, 40), generator=g)  # few distinct tokens: many matches
    src = lookup_sources(blocks)
    for row, ids in zip(src.tolist(), blocks.tolist()):
        want = lookup_proposals(ids)
        got = [ids[e + 1] if e >= 0 else -1 for e in row]
        assert got == want


def test_taught_heads_first_or_one_per_key_value_group():
    from llmaccel.train.head_metrics import taught_heads

    assert taught_heads(12, 2, 2, spread=False) == [0, 1]
    assert taught_heads(12, 2, 2, spread=True) == [0, 6]
    assert taught_heads(12, 2, 3, spread=True) == [0, 6, 1]
    assert taught_heads(4, 4, 4, spread=True) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot teach 5 of 4"):
        taught_heads(4, 2, 5, spread=False)


def test_scores_of_some_heads_are_those_of_all(tmp_path):
    from llmaccel.train.head_trainer import target_features
    from llmaccel.train.head_metrics import _scores

    target, head = tiny_head_pair(tmp_path)
    ids = torch.randint(3, 100, (2, 17))
    f = target_features(target, ids)[:, :-1]
    with torch.no_grad():
        full = _scores(head, ids, f)
        for heads in ([0], [1, 0], list(range(full.shape[1]))[::-1]):
            torch.testing.assert_close(_scores(head, ids, f, heads), full[:, heads])


@pytest.mark.parametrize("spread", [False, True])
def test_copy_attention_loss_teaches_heads_to_look_at_the_lookup_source(tmp_path, spread):
    """Trained on that loss alone, the layer's attention moves onto the lookup source at copy
    positions of held-out text (heldout_attn_copy), and only q/k learn (the loss reads no
    values)."""
    from llmaccel.train.head_trainer import target_features
    from llmaccel.train.head_metrics import (attention_shares, attention_weights,
                                             copy_attention_loss)

    target, head = tiny_head_pair(tmp_path)
    g = torch.Generator().manual_seed(0)
    held = copy_blocks(g, 4)
    f_held = target_features(target, held)[:, :-1]

    def copy_share():
        return attention_shares(attention_weights(head, held, f_held), min_row=0,
                                blocks=held)["heldout_attn_copy"]

    before = copy_share()
    params = [head.layers[0].self_attn.q_proj.weight, head.layers[0].self_attn.k_proj.weight]
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    v_before = head.layers[0].self_attn.v_proj.weight.detach().clone()
    for _ in range(60):
        ids = copy_blocks(g, 8)
        loss = copy_attention_loss(head, ids, target_features(target, ids)[:, :-1], heads=2,
                                   spread=spread)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        opt.step()
    after = copy_share()
    assert after > before + 0.2, (before, after)
    torch.testing.assert_close(head.layers[0].self_attn.v_proj.weight, v_before)


def test_distill_draft_with_the_copy_loss_trains_heads_that_attend_to_the_source(tmp_path):
    """distill-draft's head with --copy-attention-weight against the same run without it:
    its history reports the copy loss, and its attention at held-out copy positions is on
    the lookup's source, which the plain run's is not."""
    import json

    from distill_case import distill_cfg, make_distill_target

    from llmaccel.train.distill import distill_draft

    target = make_distill_target(tmp_path / "t")
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(30):  # a random stretch, then the same again: half the block copies
        a = torch.randint(3, 150, (16,), generator=g)
        rows.append(torch.cat([a, a]))
    blocks = torch.stack(rows)
    runs = {}
    for weight in (0.0, 1.0):
        out = tmp_path / f"w{weight}"
        torch.manual_seed(0)
        distill_draft(distill_cfg(target, out, kind="head", prev_token=True, lr=3e-3, steps=80,
                                  copy_attention_weight=weight, copy_attention_heads=2,
                                  eval_every=80, draft_vocab_size=0),
                      progress=False, blocks=blocks)
        runs[weight] = json.loads((out / "distill.json").read_text())["history"][-1]
    assert runs[1.0]["heldout_attn_copy"] > runs[0.0]["heldout_attn_copy"] + 0.1, runs


def test_more_taught_heads_than_the_layer_has_is_a_clear_error(tmp_path):
    from distill_case import distill_cfg, make_distill_target
    from tiny_models import periodic_blocks

    from llmaccel.train.distill import distill_draft

    target = make_distill_target(tmp_path / "t")
    with pytest.raises(LLMAccelError, match="copy_attention_heads 5 is more than the head's 4"):
        distill_draft(distill_cfg(target, tmp_path / "o", kind="head", copy_attention_weight=0.1,
                                  copy_attention_heads=5), progress=False,
                      blocks=periodic_blocks())
