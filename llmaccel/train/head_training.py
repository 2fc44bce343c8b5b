"""Training a draft head (train/head_trainer.py's module and checkpoint): its losses, its
held-out evaluation per draft step and the training run `distill-draft --kind head` makes.

Losses (EAGLE-1): smooth-L1 regression of the head's output o_i onto the target's feature
f_{i+1} plus `kl_weight` times KL(p_{i+1} || q_i), p from the target's logits, q from the
head's, over the draft vocabulary where one is set (EAGLE-3's way), with noise on the input
features; with `unroll_steps` > 1 each later draft step on the head's own outputs is fitted
the same way (EAGLE-3's training-time test). Evaluations score the whole vocabulary: KL,
top-1 agreement at draft steps 1..EVAL_STEPS (the chance step j is accepted given the earlier
ones were), and with a draft vocabulary the top-1 over it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.nn.functional as F

from llmaccel.errors import LLMAccelError
from llmaccel.models.eagle_head import DRAFT_VOCAB_FILE
from llmaccel.train.distill_common import (DistillConfig, Meter, Target, autocast_for,
                                           dtype_name, kl_terms, mean_kl_loss)
from llmaccel.train.head_trainer import (DraftHead, build_draft_head, draft_vocabulary,
                                       load_draft_head, save_draft_head, target_features)
from llmaccel.train.feature_cache import FeatureCache
from llmaccel.train.head_init import init_attention_scores, init_prev_token_part
from llmaccel.train.head_metrics import (attention_shares, attention_weights,
                                         copy_attention_loss, copy_positions,
                                         unrolled_copy_attention_loss)

# held-out agreement is reported for the head's first EVAL_STEPS drafts (k = 4 drafts in W5)
EVAL_STEPS = 4


def head_losses(head: DraftHead, target_model, batch: torch.Tensor, kl_weight: float,
                feature_noise: float = 0.0, unroll_steps: int = 1, unroll_decay: float = 1.0,
                unroll_detach: bool = False, features: torch.Tensor | None = None,
                copy_attention: float = 0.0, copy_heads: int = 2, copy_spread: bool = False,
                copy_all_steps: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss on token blocks [B, T]: smooth L1(o_i, f_{i+1}) + kl_weight *
    KL(p_{i+1} || q_i) over i = 0..T-2, with noise on the input features f_i. With
    `unroll_steps` s > 1 the head also drafts s tokens ahead on its own outputs
    (DraftHead.unroll) and step j's outputs are fitted to f_{i+j} and p_{i+j} the same way;
    the loss is the mean over the steps weighted by unroll_decay ** (j - 1) (a step is
    worth only as much as the chance the drafts before it were accepted). `features`: the
    batch's target features when already computed (train/feature_cache.py). The KL runs
    over the head's loss vocabulary where one is set (`DraftHead.restrict_loss_vocab`).
    With `copy_attention` > 0, plus that times train/head_metrics.copy_attention_loss on the
    layer's `copy_heads` query heads (attending to the lookup source at copy positions; the
    first ones, or with `copy_spread` one per key/value group in turn); with `copy_all_steps`
    at every unrolled step (head_metrics.unrolled_copy_attention_loss, weighted as the steps).
    The parts come back as 0-d tensors: reading them is a host sync, left to the caller."""
    f = (target_features(target_model, batch, head.aux_layers) if features is None
         else features)
    final = f[..., :head.fc.out_features]  # f_i itself, before any aux layers' features
    inputs = f[:, :-1].float()
    if feature_noise > 0:
        # relative to each part's RMS (the final hidden state and each aux layer's)
        parts_view = inputs.unflatten(-1, (-1, head.fc.out_features))
        rms = parts_view.pow(2).mean(-1, keepdim=True).sqrt()
        noise = (torch.rand_like(parts_view) * 2 - 1) * feature_noise * rms
        inputs = (parts_view + noise).flatten(-2)
    with autocast_for(batch.device, target_model.dtype):
        outs, h, positions, allowed = head.unroll_with_inputs(batch, inputs, unroll_steps,
                                                              unroll_detach)
    total, parts, weights = 0.0, {}, 0.0
    restricted = head.loss_lm_head is not None
    for step, o in enumerate(outs, start=1):
        valid = f.shape[1] - step  # rows 0..T-1-step have a feature f_{i+step}
        want = final[:, step:]
        with torch.no_grad():
            p_logits = head.compute_logits(want, restricted)
        reg = F.smooth_l1_loss(o[:, :valid].float(), want.float())
        kl = mean_kl_loss(p_logits, head.compute_logits(o[:, :valid], restricted))
        weight = unroll_decay ** (step - 1)
        total = total + weight * (reg + kl_weight * kl)
        weights += weight
        suffix = "" if step == 1 else f"_step{step}"
        parts.update({f"reg{suffix}": reg.detach(), f"kl{suffix}": kl.detach()})
    total = total / weights
    if copy_attention > 0:
        with autocast_for(batch.device, target_model.dtype):
            if copy_all_steps and unroll_steps > 1:
                attn_loss = unrolled_copy_attention_loss(head, batch, h, positions, allowed,
                                                         copy_heads, copy_spread, unroll_decay)
            else:
                attn_loss = copy_attention_loss(head, batch, inputs, copy_heads, copy_spread)
        total = total + copy_attention * attn_loss
        parts["copy_attn"] = attn_loss.detach()
    return total, parts


