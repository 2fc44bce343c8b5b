"""One decoder-only Transformer for the Llama family (Llama 2/3.x, Mistral, SmolLM) and Qwen2.

Differences between the families are config switches: qkv bias (Qwen2, or Llama's
`attention_bias`), tied embeddings, rope scaling, GQA. Module and parameter names follow HF so
checkpoints map one-to-one, except that q/k/v and gate/up are fused (see `load_weights`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmaccel.kernels.greedy_select import greedy_ids, write_greedy_ids
from llmaccel.models.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from llmaccel.models.layers.activation import SiluAndMul
from llmaccel.models.layers.embedding import VocabEmbedding
from llmaccel.models.layers.linear import Linear
from llmaccel.models.layers.norm import RMSNorm
from llmaccel.models.layers.quantization import (
    QuantizationConfig,
    QuantizedRow,
    dense_linear,
    fused_gemv_config,
    fused_linear,
    gate_up_silu,
    linear_on,
    qkv_rope,
    wants_quantized_row,
)
from llmaccel.models.layers.rotary import RotaryEmbedding, rope_parameters

# checkpoint name -> (our fused parameter, shard index)
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = config.model_type == "qwen2" or attention_bias
        self.qkv_proj = Linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               qkv_bias, quant_config, f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.q_size, config.hidden_size, attention_bias, quant_config,
                             f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb  # one cos/sin cache shared by all layers
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the engine (bind_kv_caches)
        # Per-tensor scales of an FP8 KV cache (vLLM's k_scale/v_scale): 1.0 until calibrated
        # scales are loaded from a checkpoint; other cache dtypes ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.qkv_attend(positions, x, meta))

    def qkv_attend(self, positions: torch.Tensor, x: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        """The qkv projection of x, then attention -> [T, q_size]. One decode token whose
        quantized qkv GEMV can rotate q and k and write the K/V cache in its epilogue does
        so (`qkv_rope`): one kernel fewer than the GEMV, then `rotary_and_cache`."""
        q = self._qkv_rope(positions, x, meta)
        if q is None:
            return self.attend(positions, linear_on(self.qkv_proj, x), meta)
        out = self.backend.attend_cached(q.view(-1, self.num_heads, self.head_dim),
                                         self.kv_cache, meta, self.scale, self.k_scale,
                                         self.v_scale)
        return out.reshape(-1, self.q_size)

    def _qkv_rope(self, positions: torch.Tensor, x: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor | None:
        """q from the fused qkv + rope + cache-write GEMV, or None where it does not apply:
        the same conditions as the backend's own rope + cache kernel (`forward_with_rope`),
        a pure decode step of one token, a cache in the activations' dtype (not FP8)."""
        kv = self.kv_cache
        # the cheap test first: most layers (unquantized, FP8) have no such GEMV, and eager
        # decode steps come here for every layer
        if (getattr(self.qkv_proj.quant_method, "apply_qkv_rope", None) is None
                or kv is None or not getattr(self.backend, "fuse_rope_cache", False)
                or not self.rotary_emb.use_triton or not meta.uses_kv_cache
                or not meta.is_pure_decode or not isinstance(x, torch.Tensor)
                or x.numel() != x.shape[-1] or kv.dtype != x.dtype
                or self.rotary_emb.cos_sin_cache.shape[-1] != self.head_dim):
            return None
        from llmaccel.kernels.gemv_w4_cuda import RopeCache

        rope = RopeCache(positions, self.rotary_emb.cos_sin_cache, kv, meta.slot_mapping,
                         self.num_heads, self.num_kv_heads, self.head_dim)
        return qkv_rope(self.qkv_proj, x, rope)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """The qkv projection's output [T, q + 2 kv] -> attention output [T, q_size]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward_with_rope(positions, self.rotary_emb, q, k, v, self.kv_cache,
                                             meta, self.scale, self.k_scale, self.v_scale)
        return out.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            from llmaccel.errors import UnsupportedModelError
            raise UnsupportedModelError(f"hidden_act '{config.hidden_act}' is not supported")
        inter, bias = config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], bias, quant_config,
                                   f"{prefix}.gate_up_proj")
        self.down_proj = Linear(inter, config.hidden_size, bias, quant_config,
                                f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor | QuantizedRow) -> torch.Tensor:
        # a quantized batch-1 GEMV with SiLU-and-mul in its epilogue, or None
        row, scale = (x.q, x.scale) if isinstance(x, QuantizedRow) else (x, None)
        act = gate_up_silu(self.gate_up_proj, row, scale)
        if act is None:
            act = self.act_fn(linear_on(self.gate_up_proj, x))
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, rotary_emb, quant_config,
                                   f"{prefix}.self_attn")
        self.mlp = MLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fuse_decode = False  # set by TransformerForCausalLM.set_fused_kernels
        self._fused_by_rows: dict[int, list | None] = {}  # rows -> tiles (None: unfused)

    def forward(self, positions, x, residual, meta):
        """(x, residual) -> (x, residual): the sub-layer output and the residual stream it is
        still to be added to. The fused path returns x None: already added."""
        if self.fuse_decode:
            configs = self._fused_configs((x if x is not None else residual).shape[0])
            if configs is not None:
                return self.forward_fused(positions, x, residual, meta, configs)
        if x is None:  # the previous layer ran fused: its output is in the residual
            x, residual = residual, None
        attn = self.self_attn
        x, residual = self._norm(self.input_layernorm, x, residual, attn.qkv_proj)
        x = attn.o_proj(attn.qkv_attend(positions, x, meta))
        x, residual = self._norm(self.post_attention_layernorm, x, residual,
                                 self.mlp.gate_up_proj)
        return self.mlp(x), residual

    @staticmethod
    def _norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, consumer: Linear):
        """(norm(x + residual), x + residual), or with no residual (norm(x), x). For one row
        whose consumer's FP8 GEMV takes its row quantized, the norm kernel quantizes it too
        and returns a QuantizedRow (one kernel fewer)."""
        if wants_quantized_row(norm, consumer, x):
            row, new_residual = norm.forward_fp8(x, residual)
            return row, (x if residual is None else new_residual)
        if residual is None:
            return norm(x), x
        return norm(x, residual)

    def _fused_configs(self, rows: int):
        """The four GEMV tiles for `rows` rows, or None; decided once per row count (eager
        decode steps would otherwise redo the table lookups in every layer, every step)."""
        if rows not in self._fused_by_rows:
            linears = ((self.self_attn.qkv_proj, "norm"), (self.self_attn.o_proj, "res"),
                       (self.mlp.gate_up_proj, "norm"), (self.mlp.down_proj, "silu"))
            configs = [fused_gemv_config(lin, rows, kind) for lin, kind in linears]
            self._fused_by_rows[rows] = None if None in configs else configs
        return self._fused_by_rows[rows]

    def forward_fused(self, positions, x, residual, meta, configs):
        """A decode-size step in four Triton GEMVs (plus rope + cache write and attention;
        dense weights, or int4 / FP8 ones at batch 1 through their own GEMVs):
        the input norms run in the qkv and gate_up products' prologues, SiLU-and-mul in the
        down product's, and both residual adds in the o and down products' epilogues, in
        place on the residual stream. Rounds as the unfused path does (kernels/gemm.py)."""
        if residual is None:
            residual = x  # the embedding output (a fresh tensor): the stream starts here
        elif x is not None:
            residual = residual + x
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv = fused_linear(attn.qkv_proj, residual, configs[0], norm_weight=ln1.weight,
                           eps=ln1.eps)
        out = attn.attend(positions, qkv, meta)
        fused_linear(attn.o_proj, out, configs[1], residual=residual)
        gate_up = fused_linear(mlp.gate_up_proj, residual, configs[2], norm_weight=ln2.weight,
                               eps=ln2.eps)
        fused_linear(mlp.down_proj, gate_up, configs[3], silu=True, residual=residual)
        return None, residual


class TransformerModel(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        rotary_emb = RotaryEmbedding(head_dim, max_positions, rope_parameters(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, rotary_emb, quant_config, f"model.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A draft head with EAGLE-3's multi-layer features (models/eagle_head.py) also reads
        # the hidden state entering these layers, through each layer's input norm;
        # `forward` collects them in `aux_hidden_states` (set by the engine).
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        aux = self.aux_hidden_state_layers
        self.aux_hidden_states = []
        for i, layer in enumerate(self.layers):
            if i in aux:
                # the residual stream entering layer i (x None: the last layer ran fused and
                # added in place), normalized as layer i reads it; a new tensor, so later
                # in-place adds to the stream leave it alone
                stream = residual if x is None else x if residual is None else x + residual
                self.aux_hidden_states.append(layer.input_layernorm(stream))
            x, residual = layer(positions, x, residual, meta)
        if x is None:  # the last layer ran fused: the residual stream is the output
            return self.norm(residual)
        x, _ = self.norm(x, residual)
        return x


class TransformerForCausalLM(nn.Module):
    """forward(flat input_ids [T], positions [T], AttentionMetadata) -> hidden states [T, h];
    compute_logits(hidden) -> logits. The LM head stays unquantized, as in vLLM, unless the
    checkpoint quantized it (GPTQ `lm_head: true`)."""

    def __init__(self, config: PretrainedConfig, max_positions: int,
                 quant_config: QuantizationConfig | None = None,
                 attention_backend: str | AttentionBackend = "torch") -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        backend = (attention_backend if isinstance(attention_backend, AttentionBackend)
                   else get_attention_backend(attention_backend))
        self.model = TransformerModel(config, backend, max_positions, quant_config)
        # A quantized head (GPTQ `lm_head: true`) is its own layer even where the config
        # ties it: the embedding lookup keeps the plain table, the logits use the codes.
        quantized_head = quant_config is not None and quant_config.quantizes_lm_head
        self.tie_word_embeddings = (bool(getattr(config, "tie_word_embeddings", False))
                                    and not quantized_head)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size,
                                  quant_config=quant_config if quantized_head else None,
                                  prefix="lm_head")
        # [KV slots + 1, hidden]: with a draft head (models/eagle_head.py), every step's
        # final hidden states are kept by KV slot, where the head reads its input features;
        # the last row takes the writes of rows without a slot (-1: padding, profiling).
        # With aux layers ([KV slots + 1, (1 + n) hidden]) each row is followed by the
        # model's aux_hidden_states.
        self.feature_cache: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(input_ids, positions, attn_metadata)
        cache = self.feature_cache
        if cache is not None and attn_metadata.slot_mapping is not None:
            aux = self.model.aux_hidden_states
            feats = torch.cat([hidden, *aux], dim=-1) if aux else hidden
            cache.index_copy_(0, attn_metadata.slot_mapping.remainder(cache.shape[0]), feats)
        return hidden

    def prepare_chained_step(self, rows: int) -> None:
        """Between two chained decode steps (engine/cuda_graph.py), inside the graph: set up
        the next step's inputs beyond its ids (nothing for a plain model)."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.tie_word_embeddings:
            return dense_linear(hidden_states, self.model.embed_tokens.weight, None,
                                self.model.norm.use_triton)
        return self.lm_head(hidden_states)

    def greedy_draft(self, hidden_states: torch.Tensor, width: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chained draft step's choice (engine/cuda_graph.py): each row's argmax and, with
        `width`, its 2nd..(width + 1)-th best tokens [rows, width] (tree drafts), as float64
        ids (exact). No log-probabilities: a draft step needs none. Ties go to the lowest
        id, as the sampler's argmax."""
        logits = self.compute_logits(hidden_states)
        ups = self.runners_up(logits, width) if width else None
        return greedy_ids(logits), ups

    def greedy_draft_into(self, hidden_states: torch.Tensor, out_f64: torch.Tensor,
                          out_i64: torch.Tensor) -> None:
        """greedy_draft's tokens (no runners-up) written into out_f64 and out_i64 [rows]
        (`write_greedy_ids`): a chained step's output row and the next step's input ids."""
        write_greedy_ids(self.compute_logits(hidden_states), None, out_f64, out_i64)

    def runners_up(self, logits: torch.Tensor, width: int) -> torch.Tensor:
        """[rows, vocab] logits -> each row's 2nd..(width + 1)-th best token ids [rows,
        width], float64 (exact ids, as the greedy tokens): a draft's siblings in tree
        drafts (spec/tree.py)."""
        return logits.topk(width + 1, dim=-1).indices[:, 1:].double()

    @property
    def attention_backend(self) -> AttentionBackend:
        return self.model.layers[0].self_attn.backend

    # whether decode-size steps may run DecoderLayer.forward_fused (it folds each layer's
    # input norm into its qkv GEMV); rope into the K/V cache write does not depend on it
    fused_decode_layers = True

    def set_fused_kernels(self, enabled: bool, fuse_decode: bool | None = None) -> None:
        """Route RMSNorm, rotary, SiLU-and-mul and the linear layers (where tuned faster, see
        kernels/gemm_tuning.py) through Triton kernels (CUDA) or the PyTorch code (CPU,
        reference). With `fuse_decode` (default: on with the kernels) decode-size steps also
        fold norms, SiLU-and-mul and residual adds into the dense GEMVs and rope into the K/V
        cache write (`DecoderLayer.forward_fused`)."""
        fuse_decode = enabled and (fuse_decode is None or fuse_decode)
        for module in self.modules():
            if hasattr(module, "use_triton"):
                module.use_triton = enabled
            if isinstance(module, DecoderLayer):
                module.fuse_decode = fuse_decode and self.fused_decode_layers
                module._fused_by_rows.clear()
        backend = self.attention_backend
        if hasattr(backend, "fuse_rope_cache"):
            backend.fuse_rope_cache = fuse_decode

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def bind_kv_caches(self, kv_caches: list[torch.Tensor] | None) -> None:
        """Give each layer its cache [2, num_blocks, block_size, kv_heads, head_dim] (or None)."""
        for i, attn in enumerate(self.attention_layers()):
            attn.kv_cache = None if kv_caches is None else kv_caches[i]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of our parameters that were filled
        completely (a fused parameter only once every shard arrived)."""
        params = dict(self.named_parameters())
        shards_seen: dict[str, set[int | None]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints store a copy of the embedding
            shard, checkpoint_name = None, name
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in STACKED_PARAMS:
                fused, shard = STACKED_PARAMS[parts[-2]]
                name = ".".join([*parts[:-2], fused, parts[-1]])
            if name not in params:
                raise KeyError(name)
            param = params[name]
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(owner, Linear):
                try:
                    owner.weight_loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"tensor '{checkpoint_name}': {e}") from e
            elif tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor '{checkpoint_name}': shape {tuple(tensor.shape)} "
                                 f"does not fit {tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
            shards_seen.setdefault(name, set()).add(shard)
        loaded = set()
        for name, seen in shards_seen.items():
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            needed = {None} if None in seen else set(range(len(getattr(owner, "output_sizes", []))))
            if seen >= needed:
                loaded.add(name)
        return loaded
