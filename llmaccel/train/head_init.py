"""How a draft head (train/head_trainer.py) starts: its layer copied from the target's last layer,
fc mixing the next token's embedding and the feature at the features' scale, the previous
token's part of fc (prev_token) as a scaled random rotation, and optionally fresh q/k."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmaccel.train.head_trainer import DraftHead


# The initializer range of HF Llama configs (their q/k init, what EAGLE's fresh layer has).
ATTENTION_INIT_STD = 0.02


@torch.no_grad()
def init_attention_scores(head: DraftHead) -> None:
    """q_proj and k_proj drawn afresh (normal, std ATTENTION_INIT_STD; the global RNG, which
    distill_draft seeds), the rest of the copied layer kept: EAGLE's layer starts fresh, and
    the copied q/k were fitted to the target's residual stream, not to fc's output. A knob
    for the training dynamics: trained heads were seen to put 0.92 of each query's attention
    (mean over heads) on one sink row and the rest on its own row, so the layer read no
    context, although the untrained copied head and the target's last layer both looked at
    the copy source. Small random q/k start the scores near
    zero: attention near uniform."""
    attn = head.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj):
        proj.weight.normal_(0.0, ATTENTION_INIT_STD)
        if proj.bias is not None:
            proj.bias.zero_()


@torch.no_grad()
def init_from_target(head: DraftHead, target_model, prev_token_init: float | None = None
                      ) -> None:
    base = target_model.base_model
    last = base.layers[-1]
    source = dict(last.named_parameters())
    for name, p in head.layers[0].named_parameters():
        if name in source and source[name].shape == p.shape:  # Qwen2's q/k/v biases: dropped
            p.copy_(source[name])
    # The head drops the layer's input norm; its scale is folded into q/k/v so the copied
    # attention sees its inputs weighted as it was trained to.
    norm = getattr(last, "input_layernorm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = getattr(head.layers[0].self_attn, proj).weight
            w.mul_(norm.weight.to(w.dtype)[None, :])
    # fc starts as [s * I, I] / sqrt(2): h = (s * embed(x_{i+1}) + f_i) / sqrt(2). f_i is
    # RMS-normalized (times the final norm's weight), so the copied layer starts on inputs of
    # the scale it was trained on; s brings the (usually much smaller) token embedding to that
    # scale so the next token is heard from the first step, and the 1/sqrt(2) keeps the sum
    # at the features' scale. Training then learns the real mixing.
    hidden = head.fc.out_features
    eye = torch.eye(hidden, device=head.fc.weight.device)
    final_norm = getattr(base, "norm", None)
    feat_rms = (_rms(final_norm.weight) if final_norm is not None else 1.0)
    s = feat_rms / max(_rms(head.embed_tokens), 1e-8)
    head.fc.weight[:, :2 * hidden].copy_(torch.cat([s * eye, eye], dim=1) / math.sqrt(2.0))
    if head.fc.bias is not None:
        head.fc.bias.zero_()
    if head.prev_token:
        init_prev_token_part(head, target_model, prev_token_init)


# The previous token's part of fc starts as PREV_TOKEN_INIT times a random rotation at the
# features' scale: small enough that the copied layer reads it as the kind of noise it is
# trained with (feature_noise 0.1), but with every entry at the size a learned map needs.
# Zero would be silent, and Adam moves each entry by about the learning rate a step: with the
# token embedding ~100x smaller than the features (Qwen2.5-1.5B), the entries must reach a few
# units, tens of thousands of steps from zero.
PREV_TOKEN_INIT = 0.1


@torch.no_grad()
def init_prev_token_part(head: DraftHead, target_model, scale: float | None = None,
                         seed: int = 0) -> None:
    """fc's third part (embed(x_i)) as `scale` (default PREV_TOKEN_INIT) x a random
    orthogonal matrix x the final norm's RMS / the embedding's RMS (a seeded one: the same
    head from the same target). The next token's part is 1/sqrt(2) at this measure."""
    scale = PREV_TOKEN_INIT if scale is None else scale
    hidden = head.fc.out_features
    final_norm = getattr(target_model.base_model, "norm", None)
    feat_rms = _rms(final_norm.weight) if final_norm is not None else 1.0
    s = feat_rms / max(_rms(head.embed_tokens), 1e-8)
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=gen))
    head.fc.weight[:, 2 * hidden:].copy_(scale * s * q)


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()