@torch.no_grad()
def evaluate_head(head: DraftHead, target_model, blocks: torch.Tensor, batch_size: int,
                  draft_vocab: torch.Tensor | None = None, steps: int = EVAL_STEPS,
                  features: FeatureCache | None = None) -> dict[str, float]:
    """Held-out means over every position: KL(p_{i+1} || q_i), top-1 agreement, regression,
    and with `draft_vocab` (token ids) the top-1 agreement of the head's argmax over those
    tokens only (what the engine drafts with that vocabulary). For steps 2..`steps`, the
    head drafting on its own outputs (DraftHead.unroll, the tokens before it right):
    heldout_kl_step{j} and heldout_top1_step{j}, the latter the chance that its j-th draft is
    accepted given the earlier ones were, which is what speculative decoding's acceptance
    falls with. `features`: the blocks' target features, cached (train/feature_cache.py).
    Whether it copies (train/head_metrics.py): step 1's top-1 where an n-gram lookup in the
    block is right (heldout_top1_copy, their share heldout_copy_share) and elsewhere
    (heldout_top1_nocopy), the same split for steps 2.. (heldout_top1_copy_step{j},
    heldout_top1_nocopy_step{j}), and its attention's sink and self shares on the first batch."""
    head.eval()
    meter = Meter()
    shares: dict[str, float] = {}
    later = {step: Meter() for step in range(2, steps + 1)}  # fewer rows than step 1's
    device = head.fc.weight.device
    ids = draft_vocab.to(device) if draft_vocab is not None else None
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i:i + batch_size].to(device)
        wide = (target_features(target_model, batch, head.aux_layers) if features is None
                else features.features[i:i + len(batch)])
        f = wide[..., :head.fc.out_features]
        with autocast_for(device, target_model.dtype):
            outs = head.unroll(batch, wide[:, :-1], max(1, min(steps, f.shape[1] - 1)))
        copy = torch.zeros(0)
        for step, o in enumerate(outs, start=1):
            p_logits = head.compute_logits(f[:, step:])
            q_logits = head.compute_logits(o[:, :f.shape[1] - step])
            kl, agree = kl_terms(p_logits, q_logits)
            if step > 1:
                # step j's row t drafts what step 1's row t + j - 1 does, after drafts that
                # were right: the same lookup, so the same copy positions
                later_copy = copy[:, step - 1:]
                later[step].add(kl.numel(), kl=kl.sum(), top1=agree.sum(),
                                copy=later_copy.sum(), top1_copy=(agree & later_copy).sum())
                continue
            reg = F.smooth_l1_loss(o.float(), f[:, 1:].float(), reduction="none").mean(-1)
            copy = copy_positions(batch, p_logits.argmax(-1))
            sums = {"kl": kl.sum(), "top1": agree.sum(), "reg": reg.sum(),
                    "copy": copy.sum(), "top1_copy": (agree & copy).sum()}
            if ids is not None:
                restricted = ids[q_logits[..., ids].argmax(-1)]
                sums["top1_vocab"] = (restricted == p_logits.argmax(-1)).sum()
            meter.add(kl.numel(), **sums)
            if not shares:
                shares = attention_shares(attention_weights(head, batch, wide[:, :-1]),
                                          blocks=batch)
    m = meter.means()
    out = {"heldout_kl": m["kl"], "heldout_top1": m["top1"], "heldout_reg": m["reg"]}
    copy_share = m["copy"]
    out["heldout_copy_share"] = copy_share
    if copy_share > 0:
        out["heldout_top1_copy"] = m["top1_copy"] / copy_share
    if copy_share < 1:
        out["heldout_top1_nocopy"] = (m["top1"] - m["top1_copy"]) / (1 - copy_share)
    out.update(shares)
    if draft_vocab is not None:
        out["heldout_top1_draft_vocab"] = m["top1_vocab"]
    for step, step_meter in later.items():
        if step_meter.count:
            means = step_meter.means()
            out[f"heldout_kl_step{step}"] = means["kl"]
            out[f"heldout_top1_step{step}"] = means["top1"]
            if 0 < means["copy"] < 1:
                out[f"heldout_top1_copy_step{step}"] = means["top1_copy"] / means["copy"]
                out[f"heldout_top1_nocopy_step{step}"] = ((means["top1"] - means["top1_copy"])
                                                          / (1 - means["copy"]))
    return out


