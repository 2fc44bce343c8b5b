"""An EAGLE-style draft head in the engine: one decoder layer over the target's features.

Checkpoint (what `llmaccel distill-draft --kind head` writes; EAGLE-1's layout as vLLM loads
it for method "eagle"): a Llama `config.json` with one hidden layer and our marker
`llmaccel_draft_head`, and `fc.weight` [H, 2H] (optionally `fc.bias`) plus `layers.0.*` without
`input_layernorm` (EAGLE-1's first layer has none). No embeddings and no LM head: both are the
target's, shared.

Forward at head position i: `fc(cat(embed(x_{i+1}), f_i))` through the decoder layer (no input
norm), output `o_i = layer output + residual` (no final norm). f_i is the target's hidden state
at position i after its final norm (what its LM head reads); `lm_head(o_i)` predicts x_{i+2}
and o_i stands in for f_{i+1} when the head drafts further.

With a draft vocabulary (draft_vocab.json beside the weights: token ids ranked by frequency in
the head's training text; `draft_vocab_size` keeps the first N) the head scores only those
tokens: their rows of the target's LM head are copied into a smaller matrix, and the logits of
every other token are -inf. The LM head is most of a head step's weight reads (Qwen2.5-1.5B:
151,936 x 1,536): on an H100 a chained head step took 0.31 ms with the whole vocabulary and
0.17 ms with a 21.5k one (before draft steps were chained, per-step launches hid the
difference). Drafts outside
the vocabulary are never proposed; verification stays exact whatever is drafted.

With EAGLE-3's multi-layer features (the marker's `aux_hidden_state_layers`, written by
`distill-draft --aux-layers`) the target's feature at i is f_i followed by the hidden state
entering each aux layer, through that layer's input norm (the target keeps them by slot
too: `TransformerModel.aux_hidden_states`), and the checkpoint has `fuse.weight` [H, (1 + n) H]:
the proposer maps target features through it (`fuse_target_features`, outside the head's
graphs) before they go in; the head's own outputs go in as they are. Such a head is our
format only (EAGLE-1 loaders know no fuse; EAGLE-3's layout differs).

With the marker's `prev_token_embedding` (`distill-draft --prev-token`) fc is [H, 3H] and reads
a third part, the embedding of the token at the feature's own position: fc(cat(embed(x_{i+1}),
f_i, embed(x_i))), so the one layer can find where a token occurred before (copying;
train/head_trainer.py says why). The proposer writes those ids into `static_prev_ids` (or
`prev_input` for a large eager step); a chained step's are the previous step's input ids,
which every forward keeps in `static_ids`. Our format only, like aux layers.

The features come in through `static_features` (a buffer the CUDA graphs read: the proposer
copies each step's features there) or, for steps larger than it (a long catch-up, run
eagerly), `feature_input`. Outputs go to `static_out` (what a graph replay leaves) and
`last_out` (the eager step's tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmaccel.errors import CorruptCheckpointError, LLMAccelError
from llmaccel.models.attention import get_attention_backend
from llmaccel.models.layers.linear import Linear
from llmaccel.models.layers.quantization import dense_linear
from llmaccel.models.layers.rotary import RotaryEmbedding, rope_parameters
from llmaccel.kernels.greedy_select import greedy_ids, write_greedy_ids
from llmaccel.models.transformer import DecoderLayer, TransformerForCausalLM

HEAD_MARKER = "llmaccel_draft_head"
DRAFT_VOCAB_FILE = "draft_vocab.json"
# Rows of the static feature/output buffers when the head has no CUDA graphs (CPU, eager):
# steps up to this size read the static buffer, larger ones a tensor of their own.
DEFAULT_STATIC_ROWS = 512


class DraftHeadModel(nn.Module):
    def __init__(self, config, target: TransformerForCausalLM, max_positions: int,
                 fc_bias: bool, aux_layers: tuple[int, ...] = (),
                 prev_token: bool = False) -> None:
        super().__init__()
        hidden = config.hidden_size
        # its own backend object: set_fused_kernels configures a backend per model
        backend = get_attention_backend(target.attention_backend.name)
        self.hidden_size = hidden
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, max_positions, rope_parameters(config))
        self.embed_tokens = target.model.embed_tokens  # shared: the target's
        self.prev_token = prev_token
        self.fc = Linear((3 if prev_token else 2) * hidden, hidden, fc_bias, None, "fc")
        self.aux_layers = tuple(aux_layers)
        self.fuse = (Linear((1 + len(aux_layers)) * hidden, hidden, False, None, "fuse")
                     if aux_layers else None)
        self.layers = nn.ModuleList([DecoderLayer(config, backend, rotary, None, "layers.0")])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: the fc output goes in as is
        # ModelRunner reads norm.use_triton to decide on Triton launch settings; the head's
        # output needs no norm, so the target's stands in for that flag (never applied here).
        self.norm = target.model.norm
        self.static_features: torch.Tensor | None = None
        self.static_out: torch.Tensor | None = None
        self.feature_input: torch.Tensor | None = None
        self.last_out: torch.Tensor | None = None
        # prev_token: the ids at the features' positions, and each step's own input ids
        self.static_prev_ids: torch.Tensor | None = None
        self.static_ids: torch.Tensor | None = None
        self.prev_input: torch.Tensor | None = None
        self.last_ids: torch.Tensor | None = None

    def allocate_buffers(self, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        """Static feature input and output buffers for steps of up to `rows` tokens (before
        any CUDA graph is captured: graphs keep their addresses)."""
        self.static_features = torch.zeros(rows, self.hidden_size, dtype=dtype, device=device)
        self.static_out = torch.zeros(rows, self.hidden_size, dtype=dtype, device=device)
        if self.prev_token:
            self.static_prev_ids = torch.zeros(rows, dtype=torch.long, device=device)
            self.static_ids = torch.zeros(rows, dtype=torch.long, device=device)

    def fuse_target_features(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features (rows of its feature cache) in the head's width."""
        return feats if self.fuse is None else self.fuse(feats)

    @property
    def feature_width(self) -> int:
        """The width of the target's feature-cache rows this head reads."""
        return (1 + len(self.aux_layers)) * self.hidden_size

    def forward(self, input_ids, positions, meta):
        n = input_ids.shape[0]
        feats = (self.feature_input if self.feature_input is not None
                 else self.static_features[:n])
        emb = self.embed_tokens(input_ids)
        parts = [emb, feats.to(emb.dtype)]
        if self.prev_token:
            prev = (self.prev_input if self.prev_input is not None
                    else self.static_prev_ids[:n])
            parts.append(self.embed_tokens(prev))
            if n <= self.static_ids.shape[0]:  # the next chained step's prev ids
                self.static_ids[:n].copy_(input_ids)
            self.last_ids = input_ids
        x = self.fc(torch.cat(parts, dim=-1))
        x, residual = self.layers[0](positions, x, None, meta)
        if n <= self.static_out.shape[0]:  # the sum written where graphs read it: one kernel
            out = torch.add(x, residual, out=self.static_out[:n])
        else:
            out = x + residual
        self.last_out = out
        return out

    def set_prev_ids(self, ids: torch.Tensor) -> None:
        """The next step's ids at its features' positions (prev_token heads only)."""
        if ids.shape[0] <= self.static_prev_ids.shape[0]:
            self.static_prev_ids[:ids.shape[0]].copy_(ids)
        else:
            self.prev_input = ids  # an eager step larger than the static buffer


