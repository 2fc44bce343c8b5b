"""An EAGLE-1 style draft head: its training module and its checkpoint (its losses,
evaluation and training run are train/head_training.py's).

The head drafts from the target's own features. For tokens x_0..x_{T-1}, let f_i be the
target's final hidden state at position i after its final RMSNorm (what its lm_head reads).
At position i the head takes h = fc(cat[embed(x_{i+1}), f_i]) (the target's embedding), runs
one pre-norm Llama decoder layer WITHOUT the input RMSNorm (causal attention over the head's
own inputs 0..i, rope at position i), and returns o_i = h + attn(h) + mlp(norm(h + attn(h)))
with no final norm. The target's lm_head turns o_i into the draft for x_{i+2}, and o_i stands
in for f_{i+1} when drafting further. The engine's head (method "head") computes the same.

Training (EAGLE-1; train/head_training.py): smooth-L1 regression of o_i onto f_{i+1} plus `kl_weight` times
KL(p_{i+1} || q_i), p from the target's logits at i + 1, q from the head's; uniform noise on
the input features (their RMS times `feature_noise`) so the head tolerates its own imperfect
features when it drafts several tokens. With `unroll_steps` > 1 (EAGLE-3's "training-time
test") the head also drafts that many steps ahead on its own outputs during training, each
step fitted the same way (DraftHead.unroll), so it learns from the inputs it drafts from.
The target is frozen; only fc and the layer train.

With `aux_layers` (EAGLE-3's multi-layer features) the target's feature at i is wider: f_i
followed by, for each aux layer l, the hidden state entering target layer l at position i
normalized by that layer's input RMSNorm (what layer l reads). A linear `fuse` ([H, (1 + n) H],
no bias) maps it to the head's width before fc; the head's own outputs, fed back when it
drafts further, are already of that width and skip it. fuse starts as [I, 0, ..., 0] (the
final hidden state only: the EAGLE-1 head), so training learns what the earlier layers add.
Why: the final hidden state has mostly traded the identity of its own token for a prediction
of the next, so one layer attending over the head's rows cannot find "where did this token
occur before" (an induction lookup: copying, which rewriting and quoting are full of); an
early layer's hidden state still holds its token. The regression target stays f_{i+1}.

With `prev_token` (the marker's "prev_token_embedding") fc reads a third part, the embedding
of x_i, the token at the feature's own position: h = fc(cat[embed(x_{i+1}), f_i, embed(x_i)])
(fc.weight [H, 3H], EAGLE-1's two parts first). The same lookup problem, solved where the
token is always known exactly: a copy continues x_{i+1} with what followed an earlier x_j equal
to it, and with its own token at every row the one attention layer can match x_{i+1} against
the x_j (key) and read the token after it (value: the embedding of x_{j+1} in that row) in one
step. Unlike aux layers, the extra input is the same kind of thing at every draft step: when
the head drafts on its own output o_i, x_{i+1} is the previous step's input token, known.

Checkpoint (a directory): config.json, a one-layer Llama config with the target's shapes and
rope settings plus the "llmaccel_draft_head" marker, and model.safetensors with fc.weight
(fc.bias) and layers.0.* in HF Llama names, no input_layernorm, embed_tokens or lm_head.
Beside them, draft_vocab.json: the training text's most frequent target tokens, ranked, which
are all the engine's head scores when it drafts (the LM head is most of a head step's cost;
FR-Spec and EAGLE-3 restrict the draft's vocabulary the same way). A JSON file, not a tensor,
so the weights stay exactly EAGLE-1's for loaders that know nothing of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmaccel.errors import LLMAccelError
from llmaccel.train.distill_common import dtype_name

MARKER = "llmaccel_draft_head"
FEATURE = "final_norm_output"
LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "post_attention_layernorm.weight")
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def head_config_dict(target_config: dict[str, Any], target_name: str, dtype: torch.dtype,
                     fc_bias: bool = False, aux_layers: tuple[int, ...] = (),
                     prev_token: bool = False) -> dict[str, Any]:
    """The head's config.json: a one-layer Llama (what vLLM's EAGLE-1 loader reads) with the
    target's shapes, its rope settings copied as written, and our marker."""
    c = target_config
    heads = c["num_attention_heads"]
    check_aux_layers(aux_layers, c["num_hidden_layers"])
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": c.get("num_key_value_heads") or heads,
        "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
        "hidden_act": c.get("hidden_act", "silu"), "rms_norm_eps": c.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": c.get("max_position_embeddings", 2048),
        "vocab_size": c["vocab_size"], "num_hidden_layers": 1, "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype), "dtype": dtype_name(dtype)}
    for key in _ROPE_KEYS:  # positions must rotate exactly as the target's do
        if key in c:
            out[key] = c[key]
    out[MARKER] = {"kind": "eagle", "target": target_name, "feature": FEATURE,
                   "fc_bias": bool(fc_bias)}
    if aux_layers:
        out[MARKER]["aux_hidden_state_layers"] = [int(i) for i in aux_layers]
    if prev_token:
        out[MARKER]["prev_token_embedding"] = True
    return out