def init_from_head(head: DraftHead, start: DraftHead, name: str, target_model,
                   prev_token_init: float | None = None) -> None:
    """`head` takes the weights of `start` (a saved head). The same kind of head only, except
    that a head without prev_token may start one with it: fc's first two parts are the old
    head's and the third starts as a fresh head's (train/head_init.init_prev_token_part), so
    training begins from the old head's drafts."""
    if start.aux_layers != head.aux_layers:
        raise LLMAccelError(f"init_head {name!r} has aux layers {list(start.aux_layers)}, this "
                            f"training {list(head.aux_layers)}: give the same aux_layers")
    state = start.state_dict()
    if start.prev_token and not head.prev_token:
        raise LLMAccelError(f"init_head {name!r} reads the previous token (prev_token) and "
                            "this training's head does not: set prev_token")
    if head.prev_token and not start.prev_token:
        init_prev_token_part(head, target_model, prev_token_init)
        fc = head.fc.weight.detach().clone()
        fc[:, :2 * fc.shape[0]] = state["fc.weight"]
        state["fc.weight"] = fc
    head.load_state_dict(state, strict=True)


def train_head(cfg: DistillConfig, target: Target, train: torch.Tensor, held: torch.Tensor,
               device: torch.device, progress: bool,
               caches: tuple[FeatureCache, FeatureCache] | None = None):
    """Train a head on the target's features, keep the best evaluation, save it in cfg.out.
    `caches`: the (train, held) blocks' feature caches, already built (several heads trained
    on one set of blocks build them once)."""
    from llmaccel.train.distill_common import finish, train_loop

    model = target.model
    aux = tuple(cfg.aux_layers)
    head = build_draft_head(model, target.config, cfg.target, cfg.fc_bias,
                            save_dtype=target.save_dtype, init=cfg.init_head is None,
                            aux_layers=aux, prev_token=cfg.prev_token,
                            prev_token_init=cfg.prev_token_init,
                            attention_init=cfg.attention_init)
    if cfg.init_head is not None:  # go on from a saved head (e.g. unrolled after plain)
        init_from_head(head, load_draft_head(cfg.init_head, model), cfg.init_head, model,
                       cfg.prev_token_init)
        if cfg.attention_init == "random":  # the saved head's layer, its q/k afresh
            init_attention_scores(head)
    heads = head.layers[0].self_attn.config.num_attention_heads
    if cfg.copy_attention_weight > 0 and cfg.copy_attention_heads > heads:
        raise LLMAccelError(f"copy_attention_heads {cfg.copy_attention_heads} is more than the "
                            f"head's {heads} attention heads")
    params = list(head.parameters())
    vocab, vocab_info = None, None
    if cfg.draft_vocab_size:
        vocab, vocab_info = draft_vocabulary(train, head.embed_tokens.shape[0],
                                             cfg.draft_vocab_size)
        if cfg.loss_vocab == "draft":
            head.restrict_loss_vocab(vocab)

    train_cache = held_cache = None
    batches = train  # what the loop draws random rows of
    cache_seconds = 0.0
    if caches is not None:
        train_cache, held_cache = caches
        if (len(train_cache), len(held_cache)) != (len(train), len(held)):
            raise LLMAccelError(f"feature caches of {len(train_cache)} + {len(held_cache)} "
                                f"blocks given for {len(train)} + {len(held)} blocks")
        train_on_device = train.to(device)
        batches = torch.arange(len(train))[:, None]
    elif cfg.cache_features:  # the target runs once per block, not once per step
        start = time.perf_counter()
        def compute(m, ids):
            return target_features(m, ids, aux)

        width = head.fc.out_features * (1 + len(aux))
        train_cache = FeatureCache(model, train, cfg.batch_size, compute, width)
        held_cache = FeatureCache(model, held, cfg.batch_size, compute, width)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cache_seconds = time.perf_counter() - start
        train_on_device = train.to(device)
        batches = torch.arange(len(train))[:, None]  # rows of block indexes

    def step_loss(batch: torch.Tensor):
        head.train()
        features = None
        if train_cache is not None:
            idx = batch[:, 0]
            batch, features = train_on_device[idx.to(device)], train_cache[idx]
        return head_losses(head, model, batch, cfg.kl_weight, cfg.feature_noise,
                           cfg.unroll_steps, cfg.unroll_decay, cfg.unroll_detach, features,
                           cfg.copy_attention_weight, cfg.copy_attention_heads,
                           cfg.copy_attention_spread, cfg.copy_attention_all_steps)

    # held-out blocks scored while training (the first eval_blocks: every evaluation of a
    # head runs EVAL_STEPS unrolled steps over the whole vocabulary); all of them at the end
    held_eval = held if cfg.eval_blocks is None else held[:cfg.eval_blocks]
    outcome = train_loop(
        cfg, "head", params, batches, device, step_loss,
        lambda: evaluate_head(head, model, held_eval, cfg.batch_size, vocab,
                              features=held_cache),
        lambda: {k: v.detach().clone() for k, v in head.state_dict().items()},
        head.load_state_dict, progress)
    extra: dict[str, Any] = {}
    if len(held_eval) < len(held):  # the best weights (restored) on every held-out block
        extra["final_heldout"] = {"blocks": len(held), **evaluate_head(
            head, model, held, cfg.batch_size, vocab, features=held_cache)}
    out = save_draft_head(head, cfg.out, target.save_dtype)
    saved: dict[str, Any] = {"kind": "head", "dtype": dtype_name(target.save_dtype),
                             "tensors": sorted(head.state_dict()),
                             "loss_vocab": "draft" if head.loss_lm_head is not None
                             else "full"}
    if train_cache is not None:
        # (not in the training time limit: max_seconds counts from the first step)
        saved["feature_cache"] = {"bytes": train_cache.nbytes + held_cache.nbytes,
                                  "seconds": round(cache_seconds, 2)}
    vocab_file = out / DRAFT_VOCAB_FILE
    if vocab_info is not None:
        vocab_file.write_text(json.dumps(vocab_info))
        saved["draft_vocab"] = {k: vocab_info[k] for k in ("tokens_counted", "distinct_tokens",
                                                           "coverage")}
        saved["draft_vocab"]["size"] = len(vocab_info["token_ids"])
    elif vocab_file.exists():  # an earlier head's vocabulary must not outlive it
        vocab_file.unlink()
    return finish(cfg, out, outcome, len(train), len(held), {"saved": saved, **extra})