class DraftHeadForCausalLM(TransformerForCausalLM):
    """The head with the engine's model interface (ModelRunner, CUDA graphs, KV sizing);
    logits through the target's LM head."""

    # The fused decode layer folds the input norm into the qkv GEMV; the head's layer has
    # none. Rope still goes into the K/V cache write, as in the target.
    fused_decode_layers = False

    def __init__(self, config, target: TransformerForCausalLM, max_positions: int,
                 fc_bias: bool = False, aux_layers: tuple[int, ...] = (),
                 prev_token: bool = False) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.quant_config = None
        self.tie_word_embeddings = False
        self.model = DraftHeadModel(config, target, max_positions, fc_bias, aux_layers,
                                    prev_token)
        self.feature_cache = None  # the head keeps no features of its own
        # a plain attribute, not a submodule: the target's weights are not the head's
        object.__setattr__(self, "_target", target)
        self.draft_ids: torch.Tensor | None = None  # the draft vocabulary, if any
        self.draft_lm_head: torch.Tensor | None = None

    def set_draft_vocab(self, token_ids: list[int] | None) -> None:
        """Score only `token_ids` (None: the target's whole vocabulary)."""
        if token_ids is None:
            self.draft_ids = self.draft_lm_head = None
            return
        weight = _lm_head_weight(self._target)
        # in id order (the file ranks them by frequency): the argmax over the small matrix
        # then breaks ties as the whole vocabulary's does, at the lowest id (greedy_draft)
        self.draft_ids = torch.tensor(sorted(token_ids), dtype=torch.long,
                                      device=weight.device)
        self.draft_lm_head = weight.index_select(0, self.draft_ids).contiguous()

    def _draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of the draft vocabulary's tokens only, [rows, N] in draft_ids' order."""
        return dense_linear(hidden_states, self.draft_lm_head, None, self.model.norm.use_triton)

    def _ranked(self, small: torch.Tensor, width: int) -> torch.Tensor:
        """Draft-vocabulary logits -> each row's 2nd..(width + 1)-th best token ids, float64."""
        return self.draft_ids[small.topk(width + 1, dim=-1).indices[:, 1:]].double()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.draft_ids is None:
            return self._target.compute_logits(hidden_states)
        small = self._draft_logits(hidden_states)
        logits = small.new_full((small.shape[0], self.config.vocab_size), -torch.inf)
        return logits.index_copy_(1, self.draft_ids, small)

    def greedy_draft(self, hidden_states: torch.Tensor, width: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As the target's, over the draft vocabulary's logits only: one small GEMV and an
        argmax over N tokens instead of filling, scattering and scanning the whole
        vocabulary's row (151,936 wide for Qwen2.5) at every chained step."""
        if self.draft_ids is None:
            return super().greedy_draft(hidden_states, width)
        small = self._draft_logits(hidden_states)
        tokens = self.draft_ids[greedy_ids(small).long()].double()
        return tokens, (self._ranked(small, width) if width else None)

    def runners_up(self, logits: torch.Tensor, width: int) -> torch.Tensor:
        # only the draft vocabulary's columns can rank (the rest are -inf)
        if self.draft_ids is None:
            return super().runners_up(logits, width)
        return self._ranked(logits.index_select(1, self.draft_ids), width)

    def greedy_draft_into(self, hidden_states: torch.Tensor, out_f64: torch.Tensor,
                          out_i64: torch.Tensor) -> None:
        if self.draft_ids is None:
            return super().greedy_draft_into(hidden_states, out_f64, out_i64)
        write_greedy_ids(self._draft_logits(hidden_states), self.draft_ids, out_f64, out_i64)

    def prepare_chained_step(self, rows: int) -> None:
        # the next head step's features: this step's outputs (o_i stands in for f_{i+1})
        self.model.static_features[:rows].copy_(self.model.static_out[:rows])
        if self.model.prev_token:  # and the token at that position: this step's input
            self.model.static_prev_ids[:rows].copy_(self.model.static_ids[:rows])

    def load_weights(self, weights):
        own = ((name if name.startswith("lm_head") else f"model.{name}", t)
               for name, t in weights
               if not name.startswith(("embed_tokens.", "model.embed_tokens.", "lm_head.")))
        return super().load_weights(own)


def _lm_head_weight(target: TransformerForCausalLM) -> torch.Tensor:
    """The target's LM head as a dense [vocab, hidden] matrix (the embedding when tied)."""
    if target.tie_word_embeddings:
        return target.model.embed_tokens.weight
    weight = getattr(target.lm_head, "weight", None)
    if (not isinstance(weight, torch.Tensor) or not weight.is_floating_point()
            or weight.dim() != 2 or weight.element_size() < 2):
        raise LLMAccelError("a draft vocabulary needs the target's LM head as a 16- or 32-bit "
                            "matrix, and this target's is quantized: set draft_vocab_size=0")
    return weight


def read_draft_vocab(path: str | Path, vocab_size: int, size: int | None) -> list[int] | None:
    """The head's draft vocabulary: the first `size` ids of its draft_vocab.json (None: all of
    them; 0: no draft vocabulary), checked. None when it has no file and no size was asked."""
    file = Path(path).expanduser() / DRAFT_VOCAB_FILE
    if size == 0:
        return None
    if not file.is_file():
        if size is not None:
            raise LLMAccelError(f"draft_vocab_size={size} needs the head's {DRAFT_VOCAB_FILE}, "
                                f"and {str(path)!r} has none (set draft_vocab_size=0 or "
                                "leave it unset)")
        return None
    try:
        ids = json.loads(file.read_text())["token_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{file} is not a draft vocabulary (a JSON object with "
                                     f"'token_ids'): {e}") from e
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
            or len(set(ids)) != len(ids)):
        raise CorruptCheckpointError(f"{file}: token_ids must be distinct token ids in [0, "
                                     f"{vocab_size}), at least one")
    if size is not None and size > len(ids):
        raise LLMAccelError(f"draft_vocab_size={size} is larger than the {len(ids)} tokens of "
                            f"{file}")
    return ids if size is None else ids[:size]