def check_aux_layers(aux_layers, num_layers: int) -> None:
    """Aux layers must be distinct target layers 1..num_layers - 1 (the hidden state entering
    layer 0 is the embedding; the final one is always a feature)."""
    bad = [i for i in aux_layers if not isinstance(i, int) or not 1 <= i < num_layers]
    if bad or len(set(aux_layers)) != len(aux_layers):
        raise LLMAccelError(f"aux layers {list(aux_layers)} must be distinct layer indexes in "
                            f"1..{num_layers - 1} of a {num_layers}-layer target")


def _llama_config(config_dict: dict[str, Any]):
    from transformers import LlamaConfig

    skip = {MARKER, "architectures", "model_type"}
    config = LlamaConfig(**{k: v for k, v in config_dict.items() if k not in skip})
    config._attn_implementation = "sdpa"  # our explicit causal mask is honoured by sdpa
    return config


class DraftHead(nn.Module):
    """The head for training. Its parameters are exactly the checkpoint's tensors (fc.*,
    layers.0.*); the target's embedding and lm_head weights are held as plain tensors (shared,
    frozen, on the target's device: the head must live on that device too).

    forward(next_ids [B, T], features [B, T, H], prev_ids [B, T]) -> o [B, T, H]: row t
    uses embed(next_ids[:, t]), features[:, t] (and with prev_token embed(prev_ids[:, t])) at
    rope position t (or `position_ids`), causal over rows 0..t. For a sequence x with target
    features f: head(x[:, 1:], f[:, :-1], x[:, :-1]).
    """

    def __init__(self, config_dict: dict[str, Any], embed_tokens: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                              LlamaRotaryEmbedding)

        super().__init__()
        self.config_dict = config_dict
        config = _llama_config(config_dict)
        hidden = config.hidden_size
        if embed_tokens.shape != (config.vocab_size, hidden) or lm_head.shape[1] != hidden:
            raise LLMAccelError(f"draft head of hidden size {hidden} and vocab "
                                f"{config.vocab_size} does not fit a target with embedding "
                                f"{tuple(embed_tokens.shape)}")
        self.prev_token = bool(config_dict[MARKER].get("prev_token_embedding", False))
        self.fc = nn.Linear((3 if self.prev_token else 2) * hidden, hidden,
                            bias=config_dict[MARKER]["fc_bias"])
        self.aux_layers = tuple(config_dict[MARKER].get("aux_hidden_state_layers", ()))
        if self.aux_layers:
            self.fuse = nn.Linear((1 + len(self.aux_layers)) * hidden, hidden, bias=False)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()  # EAGLE-1: the first layer reads fc's output raw
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(config)  # its inv_freq is not saved
        # detached: plain tensors, so they stay out of parameters() and state_dict()
        self.embed_tokens = embed_tokens.detach()
        self.lm_head = lm_head.detach()
        self.loss_lm_head: torch.Tensor | None = None  # restrict_loss_vocab

    def restrict_loss_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Train on the logits of `token_ids` only (the draft vocabulary: all the engine's
        head ever scores), target and head distributions both renormalized over them, as
        EAGLE-3 trains its draft vocabulary. The LM head is most of a training step's
        FLOPs and memory traffic (151,936 x 1,536 for the 1.5B Qwen against the layer's
        ~50M weights), so a 32k vocabulary saves most of it. None: the whole vocabulary.
        Evaluations always score the whole vocabulary."""
        self.loss_lm_head = (None if token_ids is None else self.lm_head.index_select(
            0, token_ids.to(self.lm_head.device)).contiguous())

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Features in the head's width: the target's (1 + n aux) x H wide ones through fuse;
        H wide ones (the head's own outputs, or fused already) as they are."""
        hidden = self.fc.out_features
        if features.shape[-1] == hidden:
            return features
        if not self.aux_layers or features.shape[-1] != (1 + len(self.aux_layers)) * hidden:
            raise LLMAccelError(f"features of width {features.shape[-1]} do not fit a head of "
                                f"hidden size {hidden} with aux layers {list(self.aux_layers)}")
        return self.fuse(features.to(self.fuse.weight.dtype))

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor,
                prev_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self._inputs(next_ids, self.fuse_features(features), prev_ids)
        b, t, _ = h.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=h.device).expand(b, t)
        rows = torch.arange(t, device=h.device)
        return self._layer(h, position_ids, rows[None, :] <= rows[:, None])

    def _inputs(self, next_ids: torch.Tensor, features: torch.Tensor,
                prev_ids: torch.Tensor | None = None) -> torch.Tensor:
        """fc(cat[embed(next_ids), features(, embed(prev_ids))]): the layer's input rows."""
        dtype = self.fc.weight.dtype
        parts = [F.embedding(next_ids, self.embed_tokens).to(dtype), features.to(dtype)]
        if self.prev_token:
            if prev_ids is None:
                raise LLMAccelError("this head reads the token at each feature's position "
                                    "(prev_token): give prev_ids")
            parts.append(F.embedding(prev_ids, self.embed_tokens).to(dtype))
        return self.fc(torch.cat(parts, dim=-1))

    def _layer(self, h: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor
               ) -> torch.Tensor:
        """The decoder layer over rows `h` at `position_ids`, row q attending to row k where
        allowed[q, k]. The mask is always explicit: without one, transformers' eager
        attention would attend to later positions (only sdpa infers causality)."""
        dtype = self.fc.weight.dtype  # as it ran on the GPU under autocast (fp32)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=h.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        cos_sin = self.rotary_emb(h, position_ids)
        return self.layers[0](h, attention_mask=mask, position_ids=position_ids,
                              position_embeddings=cos_sin)

    def unroll(self, ids: torch.Tensor, features: torch.Tensor, steps: int,
               detach: bool = False) -> list[torch.Tensor]:
        """The head drafting `steps` tokens ahead from every position of `ids` [B, T], with
        the target's features f_0..f_{T-2} in `features` [B, T - 1, H] -> [o^1, ..., o^steps],
        each [B, T - 1, H]. o^1 = forward(ids[:, 1:], features). o^s at row t is what the
        engine computes for its s-th draft after the context x_0..x_{t+1} when drafts 1..s-1
        were x_{t+2}..x_{t+s}: the row (x_{t+s}, o^{s-1}_t) at position t + s - 1, attending
        to the context's rows 0..t and to its own earlier drafting rows at t (EAGLE-3's
        "training-time test"). Rows whose token x_{t+s} lies past the block (t > T - 1 - s)
        read the block's last token and are not meaningful.

        One layer call per step over [h^1; ...; h^s] (s blocks of T - 1 rows) with a mask
        that lets block a row t see block 1 rows <= t and blocks 2..a row t only; the earlier
        blocks are recomputed (exactly, as their rows see nothing later), which costs s^2/2
        row blocks for s <= a few. With `detach`, no gradient flows through an output fed
        back as the next step's feature: each step's loss trains the layer on its own
        inputs only."""
        return self.unroll_with_inputs(ids, features, steps, detach)[0]

    def unroll_with_inputs(self, ids: torch.Tensor, features: torch.Tensor, steps: int,
                           detach: bool = False
                           ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
        """`unroll`'s outputs and what its last layer call read: the rows [B, steps (T - 1),
        H] (step a's block of T - 1 rows after step a - 1's), their positions [B, steps
        (T - 1)] and the mask [rows, rows] (train/head_metrics.py teaches the attention on
        them at every step)."""
        b, n = ids.shape[0], ids.shape[1] - 1
        rows = torch.arange(n, device=ids.device)
        hs: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        feats = self.fuse_features(features)
        h = positions = allowed = torch.zeros(0)
        for step in range(1, steps + 1):
            # the token after row t's feature at this step: x_{t+step}, clamped into the block
            # (with prev_token also x_{t+step-1}: the token at that feature's position)
            hs.append(self._inputs(ids[:, (rows + step).clamp(max=n)],
                                   feats.detach() if detach and step > 1 else feats,
                                   ids[:, (rows + step - 1).clamp(max=n)]))
            blocks = torch.arange(step, device=ids.device).repeat_interleave(n)
            t = rows.repeat(step)
            causal = t[None, :] <= t[:, None]
            same_row = t[None, :] == t[:, None]
            first = blocks[None, :] == 0
            earlier = blocks[None, :] <= blocks[:, None]
            allowed = (first & causal) | (same_row & earlier)
            h, positions = torch.cat(hs, dim=1), (t + blocks).expand(b, -1)
            feats = self._layer(h, positions, allowed)[:, -n:]
            outs.append(feats)
        return outs, h, positions, allowed

    def compute_logits(self, hidden: torch.Tensor, restricted: bool = False) -> torch.Tensor:
        """The target's lm_head (in its dtype) on head outputs or target features, as fp32;
        `restricted`: only the loss vocabulary's rows, where one is set."""
        weight = (self.loss_lm_head if restricted and self.loss_lm_head is not None
                  else self.lm_head)
        return F.linear(hidden.to(weight.dtype), weight).float()


@torch.no_grad()
def target_features(target_model, input_ids: torch.Tensor,
                    aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """f: the target's last hidden states after its final norm, [B, T, H]; with `aux_layers`
    followed by the hidden state entering each of those layers through its input norm,
    [B, T, (1 + n) H] (the module docstring)."""
    base = target_model.base_model
    if not aux_layers:
        return base(input_ids=input_ids).last_hidden_state
    out = base(input_ids=input_ids, output_hidden_states=True)
    # hidden_states[l] enters layer l (0: the embedding); the last is after the final norm
    aux = [base.layers[i].input_layernorm(out.hidden_states[i]) for i in aux_layers]
    return torch.cat([out.last_hidden_state, *aux], dim=-1)


def build_draft_head(target_model, target_config: dict[str, Any] | None = None,
                     target_name: str = "", fc_bias: bool = False, init: bool = True,
                     save_dtype: torch.dtype | None = None,
                     aux_layers: tuple[int, ...] = (), prev_token: bool = False,
                     prev_token_init: float | None = None,
                     attention_init: str = "target") -> DraftHead:
    """A head for `target_model` (an HF causal LM), fp32, on the target's device. `init`:
    start from the target's last layer (else transformers' random init and a random fc);
    fuse, with aux layers, starts as the final hidden state's pass-through either way."""
    target_config = target_config or target_model.config.to_dict()
    dtype = save_dtype or target_model.dtype
    embed = target_model.get_input_embeddings().weight
    lm_head = target_model.get_output_embeddings().weight  # the embedding itself when tied
    config = head_config_dict(target_config, target_name, dtype, fc_bias, aux_layers, prev_token)
    head = DraftHead(config, embed, lm_head).to(device=embed.device, dtype=torch.float32)
    if aux_layers:
        with torch.no_grad():
            hidden = head.fc.out_features
            head.fuse.weight.zero_()
            head.fuse.weight[:, :hidden].copy_(torch.eye(hidden))
    if init:
        from llmaccel.train.head_init import init_attention_scores, init_from_target

        init_from_target(head, target_model, prev_token_init)
        if attention_init == "random":
            init_attention_scores(head)
        elif attention_init != "target":
            raise LLMAccelError(f"attention_init must be target or random, got "
                                f"{attention_init!r}")
    return head


def draft_vocabulary(blocks: torch.Tensor, vocab_size: int, size: int
                     ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The `size` most frequent token ids of `blocks` (ties: lower id first; only tokens that
    occur), and what to save about them: ids, counts, the share of the tokens they cover."""
    counts = torch.bincount(blocks.flatten().long(), minlength=vocab_size)
    # a stable sort of -count keeps equal counts in id order
    order = torch.sort(-counts, stable=True).indices
    seen = int((counts > 0).sum())
    ids = order[:min(size, seen)]
    total = int(counts.sum())
    info = {"token_ids": ids.tolist(), "counts": counts[ids].tolist(),
            "source": "token frequencies of the head's training text",
            "tokens_counted": total, "distinct_tokens": seen,
            "coverage": round(float(counts[ids].sum()) / max(total, 1), 6)}
    return ids, info


def save_draft_head(head: DraftHead, out: str | Path, dtype: torch.dtype | None = None
                    ) -> Path:
    """config.json + model.safetensors (fc.*, layers.0.*) in `out`, weights in `dtype` (the
    config's dtype by default)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(head.config_dict)
    if dtype is not None:
        config["torch_dtype"] = config["dtype"] = dtype_name(dtype)
    save_as = getattr(torch, config["dtype"])
    tensors = {k: v.detach().to(save_as).contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_draft_head(directory: str | Path, target_model) -> DraftHead:
    """A saved head back as a training module (fp32) on `target_model`'s device."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    if MARKER not in config:
        raise LLMAccelError(f"{directory} is not an llmaccel draft head (no {MARKER!r} in "
                            "config.json)")
    embed = target_model.get_input_embeddings().weight
    head = DraftHead(config, embed, target_model.get_output_embeddings().weight)
    head.to(device=embed.device, dtype=torch.float32)
    state = load_file(str(directory / "model.safetensors"), device=str(embed.device))
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return head