def read_head_config(path: str | Path):
    """The head's HF config from its directory, checked to be one of our draft heads."""
    from transformers import AutoConfig

    path = Path(path).expanduser()
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise LLMAccelError(f"draft head {str(path)!r} has no config.json (make one with "
                            "`llmaccel distill-draft TARGET --kind head --out DIR`)")
    raw = json.loads(cfg_file.read_text())
    if HEAD_MARKER not in raw:
        raise LLMAccelError(f"{str(path)!r} is not a draft head (its config.json has no "
                            f"'{HEAD_MARKER}' entry): use method 'draft' for a draft model")
    if raw.get("num_hidden_layers") != 1:
        raise CorruptCheckpointError(f"draft head {str(path)!r} has num_hidden_layers "
                                     f"{raw.get('num_hidden_layers')}; a head has one layer")
    return AutoConfig.from_pretrained(str(path)), raw[HEAD_MARKER]


def load_draft_head(path: str | Path, target: TransformerForCausalLM, max_positions: int,
                    device: torch.device, dtype: torch.dtype,
                    draft_vocab_size: int | None = None) -> DraftHeadForCausalLM:
    """The head of `path` for `target`: its width and vocabulary must be the target's. Its
    draft vocabulary: see `read_draft_vocab`."""
    from llmaccel.models.loader import safetensors_weights

    config, marker = read_head_config(path)
    tcfg = target.config
    for key in ("hidden_size", "vocab_size"):
        if getattr(config, key) != getattr(tcfg, key):
            raise LLMAccelError(f"draft head {str(path)!r} has {key} {getattr(config, key)}, "
                                f"the target {getattr(tcfg, key)}: it was trained for another "
                                "model")
    aux = marker.get("aux_hidden_state_layers", [])
    layers = tcfg.num_hidden_layers
    if (not isinstance(aux, list) or not all(isinstance(i, int) and 1 <= i < layers for i in aux)
            or len(set(aux)) != len(aux)):
        raise CorruptCheckpointError(f"draft head {str(path)!r}: aux_hidden_state_layers "
                                     f"{aux!r} must be distinct layer indexes in 1..{layers - 1} "
                                     "of the target")
    prev_token = marker.get("prev_token_embedding", False)
    if not isinstance(prev_token, bool):
        raise CorruptCheckpointError(f"draft head {str(path)!r}: prev_token_embedding "
                                     f"{prev_token!r} must be true or false")
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            head = DraftHeadForCausalLM(config, target, max_positions,
                                        bool(marker.get("fc_bias", False)), tuple(aux),
                                        prev_token)
        finally:
            torch.set_default_dtype(prev)
    try:
        loaded = head.load_weights(safetensors_weights(Path(path).expanduser(), device))
    except KeyError as e:
        raise CorruptCheckpointError(f"draft head tensor {e} of {str(path)!r} has no place in "
                                     "an EAGLE-style head") from e
    except ValueError as e:
        raise CorruptCheckpointError(f"draft head {str(path)!r} does not match its config: "
                                     f"{e}") from e
    shared = {n for n, _ in head.named_parameters() if n.startswith(("model.embed_tokens",
                                                                     "model.norm"))}
    missing = sorted(set(dict(head.named_parameters())) - loaded - shared)
    if missing:
        raise CorruptCheckpointError(f"draft head {str(path)!r} lacks {len(missing)} weights "
                                     f"(first: {missing[0]})")
    for module in head.modules():
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)
    head.set_draft_vocab(read_draft_vocab(path, tcfg.vocab_size, draft_vocab_size))
    head.set_fused_kernels(bool(getattr(target.model.norm, "use_triton", False)))
    return head.eval()
